"""x [M, K] @ W [N, K]^T on XLA:CPU: the plain product vs the transposed one ((W @ x^T)^T) vs layers.matmul_nt.

    python benchmarks/gemm_forms.py [--rows 1,2,8,32,64,128] [--shapes 4096x512,8192x512,...] [--repeats 5]
        [--dtype float32 | bfloat16]

The shapes (N x K) default to the benchmark model's decode GEMMs (forward_vs_transformers.py): routed experts'
gate/up as one matrix (16 x 256 rows), the LM head, the dense MLP, attention projections; S x N x K shapes are
batched (x [S, M, K] @ W [S, N, K]^T per s: the capacity path's per-expert matmuls, M rows per expert). Each call
gets the next of several weight copies (over 32 MB in all), so weights come from memory as in a decode step, not from
cache. Prints the minimum over --repeats passes in ms, the speedup of the transposed form (TRANSPOSED_PRODUCT_ROWS in
layers.py is where it wins) and matmul_nt as shipped (one row: a float32 matrix-vector product). --dtype is the
operands' dtype (float32 accumulation and output in every form).
"""

from __future__ import annotations

import argparse
import math
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,8,32,64,128")
    p.add_argument("--shapes", default="4096x512,8192x512,1408x512,512x1408,768x192,512x512,16x256x512,16x512x256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.layers import matmul_nt

    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    f32 = {"preferred_element_type": jnp.float32}
    plain = jax.jit(lambda x, w: jnp.einsum("...mk,...nk->...mn", x, w, **f32))
    # The transposed form as layers.matmul_nt writes it, whatever the row count.
    transposed = jax.jit(lambda x, w: jnp.swapaxes(
        jax.lax.optimization_barrier(jnp.einsum("...nk,...mk->...nm", w, x, **f32)), -1, -2))
    forms = {"plain": plain, "transposed": transposed, "matmul_nt": jax.jit(matmul_nt)}

    print(f"x [M, K] @ W [N, K]^T, {dtype.name}, {jax.devices()[0].platform}; min ms over {args.repeats} passes")
    print(f"{'[S x] N x K':>12} {'M':>5} {'plain':>8} {'transposed':>11} {'speedup':>8} {'matmul_nt':>10}")
    for shape in args.shapes.split(","):
        *batch, n, k = (int(v) for v in shape.split("x"))
        copies = max(2, -(-32 * 2**20 // (math.prod(batch) * n * k * 4)))
        ws = [jnp.asarray(rng.standard_normal((*batch, n, k)), dtype) for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((*batch, m, k)), dtype)
            for fn in (transposed, forms["matmul_nt"]):
                np.testing.assert_allclose(np.asarray(fn(x, ws[0])), np.asarray(plain(x, ws[0])), rtol=1e-4,
                                           atol=1e-3)
            best = {}
            for name, fn in forms.items():
                times = []
                for _ in range(args.repeats):
                    for w in ws:
                        t0 = time.perf_counter()
                        fn(x, w).block_until_ready()
                        times.append(time.perf_counter() - t0)
                best[name] = min(times) * 1e3
            print(f"{shape:>12} {m:5d} {best['plain']:8.3f} {best['transposed']:11.3f} "
                  f"{best['plain'] / best['transposed']:7.2f}x {best['matmul_nt']:10.3f}", flush=True)


if __name__ == "__main__":
    main()
