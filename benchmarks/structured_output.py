"""Structured output on the embedded model: decode tokens/s of JSON-constrained requests against unconstrained
ones, and the host's time per constrained step, per schema and batch size.

    python benchmarks/structured_output.py [--schema person order] [--batch 8 32] [--rounds 5] [--max-tokens N]

LLM's defaults (bfloat16, the default multi-step decode, one CPU device), temperature 1, prefix caching off. Each
round runs ``generate`` on the same prompts twice, in alternating order: constrained by a JSON Schema (``SCHEMAS``:
"person", flat with short values; "order", nested, with an array and long enum values; no free whitespace) and
unconstrained (EOS ignored, max_tokens the constrained outputs' mean length in the last warm-up run: its rows all
run to that length, where constrained ones finish at their own lengths). Warm-up runs repeat until one compiles
nothing (the constrained steps' shapes vary with the samples and the steps' groupings; ``warmup_compiles``: the
compilations of each, programs shared with earlier schemas and batches not counted again), and a round that still
compiles a new shape is dropped (counted in the output) and another run.
Decode tok/s = output tokens / (generate time - the last first token's time); the ratio is per round, and the
figures are medians over rounds (docs/benchmarks.md "How to read"). Host time per constrained step: llguidance's
mask fill and the matchers' token consumption (engine/structured_output.py ``Grammars``), timed around those
calls, divided by the constrained call's steps. Every constrained output is checked against the schema.
"""

import argparse
import json
import statistics
import time

SCHEMAS = {
    # Bounded strings, an integer range, an enum, a boolean: short values between forced keys.
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "active": {"type": "boolean"},
            "city": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "age", "role", "active", "city"],
        "additionalProperties": False,
    },
    # A nested object and an array of objects: long enum values (forced after their first tokens), longer keys.
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1000, "maximum": 9999},
            "status": {"enum": ["pending_payment", "shipped_to_customer", "delivered_and_signed"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": {"enum": ["KEYBOARD-MECHANICAL", "MOUSE-WIRELESS", "MONITOR-27-INCH"]},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "quantity"], "additionalProperties": False}},
            "shipping": {"type": "object", "properties": {"express": {"type": "boolean"},
                                                          "note": {"type": "string", "maxLength": 10}},
                         "required": ["express", "note"], "additionalProperties": False},
        },
        "required": ["order_id", "status", "items", "shipping"],
        "additionalProperties": False,
    },
}


# Above the longest valid output of each schema (the embedded model spells some values in many tokens).
MAX_TOKENS = {"person": 96, "order": 192}


class Compiles:
    """Counts XLA backend compilations (jax.monitoring events) while active."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        import jax

        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **kwargs):
        self.count += event == self.EVENT


def timed(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    decode = wall - max(o.metrics["ttft_s"] for o in outs)
    return outs, decode, sum(len(c.token_ids) for o in outs for c in o.outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schema", nargs="+", choices=sorted(SCHEMAS), default=sorted(SCHEMAS, reverse=True))
    parser.add_argument("--batch", type=int, nargs="+", default=[32])
    parser.add_argument("--rounds", type=int, default=5, help="rounds that compile nothing (at most 3x run)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the schema's MAX_TOKENS")
    parser.add_argument("--warmup", type=int, default=8, help="constrained warm-up runs at most")
    args = parser.parse_args()

    import jaxinfer

    llm = jaxinfer.LLM(mesh="1x1", enable_prefix_caching=False)
    for schema in args.schema:
        for batch in args.batch:
            print(json.dumps(measure(llm, schema, batch, args)), flush=True)


def measure(llm, schema_name: str, batch: int, args) -> dict:
    import jsonschema

    import jaxinfer

    grammars = llm.engine.grammars
    host = {"s": 0.0}

    def timing(fn):
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                host["s"] += time.perf_counter() - t0
        return wrapped

    masks, consume = grammars.masks, grammars.consume
    grammars.masks, grammars.consume = timing(masks), timing(consume)
    schema = SCHEMAS[schema_name]
    prompts = [f"Record {i} as JSON:" for i in range(batch)]
    constraint = jaxinfer.StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    max_tokens = args.max_tokens or MAX_TOKENS[schema_name]
    runs = {"json": jaxinfer.SamplingParams(temperature=1.0, max_tokens=max_tokens, structured_outputs=constraint)}
    compiles = Compiles()
    warmup_compiles = []
    for _ in range(args.warmup):  # until a run compiles nothing
        llm.wait_for_compilations()
        before = compiles.count
        _, _, tokens = timed(llm, prompts, runs["json"])
        warmup_compiles.append(compiles.count - before)
        if compiles.count == before:
            break
    # Unconstrained rows as long as the constrained outputs on average (attention over longer rows costs more).
    free_tokens = round(tokens / batch)
    runs["free"] = jaxinfer.SamplingParams(temperature=1.0, max_tokens=free_tokens, ignore_eos=True)
    timed(llm, prompts, runs["free"])
    rates = {name: [] for name in runs}
    ratios, host_per_step, steps_json, lengths, dropped = [], [], [], [], 0
    for r in range(3 * args.rounds):
        if len(ratios) == args.rounds:
            break
        before = compiles.count
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        got = {}
        for name in order:
            host["s"] = 0.0
            outs, decode, tokens = timed(llm, prompts, runs[name])
            got[name] = tokens / decode
            if name == "json":
                for o in outs:
                    assert o.outputs[0].finish_reason == "stop", o.outputs[0]
                    jsonschema.validate(json.loads(o.outputs[0].text), schema)
                json_run = host["s"] / llm.stats.steps, llm.stats.steps, tokens / batch
        if compiles.count != before:  # a shape first seen now: its compile is not decode time
            dropped += 1
            continue
        for name in runs:
            rates[name].append(got[name])
        for values, x in zip((host_per_step, steps_json, lengths), json_run):
            values.append(x)
        ratios.append(got["json"] / got["free"])
    grammars.masks, grammars.consume = masks, consume
    if not ratios:
        return {"schema": schema_name, "batch": batch, "error": "every round compiled a new shape",
                "rounds_dropped_for_compiles": dropped, "warmup_compiles": warmup_compiles}
    return {"schema": schema_name, "batch": batch, "max_tokens": {"json": max_tokens, "free": free_tokens},
            "decode_tok_s": {name: round(statistics.median(v), 1) for name, v in rates.items()},
            "ratio_json_over_free": round(statistics.median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios],
            "host_ms_per_constrained_step": round(1e3 * statistics.median(host_per_step), 3),
            "constrained_steps": statistics.median(steps_json),
            "mean_json_tokens": round(statistics.median(lengths), 1),
            "rounds_dropped_for_compiles": dropped, "warmup_compiles": warmup_compiles}


if __name__ == "__main__":
    main()
