"""MLA over the paged latent cache: write this step's latents, then absorbed attention with ``mla_decode``.

The step's T tokens are the last T of each sequence (positions seqlens - T .. seqlens - 1), so one causal
``mla_decode`` call (FlashMLA's contract: query i sees keys < seqlen - T + i + 1) serves decode (T = 1), MTP
verification (T = k + 1) and chunked prefill. On a mesh every device is a DP rank with its own pages: the write
and the attention run inside ``shard_map`` on the rank's local pages with rank-local page ids
(jaxinfer/kv/paged_cache.py).

The engine's CPU path (write_cache=False) reads the cache without writing it: ``cached_and_new_attention``
attends to the cached keys page chunk by page chunk and to the step's own latents, which the engine writes into
the cache after the step (``write_latents``). A multi-step decode program (engine/runner.py) computes several
tokens of each sequence before anything is written: the latents of its earlier iterations come in a
``DecodeWindow`` and are read as if they were already cached (the same chunks, the same arithmetic).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxinfer.kv.paged_cache import take_pages, write
from jaxinfer.parallel.dispatch import BATCH_AXES
from jaxinfer.parallel.plan import ParallelPlan
from kernels_pallas import mla_decode


class DecodeWindow(NamedTuple):
    """Latents of a multi-step decode program's earlier iterations, not yet in the cache (engine/runner.py).

    latents [B, W, C+R]: row b's tokens at positions start[b] .. start[b] + W - 1 (iteration i computed position
    start + i); start int32 [B]; length: int32 scalar, how many of them exist (the current iteration's index).
    Attention reads positions start .. start + length - 1 from here instead of the cache."""

    latents: jax.Array
    start: jax.Array
    length: jax.Array


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


# Keys per online-softmax step of cached_and_new_attention: 4 pages. B=32 decode steps over 1024 cached tokens of V3's
# 576-dim latents (18.9 MB of keys per chunk, within the 32 MB L3 of the CPUs here) take 26 ms with 256-token
# chunks, 36-40 ms with 64 or 128 and 45 ms with 512 (min of 15; gathering all pages for mla_decode: 130 ms).
CHUNK_TOKENS = 256
_LOG2E = math.log2(math.e)


def cached_and_new_attention(q: jax.Array, new_latents: jax.Array, cache: jax.Array, block_table: jax.Array,
                             seqlens: jax.Array, slots: jax.Array, *, head_dim_v: int, softmax_scale: float,
                             chunk_tokens: int = CHUNK_TOKENS, window: DecodeWindow | None = None) -> jax.Array:
    """paged_mla's attention without writing the step's latents first (XLA; the engine's CPU path). The cache may
    hold the latents' bit patterns (paged_cache's bit-pattern storage; their dtype is new_latents').

    Shapes as paged_mla; a row's real tokens are its last n (slots >= 0; the engine left-pads prefill chunks), at
    positions seqlens - n ... seqlens - 1. Keys: the cached positions < seqlens - n, read page chunk by page chunk
    (``chunk_tokens`` per chunk), then the step's own latents, causal among themselves. A real query sees exactly
    the keys of FlashMLA's causal contract (mla_decode); padding queries (slot -1) get outputs that nothing reads.
    Cache slots at or past seqlens - n are masked as values, not only as scores (they may hold anything, NaN
    included). Online softmax in fp32 and log2 units. Returns o_lat [B, T, H, head_dim_v] in q's dtype.

    ``window``: positions window.start .. window.start + window.length - 1 of each row are read from
    window.latents instead of the cache (they count as cached keys: seqlens includes them). The chunks hold the
    same values as if those latents had been written, so a multi-step decode iteration computes exactly what a
    single decode step over the written cache does.

    Why not gather the pages and call mla_decode: gathering all of a step's pages and masking them are passes over
    every key in memory, and XLA:CPU runs the batched dots best as "bld,bnd->bln" and "bln,bld->bnd" (the scores
    with keys leading: 2-4x faster than with queries leading); chunks that stay in cache make a B=32 decode step
    over 1024 tokens 5x faster (130 -> 26 ms per V3-sized layer).
    """
    b, t, h, d = q.shape
    _, ps, h_kv, _ = cache.shape
    if h_kv != 1:
        raise ValueError(f"cached_and_new_attention reads an MLA latent cache [pages, page_size, 1, d], got "
                         f"h_kv={h_kv}")
    p = block_table.shape[1]
    real = slots >= 0  # [B, T]
    cached_len = seqlens - jnp.sum(real, axis=1, dtype=seqlens.dtype)  # [B]: keys before the step's tokens
    qs = (q.astype(jnp.float32) * (softmax_scale * _LOG2E)).reshape(b, t * h, d)  # [B, N = T*H, D], row t*H + h
    cp = max(1, min(chunk_tokens // ps, p))  # pages per chunk
    n_chunks = -(-p // cp)
    table = jnp.pad(block_table, ((0, 0), (0, n_chunks * cp - p)))  # padded pages are masked
    table = table.reshape(b, n_chunks, cp).transpose(1, 0, 2)  # [C, B, cp]

    def update(carry, k, visible):  # k [B, L, D] (masked values), visible [B, L, N or 1]
        acc, mx, l = carry  # [B, N, D], [B, N], [B, N]
        s = jnp.einsum("bld,bnd->bln", k, qs)  # [B, L, N]
        s = jnp.where(visible, s, -jnp.inf)
        mx_new = jnp.maximum(mx, jnp.max(s, axis=1))  # [B, N]
        mx_use = jnp.where(mx_new == -jnp.inf, 0.0, mx_new)
        alpha = jnp.exp2(mx - mx_use)
        pr = jnp.exp2(s - mx_use[:, None, :])  # [B, L, N]
        l = l * alpha + jnp.sum(pr, axis=1)
        acc = acc * alpha[..., None] + jnp.einsum("bln,bld->bnd", pr, k)  # all D columns; V sliced at the end
        return acc, mx_new, l

    def cached_chunk(carry, xs):
        chunk, pages = xs  # scalar, [B, cp]
        start = chunk * cp * ps

        def attend(carry):
            pos = start + jnp.arange(cp * ps, dtype=jnp.int32)  # [L]
            valid = pos[None, :] < cached_len[:, None]  # [B, L]
            k = take_pages(cache, pages, new_latents.dtype)  # [B, cp, S, 1, D] values
            k = k.reshape(b, cp * ps, d)  # [B, L, D]
            if window is not None:
                w = pos[None, :] - window.start[:, None]  # [B, L]: index into the window
                in_window = (w >= 0) & (w < window.length)
                w_k = jnp.take_along_axis(window.latents, jnp.clip(w, 0, window.latents.shape[1] - 1)[..., None],
                                          axis=1)  # [B, L, D]
                k = jnp.where(in_window[..., None], w_k.astype(k.dtype), k)
            k = k.astype(jnp.float32)
            k = jnp.where(valid[..., None], k, 0.0)
            return update(carry, k, valid[..., None])

        # Chunks past every row's cached keys change nothing: skipped (a fresh prompt's prefill has none at all).
        return lax.cond(start < jnp.max(cached_len), attend, lambda c: c, carry), None

    # Built from q so that, inside shard_map, the carry varies over the same mesh axes as the loop body's output.
    zero = jnp.zeros_like(qs[..., 0])  # [B, N]
    carry = (jnp.zeros_like(qs), zero - jnp.inf, zero)
    if n_chunks == 1:
        carry, _ = cached_chunk(carry, (jnp.int32(0), table[0]))
    else:  # the cache is only read: the loop does not copy it
        carry, _ = lax.scan(cached_chunk, carry, (jnp.arange(n_chunks, dtype=jnp.int32), table))
    k_new = jnp.where(real[..., None], new_latents.astype(jnp.float32), 0.0)  # [B, T, D]
    query = jnp.arange(t * h) // h  # [N]: each row's token
    visible = real[:, :, None] & (jnp.arange(t)[None, :, None] <= query[None, None, :])  # [B, T, N]
    acc, _, l = update(carry, k_new, visible)
    out = jnp.where(l[..., None] > 0, acc[..., :head_dim_v] / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(b, t, h, head_dim_v).astype(q.dtype)


def write_latents(mesh, cache: jax.Array, new_latents: jax.Array, slots: jax.Array) -> jax.Array:
    """Writes a step's latents [B, T, C+R] into one layer's cache at slots [B, T] (rank-local page ids on a mesh;
    -1 = padding). Donate ``cache`` to update it in place."""

    def local(cache, new, slots):
        return write(cache, new.reshape(-1, new.shape[-1]), slots.reshape(-1))

    if mesh is None:
        return local(cache, new_latents, slots)
    spec = P(BATCH_AXES)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(cache, new_latents, slots)
