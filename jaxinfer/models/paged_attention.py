"""MLA over the paged latent cache: write this step's latents, then absorbed attention with ``mla_decode``.

The step's T tokens are the last T of each sequence (positions seqlens - T .. seqlens - 1), so one causal
``mla_decode`` call (FlashMLA's contract: query i sees keys < seqlen - T + i + 1) serves decode (T = 1), MTP
verification (T = k + 1) and chunked prefill. On a mesh every device is a DP rank with its own pages: the write
and the attention run inside ``shard_map`` on the rank's local pages with rank-local page ids
(jaxinfer/kv/paged_cache.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.kv.paged_cache import write
from jaxinfer.parallel.dispatch import BATCH_AXES
from jaxinfer.parallel.plan import ParallelPlan
from kernels_pallas import mla_decode


def paged_mla(plan: ParallelPlan | None, q: jax.Array, new_latents: jax.Array, cache: jax.Array,
              block_table: jax.Array, seqlens: jax.Array, slots: jax.Array, *, head_dim_v: int,
              softmax_scale: float, write_cache: bool = True) -> tuple[jax.Array, jax.Array]:
    """q [B, T, H, C+R] (absorbed queries: [q_nope @ W_UK | roped q_pe]), new_latents [B, T, C+R],
    cache [pages, 64, 1, C+R], block_table [B, max_pages], seqlens [B] (including this step's tokens),
    slots [B, T] (page * 64 + offset, -1 = padding) -> (o_lat [B, T, H, head_dim_v], cache).

    write_cache=True: the latents are written into the cache, which mla_decode then reads (the Pallas kernel reads
    the written pages in place); the updated cache is returned. write_cache=False: the cache is only read, the
    step's pages are gathered from it and the latents written into that copy; the cache comes back unchanged and
    the caller writes the latents afterwards (``write_latents``, donated). That is the XLA path: when one program
    both scatters into the donated cache and gathers from it, XLA:CPU copies the whole cache (twice per layer and
    step), so the cost of a step grows with num_kv_pages instead of the batch.
    """

    def local(q, new, cache, block_table, seqlens, slots):
        flat = new.reshape(-1, new.shape[-1])  # [B*T, C+R]
        if write_cache:
            cache = write(cache, flat, slots.reshape(-1))
            out, _ = mla_decode(q, cache, block_table, seqlens, head_dim_v=head_dim_v, softmax_scale=softmax_scale,
                                causal=True)
            return out, cache
        b, t = slots.shape
        p, ps = block_table.shape[1], cache.shape[1]
        pos = seqlens[:, None] - t + jnp.arange(t)[None, :]  # [B, T]: the step's tokens are the last T
        local_slots = jnp.where(slots >= 0, (jnp.arange(b)[:, None] * p + pos // ps) * ps + pos % ps, -1)
        pages = write(cache[block_table].reshape(b * p, *cache.shape[1:]), flat, local_slots.reshape(-1))
        table = jnp.arange(b * p, dtype=jnp.int32).reshape(b, p)  # [B, P] into the gathered pages
        out, _ = mla_decode(q, pages, table, seqlens, head_dim_v=head_dim_v, softmax_scale=softmax_scale,
                            causal=True)
        return out, cache

    if plan is None:
        return local(q, new_latents, cache, block_table, seqlens, slots)
    spec = P(BATCH_AXES)
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(spec,) * 6, out_specs=(spec, spec))(
        q, new_latents, cache, block_table, seqlens, slots)


def write_latents(mesh, cache: jax.Array, new_latents: jax.Array, slots: jax.Array) -> jax.Array:
    """Writes a step's latents [B, T, C+R] into one layer's cache at slots [B, T] (rank-local page ids on a mesh;
    -1 = padding). Donate ``cache`` to update it in place."""

    def local(cache, new, slots):
        return write(cache, new.reshape(-1, new.shape[-1]), slots.reshape(-1))

    if mesh is None:
        return local(cache, new_latents, slots)
    spec = P(BATCH_AXES)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(cache, new_latents, slots)
