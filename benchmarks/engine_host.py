"""Host time per engine step: LLM.generate on the embedded model (greedy, 64-token random prompts, 64 new tokens,
EOS ignored, prefix caching off), wall time and EngineStats.host_s / steps, median of --repeats calls after a warm-up.

    python benchmarks/engine_host.py [--dtype float32] [--batch-sizes 1,32] [--repeats 11]

Run it from two trees in alternation (PYTHONPATH=TREE) to compare their engines: the device's work is the same,
so the host time per step is what a change to the scheduler, the runner or the engine loop moves.
"""

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--repeats", type=int, default=11)
    args = p.parse_args()

    import jaxinfer

    llm = jaxinfer.LLM(mesh="1x1", dtype=args.dtype, num_kv_pages=256, enable_prefix_caching=False)
    params = jaxinfer.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rng = np.random.default_rng(0)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = rng.integers(0, llm.model.config.vocab_size, (b, 64)).tolist()
        llm.generate(prompts, params, use_tqdm=False)  # compiles every step shape
        llm.wait_for_compilations()
        walls, hosts = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
            hosts.append(llm.stats.host_s / llm.stats.steps)
        print(f"B={b}: generate {statistics.median(walls) * 1e3:.1f} ms, host per step "
              f"{statistics.median(hosts) * 1e3:.3f} ms over {llm.stats.steps} steps", flush=True)


if __name__ == "__main__":
    main()
