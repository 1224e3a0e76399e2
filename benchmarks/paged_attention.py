"""The engine's CPU attention over the paged latent cache, one layer: cached_and_new_attention by chunk size vs
gathering every page, writing the step's latents into the copy and calling mla_decode (the XLA path) on it. Both run
kernels_pallas/mla/xla.py's chunked online softmax: the first over the cache without the step's keys, plus those
keys; the second over a cache that holds them, in chunks of mla_decode's block_pages.

    python benchmarks/paged_attention.py [--batch 32] [--context 1024] [--tokens 1] [--heads 16]
        [--latent 512] [--rope 64] [--chunk-tokens 64,128,256,512] [--repeats 15]

Defaults: V3's latent cache (512 + 64 dims) with 16 query heads (V3 has 128; the score and output products scale with
them, the key reads do not), a decode step (--tokens 1) of --batch sequences with --context tokens each, float32.
Prints min and median ms per call; both compute the same outputs (checked first).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--latent", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--chunk-tokens", default="64,128,256,512")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.kv.paged_cache import write
    from jaxinfer.models.attention import cached_and_new_attention
    from kernels_pallas import mla_decode

    b, t, h, c, d = args.batch, args.tokens, args.heads, args.latent, args.latent + args.rope
    ps = 64
    pages = -(-args.context // ps)
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((b * pages + 1, ps, 1, d)), jnp.float32)
    table = np.arange(1, b * pages + 1).reshape(b, pages)[rng.permutation(b)]
    seqlens = np.full((b,), args.context, np.int32)
    pos = seqlens[:, None] - t + np.arange(t)[None, :]  # [B, T]
    slots = table[np.arange(b)[:, None], pos // ps] * ps + pos % ps
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    inputs = (q, new, cache, jnp.asarray(table, jnp.int32), jnp.asarray(seqlens), jnp.asarray(slots, jnp.int32))
    scale = d ** -0.5

    def gather_then_mla_decode(q, new, cache, table, seqlens, slots):  # every page gathered, then mla_decode
        local = (jnp.arange(b)[:, None] * pages + pos // ps) * ps + pos % ps  # the slots in the gathered copy
        copy = write(cache[table].reshape(b * pages, ps, 1, d), new.reshape(-1, d), jnp.asarray(local).reshape(-1))
        ids = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
        return mla_decode(q, copy, ids, seqlens, head_dim_v=c, softmax_scale=scale, causal=True,
                          implementation="xla")[0]

    fns = {"gather + mla_decode": jax.jit(gather_then_mla_decode)}
    for ct in (int(v) for v in args.chunk_tokens.split(",")):
        fns[f"chunks of {ct}"] = jax.jit(lambda *a, ct=ct: cached_and_new_attention(
            *a, head_dim_v=c, softmax_scale=scale, chunk_tokens=ct))
    ref = np.asarray(fns["gather + mla_decode"](*inputs))
    times = {name: [] for name in fns}
    for f in fns.values():
        np.testing.assert_allclose(np.asarray(f(*inputs)), ref, rtol=1e-4, atol=1e-4)
    for _ in range(args.repeats):  # interleaved, so that machine noise hits every variant alike
        for name, f in fns.items():
            t0 = time.perf_counter()
            f(*inputs).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    print(f"paged MLA attention, one layer: batch {b}, context {args.context}, {t} new token(s), {h} heads, "
          f"{c}+{args.rope} latent dims, float32, {jax.devices()[0].platform}; ms per call")
    for name, ts in times.items():
        print(f"  {name:22s} min {min(ts) * 1e3:8.2f}  median {statistics.median(ts) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
