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
    (``chunk_tokens`` per chunk), and the step's own latents, causal among themselves: after the chunks for
    T > 1, in the first chunk's update (ahead of its keys) for a decode step (T = 1). A real query sees exactly
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

    def update(carry, k, visible):  # k [B, L, D] (masked values), visible [B, L, N or 1]; carry None: the first
        s = jnp.einsum("bld,bnd->bln", k, qs)  # [B, L, N]
        s = jnp.where(visible, s, -jnp.inf)
        mx_new = jnp.max(s, axis=1)  # [B, N]
        if carry is not None:
            mx_new = jnp.maximum(carry[1], mx_new)
        mx_use = jnp.where(mx_new == -jnp.inf, 0.0, mx_new)
        pr = jnp.exp2(s - mx_use[:, None, :])  # [B, L, N]
        l = jnp.sum(pr, axis=1)  # [B, N]
        acc = jnp.einsum("bln,bld->bnd", pr, k)  # [B, N, D]: all D columns; V sliced at the end
        if carry is not None:
            acc_old, mx_old, l_old = carry  # [B, N, D], [B, N], [B, N]
            alpha = jnp.exp2(mx_old - mx_use)
            l = l_old * alpha + l
            acc = acc_old * alpha[..., None] + acc
        return acc, mx_new, l

    def chunk_keys(chunk, pages):  # scalar, [B, cp] -> keys [B, L, D] (masked values), valid [B, L]
        start = chunk * cp * ps
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
        return jnp.where(valid[..., None], k, 0.0), valid

    def cached_chunk(carry, xs):
        chunk, pages = xs  # scalar, [B, cp]

        def attend(carry):
            k, valid = chunk_keys(chunk, pages)
            return update(carry, k, valid[..., None])

        # Chunks past every row's cached keys change nothing: skipped (a fresh prompt's prefill has none at all).
        return lax.cond(chunk * cp * ps < jnp.max(cached_len), attend, lambda c: c, carry), None

    def cached_chunks(carry, first: int):  # chunks first .. n_chunks - 1
        if n_chunks - first == 1:
            return cached_chunk(carry, (jnp.int32(first), table[first]))[0]
        # The cache is only read: the loop does not copy it.
        return lax.scan(cached_chunk, carry, (jnp.arange(first, n_chunks, dtype=jnp.int32), table[first:]))[0]

    k_new = jnp.where(real[..., None], new_latents.astype(jnp.float32), 0.0)  # [B, T, D]
    if t == 1:
        # Decode: the token's own key and the first chunk in one update, the token first (so its index in the
        # reduction does not depend on the step's page bucket), and no cond (a decoding row has cached keys):
        # half the small ops of a separate update. The benchmark model's decode attention over 128 cached
        # tokens (8 heads, C+R = 160), float32, per layer and token: 30-32 instead of 39-49 us at batch 1,
        # 0.49-0.54 instead of 0.63-0.68 ms at batch 32 (docs/benchmarks.md, seventh session).
        k0, valid0 = chunk_keys(jnp.int32(0), table[0])
        keys = jnp.concatenate([k_new, k0], axis=1)  # [B, 1 + L, D]
        visible = jnp.concatenate([real, valid0], axis=1)[..., None]  # [B, 1 + L, 1]
        carry = update(None, keys, visible)
        if n_chunks > 1:
            carry = cached_chunks(carry, 1)
    else:
        # Built from q so that, inside shard_map, the carry varies over the same mesh axes as the loop's output.
        zero = jnp.zeros_like(qs[..., 0])  # [B, N]
        carry = cached_chunks((jnp.zeros_like(qs), zero - jnp.inf, zero), 0)
        query = jnp.arange(t * h) // h  # [N]: each row's token
        visible = real[:, :, None] & (jnp.arange(t)[None, :, None] <= query[None, None, :])  # [B, T, N]
        carry = update(carry, k_new, visible)
    acc, _, l = carry
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
