"""MLA over the paged latent cache: write this step's latents, then absorbed attention with ``mla_decode``.

The step's T tokens are the last T of each sequence (positions seqlens - T .. seqlens - 1), so one causal
``mla_decode`` call (FlashMLA's contract: query i sees keys < seqlen - T + i + 1) serves decode (T = 1), MTP
verification (T = k + 1) and chunked prefill. On a mesh every device is a DP rank with its own pages: the write
and the attention run inside ``shard_map`` on the rank's local pages with rank-local page ids
(jaxinfer/kv/paged_cache.py).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxinfer.kv.paged_cache import write
from jaxinfer.parallel.dispatch import BATCH_AXES
from jaxinfer.parallel.plan import ParallelPlan
from kernels_pallas import mla_decode


def paged_mla(plan: ParallelPlan | None, q: jax.Array, new_latents: jax.Array, cache: jax.Array,
              block_table: jax.Array, seqlens: jax.Array, slots: jax.Array, *, head_dim_v: int,
              softmax_scale: float) -> tuple[jax.Array, jax.Array]:
    """q [B, T, H, C+R] (absorbed queries: [q_nope @ W_UK | roped q_pe]), new_latents [B, T, C+R],
    cache [pages, 64, 1, C+R], block_table [B, max_pages], seqlens [B] (including this step's tokens),
    slots [B, T] (page * 64 + offset, -1 = padding) -> (o_lat [B, T, H, head_dim_v], updated cache)."""

    def local(q, new, cache, block_table, seqlens, slots):
        cache = write(cache, new.reshape(-1, new.shape[-1]), slots.reshape(-1))
        out, _ = mla_decode(q, cache, block_table, seqlens, head_dim_v=head_dim_v, softmax_scale=softmax_scale,
                            causal=True)
        return out, cache

    if plan is None:
        return local(q, new_latents, cache, block_table, seqlens, slots)
    spec = P(BATCH_AXES)
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(spec,) * 6, out_specs=(spec, spec))(
        q, new_latents, cache, block_table, seqlens, slots)
