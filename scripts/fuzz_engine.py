"""Differential fuzz of the engine's feature combinations (not part of the test suite: minutes per run).

Random workloads of the embedded model (float32 unless --dtype says otherwise) go through two engines that must agree:
  --mode spec  a plain engine and an MTP speculative one (K drafts, verify "all" or "confidence"): greedy requests
               with stop strings, stop token ids, logprobs, penalties, n = 2 and structured output; tokens, text,
               finish reasons and logprobs must be equal (speculation changes no greedy output: docs/architecture.md);
  --mode pd    a co-located 1x1 engine and prefill/decode disaggregation in one process (prefill 1x2, decode 2x2),
               greedy and seeded sampling: the same tokens (seeded samples equal the co-located engine's);
  --mode pdremote  as pd, the pair across two processes (this one prefills on 1x1, a child process decodes on
               2x2, engine/pd_remote.py);
  --mode stream  one MTP speculative engine (--k 0: plain; --pd: PD in one process): requests streamed through
               LLMEngine.step as DELTA or CUMULATIVE outputs add up to what LLM.generate returns (greedy and
               seeded), and no cumulative text is later cut;
  --mode abort  requests added, stepped and aborted at random times through LLMEngine's API (plain, MTP with --k,
               or PD in one process with --pd): each request not aborted comes back once and equals a
               reference engine's generate (greedy and seeded), none comes back after its abort, and no pages stay
               held once all are done;
  --mode seed  one engine: a seeded sampling request alone and inside a batch of others gets the same tokens;
  --mode config  a default engine and --variants engines of random options that promise the same outputs
               (moe_path, num_scheduler_steps, greedy_screening, prefill_layout, attention_backend,
               async_scheduling, prefix caching, the KV storage tier, chunk size, pages, max_num_seqs), greedy
               requests as in spec mode, each workload run twice on every variant (prefix and storage-tier hits).
--mesh sets the engines' mesh in the spec, seed and config modes (e.g. 2x4: DP attention, expert parallelism).
Few KV pages force preemption, and repeated prompt pieces hit the prefix cache. Mismatches are printed; the exit
status is 1 if there was any. A greedy request whose tokens part where two candidates' logprobs lie within TIE_GAP
(rerun with logprobs) is printed as a TIE and does not count: logits depend on a step's shape by rounding.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/fuzz_engine.py --mode spec --iters 14
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import random
import socket
import subprocess
import sys
import tempfile

PIECES = ["The with statement is used to", "def fib(n):", "Return a list of", "import os\nimport sys\n",
          "class Foo:\n    def __init__(self):", "The following example shows how", "x = [i for i in range(",
          "Raise ValueError if", "s = 'naïve café' # Größe 😀 ü"]
CONSTRAINTS = [{"choice": ["yes", "no", "maybe so"]}, {"regex": "[a-z]+ [0-9]{2,4}"},
               {"regex": "The (answer|café): [0-9]{1,3}(\\.|!) é done"},  # forced runs holding stop strings
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
        kw["stop"] = [rng.choice([" the", "\n", "(", ":", ".", "é", "😀", "ö"])]
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


def workload(rng: random.Random, tokenizer, sampled: bool, least: int = 1, most: int = 10):
    """(prompts, their SamplingParams): between least and most random requests (request_params)."""
    prompts = [prompt(rng) for _ in range(rng.randint(least, most))]
    return prompts, [request_params(rng, tokenizer, sampled) for _ in prompts]


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


def add_step_abort(engine, prompts, params, reference, rng: random.Random, dtype: str) -> list[str]:
    """Requests added over the first steps, some aborted at random moments; what goes wrong (see --mode abort)."""
    bad, returned, aborted, pending = [], {}, set(), list(range(len(prompts)))
    rng.shuffle(pending)
    for _ in range(10_000):
        if pending and rng.random() < 0.5:
            for i in pending[:rng.randint(1, 3)]:
                engine.add_request(f"a{i}", prompts[i], params[i], output_kind="final_only")
                pending.remove(i)
        live = [i for i in range(len(prompts)) if i not in pending and i not in aborted and i not in returned]
        if live and rng.random() < 0.08:
            i = rng.choice(live)
            engine.abort_request(f"a{i}")
            aborted.add(i)
        for out in engine.step():
            i = int(out.request_id[1:])
            if i in aborted:
                bad.append(f"request {i} came back after its abort")
            elif i in returned:
                bad.append(f"request {i} came back twice")
            returned[i] = out
        if not pending and not engine.has_unfinished_requests():
            break
    else:
        return bad + ["requests did not finish"]
    for i, ref in enumerate(reference):
        if i in aborted:
            continue
        if i not in returned:
            bad.append(f"request {i} never came back")
            continue
        bad += compare([ref], [returned[i]], [params[i]], f"request {i}", dtype=dtype)
    engines = [engine.prefill, engine.decode] if hasattr(engine, "prefill") else [engine]
    for e in engines:
        held = [e.scheduler.held_pages(r) for r in range(len(e.scheduler.caches))]
        if any(held):
            bad.append(f"pages still held per rank after all requests ended: {held}")
    return bad


def decode_process(options: dict):
    """(a child process serving a DecodeServer of these engine options, its address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    code = ("import sys\nfrom jaxinfer.engine.config import EngineConfig\n"
            "from jaxinfer.engine.pd_remote import DecodeServer\n"
            f"sys.exit(DecodeServer(EngineConfig(**{options!r}), {address!r}).run())")
    return subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy()), address


# A token's logits depend on its step's shape by rounding (docs/architecture.md "Reference semantics": logprobs by
# up to ~3e-6 in float32, ~1e-2 in bfloat16). Logprobs that differ by less than LOGPROB_TOL agree; two greedy
# candidates closer than TIE_GAP are a tie that rounding may flip.
LOGPROB_TOL = {"float32": 1e-3, "bfloat16": 3e-2}
TIE_GAP = {"float32": 1e-4, "bfloat16": 3e-2}


def tie_gap(first, second, prompts, params, i: int, j: int) -> float | None:
    """Greedy request i's sample j rerun on both engines with logprobs: the gap between the two tokens where they
    first differ, by each engine's logprobs (the larger; inf if they are not both among the top 5), or None if
    the rerun agrees."""
    p = list(params)
    p[i] = dataclasses.replace(p[i], logprobs=max(5, p[i].logprobs or 0))
    x = first.generate(prompts, p, use_tqdm=False)[i].outputs[j]
    y = second.generate(prompts, p, use_tqdm=False)[i].outputs[j]
    t = next((t for t, (u, v) in enumerate(zip(x.token_ids, y.token_ids)) if u != v), None)
    if t is None:
        return None
    u, v = x.token_ids[t], y.token_ids[t]
    gaps = [abs(lp[u] - lp[v]) for lp in (x.logprobs[t], y.logprobs[t]) if u in lp and v in lp]
    return max(gaps) if len(gaps) == 2 else math.inf


def logprobs_agree(lx: dict, ly: dict, tol: float) -> bool:
    """One position's {token: logprob} of two engines agree: within ``tol`` where both have the token, and a token
    that only one has is within ``tol`` of the other's lowest (the top-N's boundary moved by rounding)."""
    return (all(lx[t] == ly[t] or abs(lx[t] - ly[t]) <= tol for t in lx.keys() & ly.keys())  # -inf: masked
            and all(lx[t] <= min(ly.values()) + tol for t in lx.keys() - ly.keys())
            and all(ly[t] <= min(lx.values()) + tol for t in ly.keys() - lx.keys()))


def compare(a, b, params, label: str, explain=None, dtype: str = "float32") -> list[str]:
    """Mismatches between two engines' outputs of the same requests (computed in ``dtype``). With ``explain``
    (tie_gap's arguments after the engines and requests), a greedy request whose tokens part at a tie (gap <=
    TIE_GAP) is reported as "TIE", not as a mismatch."""
    bad = []
    for i, (x, y, sp) in enumerate(zip(a, b, params)):
        for j, (ox, oy) in enumerate(zip(x.outputs, y.outputs)):
            if (ox.token_ids, ox.text, ox.finish_reason) != (oy.token_ids, oy.text, oy.finish_reason):
                gap = explain(i, j) if explain is not None and sp.temperature == 0 else None
                what = f"TIE (logprob gap {gap:.2g}) " if gap is not None and gap <= TIE_GAP[dtype] else ""
                bad.append(f"{what}{label} request {i} sample {j} {sp}\n  {ox.token_ids} {ox.finish_reason} "
                           f"{ox.text!r}\n  {oy.token_ids} {oy.finish_reason} {oy.text!r}")
            elif ox.logprobs is not None and not all(logprobs_agree(lx, ly, LOGPROB_TOL[dtype])
                                                         for lx, ly in zip(ox.logprobs, oy.logprobs)):
                bad.append(f"{label} request {i} sample {j}: logprobs differ {sp}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["spec", "pd", "pdremote", "seed", "config", "stream", "abort"], default="spec")
    ap.add_argument("--iters", type=int, default=8, help="workloads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=3, help="drafts per round (spec, pd)")
    ap.add_argument("--verify", choices=["all", "confidence"], default="all")
    ap.add_argument("--pages", type=int, default=24, help="KV pages per rank (few: preemption)")
    ap.add_argument("--mesh", default="1x1", help="the engines' mesh (spec, seed, config)")
    ap.add_argument("--pd", action="store_true", help="abort and stream modes: PD in one process (prefill 1x2, "
                    "decode 2x2)")
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
    elif args.mode == "abort":
        options = dict(common, speculative_config=spec if args.k else None)
        first = jaxinfer.LLM(mesh="1x1", **dict(options, num_kv_pages=64))
        second = (jaxinfer.LLM(prefill_mesh="1x2", decode_mesh="2x2", **options) if args.pd
                  else jaxinfer.LLM(mesh=args.mesh, **options))
    elif args.mode == "stream":
        where = dict(prefill_mesh="1x2", decode_mesh="2x2") if args.pd else dict(mesh=args.mesh)
        first = second = jaxinfer.LLM(**where, **common, speculative_config=spec if args.k else None)
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
            bad += compare(alone, together, [params], f"workload {it}", dtype=args.dtype)
        elif args.mode == "stream":
            prompts, params = workload(rng, tokenizer, True)
            a = first.generate(prompts, params, use_tqdm=False)
            kind = rng.choice(["delta", "cumulative"])
            b = streamed(first.engine, prompts, params, kind)
            bad += compare(a, b, params, f"workload {it} {kind}", dtype=args.dtype)
        elif args.mode == "abort":
            prompts, params = workload(rng, tokenizer, True, 2, 12)
            a = first.generate(prompts, params, use_tqdm=False)
            bad += [f"workload {it}: {m}" for m in add_step_abort(second.engine, prompts, params, a, rng, args.dtype)]
        elif args.mode == "config":
            prompts, params = workload(rng, tokenizer, True)
            a = first.generate(prompts, params, use_tqdm=False)
            for v, llm in enumerate(variants):
                for run in range(2):
                    b = llm.generate(prompts, params, use_tqdm=False)
                    explain = functools.partial(tie_gap, first, llm, prompts, params)
                    bad += compare(a, b, params, f"workload {it} variant {v} run {run}", explain, args.dtype)
        else:
            prompts, params = workload(rng, tokenizer, args.mode.startswith("pd"))
            a = first.generate(prompts, params, use_tqdm=False)
            b = second.generate(prompts, params, use_tqdm=False)
            explain = functools.partial(tie_gap, first, second, prompts, params)
            bad += compare(a, b, params, f"workload {it}", explain, args.dtype)
        ties = [m for m in bad if m.startswith("TIE")]
        print(f"workload {it}: {len(bad) - len(ties)} mismatches and {len(ties)} ties so far", flush=True)
    if args.mode == "pdremote":
        second.close()
        print(f"decode process exit status {decode.wait(60)}")
    print("\n".join(bad) if bad else "no mismatches")
    return 1 if any(not m.startswith("TIE") for m in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
