"""MTP speculative decoding on the embedded model: decode tokens/s with and without it, acceptance per draft
position, and the cost of a draft-verify round in plain decode steps.

    python benchmarks/speculative.py [--batch-sizes 1,32] [--k 3] [--rounds 5] [--max-tokens 128] [--scheduler-steps k]
    python benchmarks/speculative.py --knee    # a decode step's time against its positions
    python benchmarks/speculative.py --costs   # fits the confidence rule's StepCost (engine/speculative.py)
    python benchmarks/speculative.py --rounds-ab [--scheduler-steps 8]   # rounds on device against one per step
    python benchmarks/speculative.py --async-ab [--scheduler-steps k]    # async scheduling against applied steps

LLM's defaults (bfloat16, the default multi-step decode, one CPU device), greedy, EOS ignored, prefix caching
off. Prompts: the first words of the first line of stdlib docstrings (the embedded model was trained on Python's
documentation, so its MTP module drafts in its own domain). Each round times ``generate`` of every engine once,
in alternating order, after a warm-up call that compiles every step shape; the figures are medians over rounds,
and speed-ups are per-round ratios (the machine's speed drifts: docs/benchmarks.md "How to read").

Decode tok/s = new tokens / (generate time - the prefill step's time); a round's cost in plain decode steps is
(time per draft-verify round) / (plain decode time per token at the same batch); its ceiling is
tokens per round (the mean acceptance length) / round cost (printed for verify="all", whose decode steps are all
rounds; verify="confidence" also runs plain multi-step steps when no draft is worth verifying).
"""

import argparse
import dataclasses
import inspect
import json
import os
import re
import statistics
import textwrap
import time


def prompts(n: int) -> list[str]:
    """n prompts: the first six words of the first line of stdlib docstrings (fixed list, repeated past 32)."""
    objs = [str.split, str.join, dict.get, list.sort, sorted, open, len, zip, enumerate, range, print, isinstance,
            map, filter, os.path.join, json.dumps, json.loads, re.sub, re.match, textwrap.wrap, inspect.signature,
            max, min, sum, any, all, getattr, hasattr, round, abs, divmod, str.replace]
    words = [" ".join((o.__doc__ or "").strip().splitlines()[0].split()[:6]) for o in objs]
    return [words[i % len(words)] for i in range(n)]


def timed(llm, batch, params):
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    prefill = max(o.metrics["ttft_s"] for o in outs)
    return outs, wall, wall - prefill


def compare(args) -> None:
    import jaxinfer

    common = dict(mesh="1x1", enable_prefix_caching=False, num_scheduler_steps=args.scheduler_steps)
    engines = {"plain": jaxinfer.LLM(**common)}
    for verify in args.verify.split(","):
        engines[verify] = jaxinfer.LLM(**common, speculative_config={
            "method": "mtp", "num_speculative_tokens": args.k, "verify": verify})
    params = jaxinfer.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        batch = prompts(b)
        tokens = {}
        for name, llm in engines.items():  # warm-up: compiles every shape; greedy outputs must agree
            outs, _, _ = timed(llm, batch, params)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            llm.wait_for_compilations()
        same = all(t == tokens["plain"] for t in tokens.values()) or [  # else where each engine first differs
            (name, next((i, j) for i, (a, b) in enumerate(zip(t, tokens["plain"])) for j, (x, y) in enumerate(zip(a, b))
                        if x != y)) for name, t in tokens.items() if t != tokens["plain"]]
        decode = {name: [] for name in engines}
        stats = {}
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                _, _, d = timed(engines[name], batch, params)
                decode[name].append(d)
                stats[name] = engines[name].stats
        n_new = b * (args.max_tokens - 1)  # the prefill step samples the first token
        plain = statistics.median(decode["plain"])
        per_token = plain / (args.max_tokens - 1)  # one plain decode step per token (all rows at once)
        print(f"B={b}: plain decode {n_new / plain:.1f} tok/s ({per_token * 1e3:.2f} ms per token-step); "
              f"outputs equal: {same}")
        for name in engines:
            if name == "plain":
                continue
            s = stats[name]
            spec = statistics.median(decode[name])
            ratios = [p / q for p, q in zip(decode["plain"], decode[name])]
            line = (f"  {name:10s} K={args.k}: decode {n_new / spec:.1f} tok/s, speed-up "
                    f"x{statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f}); drafts "
                    f"{s.num_drafts}, verified {s.num_draft_tokens}, accepted {s.num_accepted_tokens}, per position "
                    f"{list(s.accepted_per_position)} (rates "
                    f"{', '.join(f'{a / max(1, s.num_drafts):.3f}' for a in s.accepted_per_position)}), mean "
                    f"acceptance length {s.mean_acceptance_length:.2f}; {s.steps} steps")
            if name == "all":  # every decode step verifies (confidence mixes in plain multi-step steps)
                per_round = spec / max(1, round_count(s, b))
                cost = per_round / per_token
                line += (f"; round {per_round * 1e3:.2f} ms = {cost:.2f} plain token-steps, ceiling "
                         f"x{s.mean_acceptance_length / cost:.2f}")
            print(line, flush=True)


def round_count(stats, batch: int) -> float:
    """Draft-verify rounds of a call, per sequence: a decode step runs up to num_scheduler_steps rounds on device,
    each sequence taking part in a round counts it in ``num_drafts`` (these rows run in lockstep: their rounds
    are the program's)."""
    return stats.num_drafts / batch


def ab(args, settings: dict, label: str) -> None:
    """One speculative engine (K = --k, verify="all") under two settings (name -> a function that applies it to
    the LLM), switched before each call, --rounds alternating pairs per batch size after a call of each that
    compiles; per setting the decode time, steps, rounds per sequence, time per round and the host's and the
    waits' shares (EngineStats.host_s, wait_s), the per-pair ratio (the second setting's speed over the first's),
    and whether the two gave the same tokens."""
    import jaxinfer

    params = jaxinfer.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = jaxinfer.LLM(mesh="1x1", enable_prefix_caching=False, speculative_config={
        "method": "mtp", "num_speculative_tokens": args.k})
    if args.scheduler_steps:
        llm.engine.scheduler.num_scheduler_steps = args.scheduler_steps
    names = list(settings)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        batch = prompts(b)
        runs, tokens = {name: [] for name in names}, {}
        for name in names:  # compiles
            settings[name](llm)
            tokens[name] = [o.outputs[0].token_ids for o in timed(llm, batch, params)[0]]
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                settings[name](llm)
                decode = timed(llm, batch, params)[2]
                s = llm.stats
                runs[name].append((decode, s.host_s, s.wait_s, s.steps, round_count(s, b)))
        for name, rows in runs.items():
            decode, host, wait, steps, rounds = (statistics.median(x) for x in zip(*rows))
            print(f"B={b}, {name}: decode {decode * 1e3:.1f} ms, {steps:.0f} steps, {rounds:.1f} rounds per "
                  f"sequence, {decode / rounds * 1e3:.2f} ms per round; host {host * 1e3:.1f} ms, waiting "
                  f"{wait * 1e3:.1f} ms", flush=True)
        ratios = [a[0] / b_[0] for a, b_ in zip(runs[names[0]], runs[names[1]])]
        print(f"B={b}: {label} x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); the same "
              f"tokens: {tokens[names[0]] == tokens[names[1]]}", flush=True)


def rounds_ab(args) -> None:
    """Rounds on device against one round per step (``ab``): the scheduler's num_scheduler_steps switched between
    1 and --scheduler-steps (default 8)."""
    many = args.scheduler_steps or 8

    def steps(k):
        return lambda llm: setattr(llm.engine.scheduler, "num_scheduler_steps", k)

    ab(args, {"1 round per step": steps(1), f"{many} rounds per step": steps(many)},
       f"{many} rounds per step against one")


def async_ab(args) -> None:
    """Async scheduling against every step applied before the next is built (``ab``: the engine's
    EngineConfig.async_scheduling switched), at --scheduler-steps rounds per step (default the platform's)."""

    def overlap(on):
        return lambda llm: setattr(llm.engine, "config", dataclasses.replace(llm.engine.config, async_scheduling=on))

    ab(args, {"applied steps": overlap(False), "async": overlap(True)}, "async against applied steps")


def knee(args) -> None:
    """A plain decode step (num_scheduler_steps=1) of B rows for B in --knee-batches: per-step time against its
    positions, and the least-squares line time = a + b * positions (knee = a / b positions)."""
    import jaxinfer
    import numpy as np

    llm = jaxinfer.LLM(mesh="1x1", enable_prefix_caching=False, num_scheduler_steps=1)
    params = jaxinfer.SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    xs, ys = [], []
    for b in [int(x) for x in args.knee_batches.split(",")]:
        batch = prompts(b)
        timed(llm, batch, params)
        per_step = statistics.median(timed(llm, batch, params)[2] / 32 for _ in range(args.rounds))
        xs.append(b)
        ys.append(per_step)
        print(f"positions {b:3d}: {per_step * 1e3:.2f} ms per decode step", flush=True)
    slope, intercept = np.polyfit(xs, ys, 1)
    print(f"time = {intercept * 1e3:.2f} ms + {slope * 1e3:.3f} ms x positions; knee = {intercept / slope:.1f} "
          "positions")


def costs(args) -> None:
    """Fits engine/speculative.py's StepCost on this machine from decode wall times (``timed``: the host's work
    included, as a step waits for it or overlaps it), the engines alternating within each batch size (the
    machine's speed drifts by more than the differences measured), ``--rounds`` calls each after one that
    compiles, medians: plain multi-step decode iterations of B rows (decode time / tokens per row = a + b * B: b
    is the position-time, knee = a / b), and draft-verify rounds with K = 1 and K = 3 (every draft verified, T = K
    + 1) in LLM's default steps of num_scheduler_steps = m rounds on device (decode time / rounds per row),
    against round(B, T, K, m) = fixed / m + (1 + mtp) (knee + B T) + (K - 1) mtp (knee + B). Prints the fitted
    StepCost and, per measured round, the model's value beside the measured one."""
    import jaxinfer
    import numpy as np
    from jaxinfer.engine.speculative import StepCost

    params = jaxinfer.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    batches = [int(x) for x in args.batch_sizes.split(",")]
    engines = {0: jaxinfer.LLM(mesh="1x1", enable_prefix_caching=False)}
    for k in (1, 3):
        engines[k] = jaxinfer.LLM(mesh="1x1", enable_prefix_caching=False,
                                  speculative_config={"method": "mtp", "num_speculative_tokens": k})
    k_steps = engines[0].config.num_scheduler_steps
    per = {}  # (K, B) -> seconds per plain iteration (K = 0) or per round
    for b in batches:
        batch = prompts(b)
        samples = {k: [] for k in engines}
        for llm in engines.values():
            timed(llm, batch, params)  # compiles
        for r in range(args.rounds):
            for k in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                decode = timed(engines[k], batch, params)[2]
                samples[k].append(decode / (round_count(engines[k].stats, b) if k else args.max_tokens - 1))
        for k in engines:
            per[k, b] = statistics.median(samples[k])
        print(f"B={b}: plain {per[0, b] * 1e3:.3f} ms per iteration; rounds of {k_steps} per step: K=1 "
              f"{per[1, b] * 1e3:.3f} ms, K=3 {per[3, b] * 1e3:.3f} ms", flush=True)
    slope, intercept = np.polyfit(batches, [per[0, b] for b in batches], 1)
    knee = max(intercept / slope, 0.0)
    print(f"plain iteration = {intercept * 1e3:.3f} ms + {slope * 1e3:.3f} ms x rows: position-time "
          f"{slope * 1e3:.3f} ms, knee {knee:.2f} positions", flush=True)
    rows = [(b, k + 1, k, per[k, b] / slope) for k in (1, 3) for b in batches]  # (B, T, K, position-times)
    # round - (knee + B T) = fixed / m + mtp * ((knee + B T) + (K - 1) (knee + B)): linear in (fixed, mtp).
    a = np.array([[1.0 / k_steps, (knee + b * t) + (k - 1) * (knee + b)] for b, t, k, _ in rows])
    y = np.array([r - (knee + b * t) for b, t, k, r in rows])
    (fixed, mtp), *_ = np.linalg.lstsq(a, y, rcond=None)
    cost = StepCost(knee, fixed, mtp)
    print(f"StepCost(knee={knee:.2f}, fixed={fixed:.1f}, mtp={mtp:.3f}); rounds, model against measured "
          "(position-times): " + ", ".join(f"K={k} B={b} {cost.round(b, t, k, k_steps):.1f} / {r:.1f}"
                                            for b, t, k, r in rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--verify", default="all,confidence")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--knee", action="store_true")
    p.add_argument("--knee-batches", default="1,2,4,8,16,32,64")
    p.add_argument("--costs", action="store_true")
    p.add_argument("--scheduler-steps", type=int, default=None,
                   help="num_scheduler_steps of every engine (plain iterations / rounds per step; default the "
                        "platform's: 8 on CPU, 1 on GPU; with --rounds-ab the rounds against one, default 8)")
    p.add_argument("--rounds-ab", action="store_true")
    p.add_argument("--async-ab", action="store_true")
    args = p.parse_args()
    run = (knee if args.knee else costs if args.costs else rounds_ab if args.rounds_ab else async_ab if args.async_ab
           else compare)
    run(args)


if __name__ == "__main__":
    main()
