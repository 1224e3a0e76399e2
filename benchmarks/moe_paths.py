"""The four XLA compute paths of the routed experts (jaxinfer/models/moe.py expert_ffn) by batch size, on CPU.

    python benchmarks/moe_paths.py [--hidden 512] [--inter 256] [--experts 16] [--top-k 4] [--dtype float32]
        [--skew 0.0]

Times one jitted expert_ffn call per path for M tokens (median of --repeats after a warm-up, the paths
interleaved) and prints which path ``moe_path`` picks for each M. The defaults are the routed experts of the
benchmark model of forward_vs_transformers.py / generate_vs_transformers.py. Routing: each token's top-k distinct
experts drawn with probability proportional to rank^-skew (0: uniform; 1: Zipf-like); "busiest" is the busiest
expert's count over the mean (for each skew and for the random benchmark model's own routing: docs/benchmarks.md
"Routed-expert paths (CPU)").
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,1024")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skew", type=float, default=0.0, help="expert popularity ~ rank^-skew")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.moe import expert_ffn, moe_path

    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    s, d, i, k = args.experts, args.hidden, args.inter, args.top_k
    params = {"gate_proj": jnp.asarray(rng.normal(size=(s, i, d)), dtype),
              "up_proj": jnp.asarray(rng.normal(size=(s, i, d)), dtype),
              "down_proj": jnp.asarray(rng.normal(size=(s, d, i)), dtype)}
    print(f"expert_ffn, {s} experts top-{k}, hidden {d}, moe_intermediate {i}, {args.dtype}, skew {args.skew}; "
          f"ms per call")
    paths = ("gather", "dense", "capacity", "tiled")
    print(f"{'M':>6} {'busiest':>8} " + " ".join(f"{path:>9}" for path in paths) + "  auto")
    popularity = np.arange(1, s + 1, dtype=np.float64) ** -args.skew
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.normal(size=(m, d)), dtype)
        ids_np = np.stack([rng.choice(s, k, replace=False, p=popularity / popularity.sum()) for _ in range(m)])
        ids = jnp.asarray(ids_np, jnp.int32)
        w = jnp.asarray(rng.random((m, k)), jnp.float32)
        busiest = np.bincount(ids_np.ravel(), minlength=s).max() / (m * k / s)
        # one unrolled matvec per assignment: the gather path compiles too long beyond 128 assignments
        fns = {path: jax.jit(functools.partial(expert_ffn, dtype=dtype, path=path)) for path in paths
               if not (path == "gather" and m * k > 128)}
        samples = {path: [] for path in fns}
        for fn in fns.values():
            jax.block_until_ready(fn(params, x, w, ids))
        for _ in range(args.repeats):
            for path, fn in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(params, x, w, ids))
                samples[path].append(time.perf_counter() - t0)
        times = {path: statistics.median(samples[path]) * 1e3 if path in samples else float("nan") for path in paths}
        print(f"{m:>6} {busiest:>7.2f}x " + " ".join(f"{times[path]:>9.2f}" for path in paths) +
              f"  {moe_path(m, k, s)}", flush=True)


if __name__ == "__main__":
    main()
