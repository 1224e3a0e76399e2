"""Multi-turn conversations on a DP mesh: prefill tokens computed for the second turns with the balancer weighing
each rank's prefix cache (engine/balance.py ``cached``) and without (every rank's cache counted as empty).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/cache_aware_ranks.py [--mesh 1x4]
        [--conversations 16] [--history 300] [--rounds 2]

Embedded model, LLM defaults, greedy. Turn 1: each conversation's first prompt (random tokens, lengths
log-uniform in [history / 3, 2 history]) and 32 new tokens. Turn 2, one call: each conversation's prompt + reply +
16 new tokens, each beside a new conversation's first prompt (as many, the same lengths' distribution). Prints per
mode: the second call's prefill tokens, the turns' cached prompt tokens out of their histories' tokens, the call's
wall time (the first round compiles), and how many completions differ between the modes. One engine per mode,
new conversations each round.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="1x4")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--history", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()

    import jaxinfer
    from jaxinfer.engine import scheduler as sched_mod

    rng = np.random.default_rng(0)
    greedy = jaxinfer.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    aware = sched_mod.Scheduler._cached_tokens
    results = {}
    llms = {mode: jaxinfer.LLM(mesh=args.mesh, dtype=args.dtype) for mode in ("aware", "blind")}
    vocab = llms["aware"].model.config.vocab_size
    for r in range(args.rounds):
        lengths = np.exp(rng.uniform(np.log(args.history / 3), np.log(args.history * 2), args.conversations))
        first = [rng.integers(2, vocab, int(n)).tolist() for n in lengths]
        extra = [rng.integers(2, vocab, 16).tolist() for _ in range(args.conversations)]
        fresh = [rng.integers(2, vocab, int(n)).tolist() for n in np.exp(rng.uniform(
            np.log(args.history / 3), np.log(args.history * 2), args.conversations))]
        for mode, llm in llms.items():
            sched_mod.Scheduler._cached_tokens = aware if mode == "aware" else (
                lambda self, seq, pending: [0] * self.num_ranks)
            outs = llm.generate(first, greedy, use_tqdm=False)
            turns = [p + o.outputs[0].token_ids + e for p, o, e in zip(first, outs, extra)]
            second = [x for pair in zip(turns, fresh) for x in pair]  # next turns among new conversations
            t0 = time.perf_counter()
            outs2 = llm.generate(second, greedy, use_tqdm=False)
            wall = time.perf_counter() - t0
            results.setdefault(mode, []).append(dict(
                prefill_tokens=llm.stats.prefill_tokens, wall_s=round(wall, 3),
                cached=sum(o.metrics["num_cached_prompt_tokens"] for o in outs2[::2]),
                history_tokens=sum(len(t) - 16 for t in turns), tokens=[o.outputs[0].token_ids for o in outs2]))
    sched_mod.Scheduler._cached_tokens = aware
    for mode, runs in results.items():
        print(json.dumps({"mode": mode, "mesh": args.mesh, "runs": [
            {k: v for k, v in run.items() if k != "tokens"} for run in runs]}))
    # Other ranks mean other batch compositions: outputs agree to rounding, not bitwise (greedy near-ties can flip)
    print(json.dumps({"completions_that_differ": [sum(x != y for x, y in zip(a["tokens"], b["tokens"]))
                                                  for a, b in zip(results["aware"], results["blind"])],
                      "completions": 2 * args.conversations}))


if __name__ == "__main__":
    main()
