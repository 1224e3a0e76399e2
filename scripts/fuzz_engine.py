"""Differential fuzz of the engine's feature combinations (not part of the test suite: minutes per run).

Random workloads of the embedded model (float32 unless --dtype says otherwise) go through two engines that must agree:
  --mode spec  a plain engine and an MTP speculative one (K drafts, verify "all" or "confidence"): greedy requests
               with stop strings, stop token ids, logprobs, penalties, n = 2 and structured output; tokens, text,
               finish reasons and logprobs must be equal (speculation changes no greedy output: docs/architecture.md);
  --mode pd    a co-located 1x1 engine and prefill/decode disaggregation in one process (prefill 1x2, decode 2x2),
               greedy and seeded sampling: the same tokens (seeded samples equal the co-located engine's);
  --mode pdremote  as pd, the pair across two processes (this one prefills on 1x1, a child process decodes on
               2x2, engine/pd_remote.py);
  --mode stream  one MTP speculative engine (--k 0: plain): requests streamed through LLMEngine.step as DELTA or
               CUMULATIVE outputs add up to what LLM.generate returns (greedy and seeded), and no cumulative text is
               later cut;
  --mode seed  one engine: a seeded sampling request alone and inside a batch of others gets the same tokens;
  --mode config  a default engine and --variants engines of random options that promise the same outputs
               (moe_path, num_scheduler_steps, greedy_screening, prefill_layout, attention_backend,
               async_scheduling, prefix caching, the KV storage tier, chunk size, pages, max_num_seqs), greedy
               requests as in spec mode, each workload run twice on every variant (prefix and storage-tier hits).
--mesh sets the engines' mesh in the spec, seed and config modes (e.g. 2x4: DP attention, expert parallelism).
Few KV pages force preemption, and repeated prompt pieces hit the prefix cache. Mismatches are printed; the exit
status is 1 if there was any.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/fuzz_engine.py --mode spec --iters 14
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile

PIECES = ["The with statement is used to", "def fib(n):", "Return a list of", "import os\nimport sys\n",
          "class Foo:\n    def __init__(self):", "The following example shows how", "x = [i for i in range(",
          "Raise ValueError if"]
CONSTRAINTS = [{"choice": ["yes", "no", "maybe so"]}, {"regex": "[a-z]+ [0-9]{2,4}"},
               {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]


def prompt(rng: random.Random) -> str:
    p = rng.choice(PIECES)
    if rng.random() < 0.5:
        p += " " + rng.choice(PIECES)
    if rng.random() < 0.3:
        p *= rng.randint(2, 6)
    return p


def request_params(rng: random.Random, tokenizer, sampled: bool):
    """Random SamplingParams: greedy (or, with ``sampled``, sometimes seeded sampling) with a random mix of
    features."""
    from jaxinfer import SamplingParams

    kw = dict(temperature=0, max_tokens=rng.choice([1, 2, 3, 7, 16, 40, 90]), ignore_eos=rng.random() < 0.5)
    r = rng.random()
    if r < 0.15:
        kw["stop"] = [rng.choice([" the", "\n", "(", ":", "."])]
    elif r < 0.25:
        kw["stop_token_ids"] = [rng.randrange(tokenizer.vocab_size) for _ in range(3)] + tokenizer.encode(" the")[-1:]
    if rng.random() < 0.2:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.15:
        kw["repetition_penalty"] = 1.3
    if rng.random() < 0.1:
        kw["frequency_penalty"] = 0.5
    if rng.random() < 0.1:
        kw["presence_penalty"] = rng.choice([-0.5, 1.0])
    if rng.random() < 0.15:
        kw["n"] = 2
    if sampled and rng.random() < 0.2:
        kw.update(temperature=rng.choice([0.5, 1.0]), top_k=rng.choice([-1, 20]), top_p=rng.choice([1.0, 0.8]),
                  min_p=rng.choice([0.0, 0.05]), seed=rng.randrange(10**6))
    if rng.random() < 0.1:
        kw["structured_outputs"] = rng.choice(CONSTRAINTS)
    return SamplingParams(**kw)


def variant_options(rng: random.Random, tmp: str) -> dict:
    """Random engine options whose outputs must equal the default engine's (EngineConfig's docstring)."""
    options = dict(
        num_kv_pages=rng.choice([12, 16, 24, 64]), max_num_seqs=rng.choice([2, 3, 8]),
        max_num_batched_tokens=rng.choice([32, 64, 200, 2048]), enable_prefix_caching=rng.random() < 0.7,
        async_scheduling=rng.random() < 0.5, num_scheduler_steps=rng.choice([None, 1, 3]),
        greedy_screening=rng.choice([None, True, False]), prefill_layout=rng.choice(["blocks", "grid"]),
        moe_path=rng.choice([None, "gather", "dense", "capacity", "grouped", "ragged"]),
        attention_backend=rng.choice([None, None, None, "pallas"]))
    if options["enable_prefix_caching"] and rng.random() < 0.6:
        options["kv_cache_dir"] = tempfile.mkdtemp(prefix="kv_", dir=tmp)
        if rng.random() < 0.3:
            options["kv_cache_max_bytes"] = rng.choice([1, 8]) << 20
    return options


def streamed(engine, prompts, params, kind: str):
    """The requests run through engine.step() with output_kind ``kind``; each request's outputs put together as
    one final RequestOutput (deltas concatenated, or the last cumulative output, after checking that every
    cumulative text is a prefix of the final one)."""
    import copy

    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", p, sp, output_kind=kind)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    results = []
    for i in range(len(prompts)):
        outs = seen[f"s{i}"]
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished, f"request {i}: finished flags"
        final = copy.deepcopy(outs[-1])
        for j, c in enumerate(final.outputs):
            if kind == "delta":
                c.token_ids = [t for o in outs for t in o.outputs[j].token_ids]
                c.text = "".join(o.outputs[j].text for o in outs)
                if c.logprobs is not None:
                    c.logprobs = [x for o in outs for x in o.outputs[j].logprobs]
            else:
                assert all(c.text.startswith(o.outputs[j].text) for o in outs), f"request {i}: text later cut"
                assert all(c.token_ids[:len(o.outputs[j].token_ids)] == list(o.outputs[j].token_ids)
                           for o in outs), f"request {i}: tokens later changed"
        results.append(final)
    return results


def decode_process(options: dict):
    """(a child process serving a DecodeServer of these engine options, its address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    code = ("import sys\nfrom jaxinfer.engine.config import EngineConfig\n"
            "from jaxinfer.engine.pd_remote import DecodeServer\n"
            f"sys.exit(DecodeServer(EngineConfig(**{options!r}), {address!r}).run())")
    return subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy()), address


def compare(a, b, params, label: str) -> list[str]:
    """Mismatches between two engines' outputs of the same requests."""
    bad = []
    for i, (x, y, sp) in enumerate(zip(a, b, params)):
        for j, (ox, oy) in enumerate(zip(x.outputs, y.outputs)):
            if (ox.token_ids, ox.text, ox.finish_reason) != (oy.token_ids, oy.text, oy.finish_reason):
                bad.append(f"{label} request {i} sample {j} {sp}\n  {ox.token_ids} {ox.finish_reason} {ox.text!r}\n"
                           f"  {oy.token_ids} {oy.finish_reason} {oy.text!r}")
            elif ox.logprobs is not None and any(
                    set(lx) != set(ly) or any(abs(lx[t] - ly[t]) > 1e-3 for t in lx)
                    for lx, ly in zip(ox.logprobs, oy.logprobs)):
                bad.append(f"{label} request {i} sample {j}: logprobs differ {sp}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["spec", "pd", "pdremote", "seed", "config", "stream"], default="spec")
    ap.add_argument("--iters", type=int, default=8, help="workloads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=3, help="drafts per round (spec, pd)")
    ap.add_argument("--verify", choices=["all", "confidence"], default="all")
    ap.add_argument("--pages", type=int, default=24, help="KV pages per rank (few: preemption)")
    ap.add_argument("--mesh", default="1x1", help="the engines' mesh (spec, seed, config)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--variants", type=int, default=3, help="engines of random options (config)")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jaxinfer
    from jaxinfer import SamplingParams

    rng = random.Random(args.seed)
    common = dict(dtype=args.dtype, num_kv_pages=args.pages, max_num_seqs=8)
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "verify": args.verify}
    if args.mode == "spec":
        first = jaxinfer.LLM(mesh=args.mesh, **common)
        second = jaxinfer.LLM(mesh=args.mesh, **common, speculative_config=spec)
    elif args.mode == "pd":
        first = jaxinfer.LLM(mesh="1x1", **common, speculative_config=spec)
        second = jaxinfer.LLM(prefill_mesh="1x2", decode_mesh="2x2", **common, speculative_config=spec)
    elif args.mode == "pdremote":
        first = jaxinfer.LLM(mesh="1x1", **common, speculative_config=spec)
        decode, address = decode_process(dict(mesh="2x2", **common, speculative_config=spec))
        second = jaxinfer.LLM(mesh="1x1", pd_address=address, **common, speculative_config=spec)
    elif args.mode == "stream":
        first = second = jaxinfer.LLM(mesh=args.mesh, **common, speculative_config=spec if args.k else None)
    elif args.mode == "seed":
        first = second = jaxinfer.LLM(mesh=args.mesh, **common, speculative_config=spec)
    else:
        tmp = tempfile.mkdtemp(prefix="fuzz_engine_")
        first = jaxinfer.LLM(mesh=args.mesh, dtype=args.dtype, num_kv_pages=64, max_num_seqs=8)
        variants = []
        for v in range(args.variants):
            options = variant_options(rng, tmp)
            print(f"variant {v}: {options}", flush=True)
            variants.append(jaxinfer.LLM(mesh=args.mesh, dtype=args.dtype, **options))
    tokenizer = first.tokenizer
    bad = []
    for it in range(args.iters):
        if args.mode == "seed":
            target = prompt(rng)
            params = SamplingParams(temperature=rng.choice([0.5, 1.0]), top_k=rng.choice([-1, 20]),
                                    top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(10**6), ignore_eos=True,
                                    max_tokens=rng.choice([8, 30]), n=rng.choice([1, 2]),
                                    repetition_penalty=rng.choice([1.0, 1.2]))
            alone = first.generate([target], params, use_tqdm=False)
            others = [prompt(rng) for _ in range(rng.randint(1, 7))]
            at = rng.randint(0, len(others))
            batch = others[:at] + [target] + others[at:]
            batch_params = [SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.choice([5, 20, 60]),
                                           ignore_eos=True) for _ in others]
            batch_params.insert(at, params)
            together = second.generate(batch, batch_params, use_tqdm=False)[at:at + 1]
            bad += compare(alone, together, [params], f"workload {it}")
        elif args.mode == "stream":
            prompts = [prompt(rng) for _ in range(rng.randint(1, 10))]
            params = [request_params(rng, tokenizer, sampled=True) for _ in prompts]
            a = first.generate(prompts, params, use_tqdm=False)
            kind = rng.choice(["delta", "cumulative"])
            bad += compare(a, streamed(first.engine, prompts, params, kind), params, f"workload {it} {kind}")
        elif args.mode == "config":
            prompts = [prompt(rng) for _ in range(rng.randint(1, 10))]
            params = [request_params(rng, tokenizer, sampled=True) for _ in prompts]
            a = first.generate(prompts, params, use_tqdm=False)
            for v, llm in enumerate(variants):
                for run in range(2):
                    b = llm.generate(prompts, params, use_tqdm=False)
                    bad += compare(a, b, params, f"workload {it} variant {v} run {run}")
        else:
            prompts = [prompt(rng) for _ in range(rng.randint(1, 10))]
            params = [request_params(rng, tokenizer, sampled=args.mode.startswith("pd")) for _ in prompts]
            a = first.generate(prompts, params, use_tqdm=False)
            b = second.generate(prompts, params, use_tqdm=False)
            bad += compare(a, b, params, f"workload {it}")
        print(f"workload {it}: {len(bad)} mismatches so far", flush=True)
    if args.mode == "pdremote":
        second.close()
        print(f"decode process exit status {decode.wait(60)}")
    print("\n".join(bad) if bad else "no mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
