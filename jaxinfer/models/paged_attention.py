"""MLA over the paged latent cache: write this step's latents, then absorbed attention with ``mla_decode``.

The step's T tokens are the last T of each sequence (positions seqlens - T .. seqlens - 1), so one causal
``mla_decode`` call (FlashMLA's contract: query i sees keys < seqlen - T + i + 1) serves decode (T = 1), MTP
verification (T = k + 1) and chunked prefill. On a mesh every device is a DP rank with its own pages: the write
and the attention run inside ``shard_map`` on the rank's local pages with rank-local page ids
(jaxinfer/kv/paged_cache.py).

The engine's CPU path (write_cache=False) reads the cache without writing it: ``cached_and_new_attention``
attends to the cached keys page chunk by page chunk and to the step's own latents (kernels_pallas.mla's XLA path),
which the engine writes into the cache after the step (``write_latents``). A multi-step decode program
(engine/runner.py) computes several tokens of each sequence before anything is written: the latents of its earlier
iterations come in a ``DecodeWindow`` (kernels_pallas.mla) and are read as if they were already cached (the same
chunks, the same arithmetic).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.kv.paged_cache import write
from jaxinfer.parallel.dispatch import BATCH_AXES
from jaxinfer.parallel.plan import ParallelPlan
from kernels_pallas import mla_decode
from kernels_pallas.mla import DecodeWindow, chunked_attention  # DecodeWindow: re-exported for engine/runner.py


def paged_mla(plan: ParallelPlan | None, q: jax.Array, new_latents: jax.Array, cache: jax.Array,
              block_table: jax.Array, seqlens: jax.Array, slots: jax.Array, *, head_dim_v: int,
              softmax_scale: float, write_cache: bool = True,
              window: DecodeWindow | None = None) -> tuple[jax.Array, jax.Array]:
    """q [B, T, H, C+R] (absorbed queries: [q_nope @ W_UK | roped q_pe]), new_latents [B, T, C+R],
    cache [pages, 64, 1, C+R], block_table [B, max_pages], seqlens [B] (including this step's tokens),
    slots [B, T] (page * 64 + offset, -1 = padding) -> (o_lat [B, T, H, head_dim_v], cache).

    write_cache=True: the latents are written into the cache, which mla_decode then reads (the Pallas kernel reads
    the written pages in place); the updated cache is returned. write_cache=False: the cache is only read
    (``cached_and_new_attention``); it comes back unchanged and the caller writes the latents afterwards
    (``write_latents``, donated). That is the XLA path: when one program both scatters into the donated cache and
    gathers from it, XLA:CPU copies the whole cache (twice per layer and step), so the cost of a step grows with
    num_kv_pages instead of the batch. ``window`` (write_cache=False only): cached positions not in the cache yet.
    """
    if window is not None and write_cache:
        raise ValueError("a DecodeWindow is read by the write_cache=False path only (the other writes every token)")

    def local(q, new, cache, block_table, seqlens, slots, window):
        if write_cache:
            cache = write(cache, new.reshape(-1, new.shape[-1]), slots.reshape(-1))
            out, _ = mla_decode(q, cache, block_table, seqlens, head_dim_v=head_dim_v, softmax_scale=softmax_scale,
                                causal=True)
            return out, cache
        out = cached_and_new_attention(q, new, cache, block_table, seqlens, slots, head_dim_v=head_dim_v,
                                       softmax_scale=softmax_scale, window=window)
        return out, cache

    if plan is None:
        return local(q, new_latents, cache, block_table, seqlens, slots, window)
    spec = P(BATCH_AXES)
    window_spec = None if window is None else DecodeWindow(spec, spec, P())
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(spec,) * 6 + (window_spec,), out_specs=(spec, spec))(
        q, new_latents, cache, block_table, seqlens, slots, window)


# Keys per online-softmax step of cached_and_new_attention on CPU: a batch's chunk of V3-sized keys stays within the
# CPU's last-level cache (the chunk sizes measured: docs/benchmarks.md, "Paged attention, XLA path (CPU)").
CHUNK_TOKENS = 256


def cached_and_new_attention(q: jax.Array, new_latents: jax.Array, cache: jax.Array, block_table: jax.Array,
                             seqlens: jax.Array, slots: jax.Array, *, head_dim_v: int, softmax_scale: float,
                             chunk_tokens: int = CHUNK_TOKENS, window: DecodeWindow | None = None) -> jax.Array:
    """paged_mla's attention without writing the step's latents first (XLA; the engine's CPU path): the XLA path of
    kernels_pallas.mla (``chunked_attention``) with the step's latents as its new keys. The cache may hold the
    latents' bit patterns (paged_cache's bit-pattern storage; their dtype is new_latents').

    Shapes as paged_mla; a row's real tokens are its last n (slots >= 0; the engine left-pads prefill chunks), at
    positions seqlens - n ... seqlens - 1. Keys: the cached positions < seqlens - n, read page chunk by page chunk
    (``chunk_tokens`` per chunk), and the step's own latents, causal among themselves. A real query sees exactly the
    keys of FlashMLA's causal contract (mla_decode); padding queries (slot -1) get outputs that nothing reads.
    ``window``: cached positions whose latents are not in the cache yet (``DecodeWindow``). Returns o_lat
    [B, T, H, head_dim_v] in q's dtype.
    """
    real = slots >= 0  # [B, T]
    cached_len = seqlens - jnp.sum(real, axis=1, dtype=seqlens.dtype)  # [B]: keys before the step's tokens
    out, _ = chunked_attention(q, cache, block_table, cached_len, head_dim_v=head_dim_v, softmax_scale=softmax_scale,
                               chunk_pages=max(1, chunk_tokens // cache.shape[1]), value_dtype=new_latents.dtype,
                               new_keys=new_latents, new_valid=real, window=window)
    return out


def write_latents(mesh, cache: jax.Array, new_latents: jax.Array, slots: jax.Array) -> jax.Array:
    """Writes a step's latents [B, T, C+R] into one layer's cache at slots [B, T] (rank-local page ids on a mesh;
    -1 = padding). Donate ``cache`` to update it in place."""

    def local(cache, new, slots):
        return write(cache, new.reshape(-1, new.shape[-1]), slots.reshape(-1))

    if mesh is None:
        return local(cache, new_latents, slots)
    spec = P(BATCH_AXES)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(cache, new_latents, slots)
