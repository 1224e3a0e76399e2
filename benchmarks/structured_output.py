"""Structured output on the embedded model: decode tokens/s of JSON-constrained requests against unconstrained
ones, and the host's time per constrained step.

    python benchmarks/structured_output.py [--batch 32] [--rounds 5] [--max-tokens 96]

LLM's defaults (bfloat16, the default multi-step decode, one CPU device), temperature 1, prefix caching off. Each
round runs ``generate`` on the same prompts twice, in alternating order: constrained by a JSON Schema (bounded
strings, integers, an enum, a boolean; no free whitespace) and unconstrained (EOS ignored, the same max_tokens).
Decode tok/s = output tokens / (generate time - the last first token's time); the ratio is per round, and the
figures are medians over rounds (docs/benchmarks.md "How to read"). Host time per constrained step: llguidance's
mask fill and the matchers' token consumption (engine/structured_output.py ``Grammars``), timed around those
calls, divided by the constrained call's steps. Every constrained output is checked against the schema.
"""

import argparse
import json
import statistics
import time

SCHEMA = {
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
}


def timed(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    decode = wall - max(o.metrics["ttft_s"] for o in outs)
    return outs, decode, sum(len(c.token_ids) for o in outs for c in o.outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    import jsonschema

    import jaxinfer

    llm = jaxinfer.LLM(mesh="1x1", enable_prefix_caching=False)
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

    grammars.masks, grammars.consume = timing(grammars.masks), timing(grammars.consume)
    prompts = [f"Person {i} as JSON:" for i in range(args.batch)]
    constraint = jaxinfer.StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    runs = {"json": jaxinfer.SamplingParams(temperature=1.0, max_tokens=args.max_tokens, structured_outputs=constraint),
            "free": jaxinfer.SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)}
    for params in runs.values():  # warm-up: compiles every step shape
        timed(llm, prompts, params)
    rates = {name: [] for name in runs}
    ratios, host_per_step, steps_json = [], [], []
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        got = {}
        for name in order:
            host["s"] = 0.0
            outs, decode, tokens = timed(llm, prompts, runs[name])
            got[name] = tokens / decode
            if name == "json":
                for o in outs:
                    assert o.outputs[0].finish_reason == "stop", o.outputs[0]
                    jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                host_per_step.append(host["s"] / llm.stats.steps)
                steps_json.append(llm.stats.steps)
        for name in runs:
            rates[name].append(got[name])
        ratios.append(got["json"] / got["free"])
    result = {"batch": args.batch, "max_tokens": args.max_tokens,
              "decode_tok_s": {name: round(statistics.median(v), 1) for name, v in rates.items()},
              "ratio_json_over_free": round(statistics.median(ratios), 3),
              "ratios": [round(x, 3) for x in ratios],
              "host_ms_per_constrained_step": round(1e3 * statistics.median(host_per_step), 3),
              "constrained_steps": statistics.median(steps_json)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
