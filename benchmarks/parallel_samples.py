"""Parallel sampling (``SamplingParams(n=...)``) with prefix caching: the prompt tokens computed, and the ranks'
balance, when the n samples of a prompt are added together.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/parallel_samples.py [--meshes 1x1 1x4]
        [--prompts 8] [--n 4] [--max-tokens 64] [--rounds 2]

Embedded model, LLM defaults (bfloat16, prefix caching on), temperature 1, seeded. Each round: ``--prompts``
prompts of random tokens (lengths uniform in [100, 400]; new ones each round, so nothing is cached from an earlier
round), ``--n`` samples each, one ``generate`` call. Prints per mesh and round: the prompt tokens of all samples,
the prefill tokens the engine computed (``llm.stats.prefill_tokens``), the imbalance (engine/step_log.py) of
prefill tokens and of the decode steps' KV pages and running requests, the call's compilations, wall time and
median TTFT (a round that compiles is not a timing; the simulated devices share the machine's cores: overheads,
not speed-ups). engine/scheduler.py "Prefill" and engine/balance.py say what the engine does with samples.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", nargs="+", default=["1x1", "1x4"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import jax

    import jaxinfer
    from jaxinfer.engine.step_log import imbalance

    compiles = [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **kw: compiles.__setitem__(0, compiles[0] + (event == COMPILE_EVENT)))

    params = jaxinfer.SamplingParams(temperature=1.0, n=args.n, max_tokens=args.max_tokens, seed=0)
    for mesh in args.meshes:
        llm = jaxinfer.LLM(mesh=mesh)
        rng = np.random.default_rng(0)
        vocab = llm.model.config.vocab_size
        for r in range(args.rounds):
            prompts = [{"prompt_token_ids": rng.integers(10, vocab, int(n)).tolist()}
                       for n in rng.integers(100, 401, args.prompts)]
            t0, before = time.perf_counter(), compiles[0]
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            log = llm.stats.step_log
            print(json.dumps(dict(
                mesh=mesh, round=r, prompt_tokens=args.n * sum(len(p["prompt_token_ids"]) for p in prompts),
                prefill_tokens=llm.stats.prefill_tokens,
                imbalance={f"{kind}:{field[5:]}": round(imbalance(log, field, kind), 3) for kind, field in (
                    ("prefill", "rank_tokens"), ("decode", "rank_kv_pages"), ("decode", "rank_requests"))},
                compiles=compiles[0] - before, wall_s=round(wall, 3),
                ttft_median_s=round(statistics.median(o.metrics["ttft_s"] for o in outs), 3),
            )), flush=True)


if __name__ == "__main__":
    main()
