"""The XLA path of paged MLA attention: an online softmax over chunks of pages, in fp32 and log2 units.

One implementation serves ``mla_decode(implementation="xla")`` (the cache already holds the step's keys; any G,
causal or not) and the engine's CPU attention (jaxinfer/models/attention.py), which reads the cache without
writing the step's latents first: those come as ``new_keys``, causal among themselves, and the latents of a
multi-step decode program's earlier iterations as a ``DecodeWindow`` read as if they were already cached.

Why chunks: gathering all of a step's pages and masking them are passes over every key in memory; a chunk of a few
pages stays in the CPU's caches while its scores and outputs are computed. Why this layout: each (sequence, kv head)
is one batch of the dots, with the keys leading ("bld,bnd->bln" for the scores, "bln,bld->bnd" for the outputs),
which XLA:CPU runs faster than with the queries leading; the outputs accumulate all D columns and V is sliced at the
end (no copy of each chunk's V columns).

Shapes (letters as in common.py): rows of one (sequence, kv head) are its R = Q * M query rows; the batch of the
dots is B * G (sequence-major).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import cdiv
from kernels_pallas.mla.common import LOG2E, from_rows, to_rows


class DecodeWindow(NamedTuple):
    """Cached positions whose keys are not in the cache yet: a multi-step decode program's earlier iterations
    (jaxinfer/engine/step_program.py), whose latents are written to the cache after the program.

    latents [B, W, D]: row b's keys at positions start[b] .. start[b] + W - 1 (iteration i computed position
    start + i); start int32 [B]; length: int32, a scalar (the current iteration's index) or [B] (per row: an MTP
    draft chain, whose rows accepted different numbers of tokens), how many of them exist.
    Positions start .. start + length - 1 are read from here instead of the cache (they count as cached keys)."""

    latents: jax.Array
    start: jax.Array
    length: jax.Array


def online_update(qs, carry, k, visible):
    """One online-softmax step (log2 units) of query rows qs [BG, R, D] over keys k [BG, L, D] (masked values),
    visible [BG, L, R or 1]; carry (acc [BG, R, D], running max [BG, R], sum [BG, R]), or None for the first."""
    s = jnp.einsum("bld,bnd->bln", k, qs)  # [BG, L, R]
    s = jnp.where(visible, s, -jnp.inf)
    mx_new = jnp.max(s, axis=1)  # [BG, R]
    if carry is not None:
        mx_new = jnp.maximum(carry[1], mx_new)
    mx_use = jnp.where(mx_new == -jnp.inf, 0.0, mx_new)
    pr = jnp.exp2(s - mx_use[:, None, :])  # [BG, L, R]
    l = jnp.sum(pr, axis=1)  # [BG, R]
    acc = jnp.einsum("bln,bld->bnd", pr, k)  # [BG, R, D]: all D columns; V sliced at the end
    if carry is not None:
        acc_old, mx_old, l_old = carry  # [BG, R, D], [BG, R], [BG, R]
        alpha = jnp.exp2(mx_old - mx_use)
        l = l_old * alpha + l
        acc = acc_old * alpha[..., None] + acc
    return acc, mx_new, l


def finish(carry, head_dim_v: int):
    """(out [BG, R, V], lse [BG, R] natural log) of an online softmax's final carry (out 0, lse -inf where no key
    was visible)."""
    acc, mx, l = carry  # [BG, R, D], [BG, R], [BG, R]
    out = jnp.where(l[..., None] > 0, acc[..., :head_dim_v] / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = (jnp.where(mx == -jnp.inf, 0.0, mx) + jnp.log2(l)) / LOG2E  # [BG, R]
    return out, lse


def chunked_attention(q, cache, block_table, kv_lens, *, head_dim_v: int, softmax_scale: float, chunk_pages: int,
                      causal: bool = False, value_dtype=None, new_keys=None, new_valid=None,
                      window: DecodeWindow | None = None):
    """Paged attention over the cached keys (and the step's own ``new_keys``), chunk by chunk. Returns (out
    [B, Q, N, V] in q's dtype, lse [B, N, Q] float32, natural log; out 0 and lse -inf for a query that sees no key).

    q [B, Q, N, D]; cache [pages, S, G, D]: values, or their bit patterns (an unsigned integer dtype as wide as
    ``value_dtype``, bitcast to it after each gather; value_dtype is ignored for a float cache); block_table [B, P]
    int32; kv_lens [B] int32: row b's cached keys are positions 0 .. kv_lens[b] - 1, and cache slots at or past
    kv_lens are masked as values, not only as scores (they may hold anything, NaN included). Query i of row b sees
    cached key t iff t < kv_lens[b] (causal: t < kv_lens[b] - Q + i + 1, FlashMLA's rule over a cache that holds the
    step's keys). chunk_pages: pages per online-softmax step.

    new_keys [B, Q, D] with new_valid [B, Q] bool (an MLA latent cache: G = 1): the step's own keys, after the
    cached ones; query i sees new key j iff new_valid[b, j] and j <= i. A decode step (Q == 1) takes its key in the
    first chunk's update, ahead of the chunk's keys (so its place in the reduction does not depend on the width of
    the block table) and without a cond (a decoding row has cached keys): half the small ops of a separate update.
    window (G = 1): positions window.start .. window.start + window.length - 1 read from window.latents instead of
    the cache; the chunks then hold the same values as if those latents had been written, so the result is the same
    bit for bit.
    """
    b, s_q, h_q, d = q.shape
    _, ps, h_kv, _ = cache.shape
    if b == 0:  # no rows, nothing to attend
        return jnp.zeros((0, s_q, h_q, head_dim_v), q.dtype), jnp.zeros((0, h_q, s_q), jnp.float32)
    if new_keys is not None and causal:
        raise ValueError("causal limits the cached keys of a cache that holds the step's keys; new_keys are causal "
                         "among themselves: pass one or the other")
    if (new_keys is not None or window is not None) and h_kv != 1:
        raise ValueError(f"new keys and a DecodeWindow are read with an MLA latent cache [pages, page_size, 1, d], "
                         f"got h_kv={h_kv}")
    bits = jnp.issubdtype(cache.dtype, jnp.unsignedinteger)  # the cache holds the values' bit patterns
    if bits and value_dtype is None:
        raise ValueError(f"a {cache.dtype} cache holds bit patterns: pass value_dtype, the dtype of its values")
    if bits and jnp.dtype(value_dtype).itemsize != cache.dtype.itemsize:
        raise ValueError(f"a {cache.dtype} bit-pattern cache cannot hold {jnp.dtype(value_dtype)} values")
    m = h_q // h_kv
    bg, r = b * h_kv, s_q * m
    p = block_table.shape[1]
    cp = max(1, min(chunk_pages, p))  # pages per chunk
    n_chunks = cdiv(p, cp)
    table = jnp.pad(block_table, ((0, 0), (0, n_chunks * cp - p)))  # padded pages are masked
    table = table.reshape(b, n_chunks, cp).transpose(1, 0, 2)  # [C, B, cp]

    def per_row(x):  # [B, ...] -> [B * G, ...]: the same for every kv head of a sequence
        return x if h_kv == 1 else jnp.repeat(x, h_kv, axis=0)

    kv_rows = per_row(kv_lens)  # [BG]
    if causal:  # row r of each (sequence, kv head) is query r // M
        limits = per_row(kv_lens[:, None] - s_q + 1 + jnp.arange(r, dtype=kv_lens.dtype)[None, :] // m)  # [BG, R]
    qs = to_rows(q.astype(jnp.float32) * (softmax_scale * LOG2E), h_kv).reshape(bg, r, d)  # [BG, R, D], log2 units

    update = functools.partial(online_update, qs)

    def chunk_keys(chunk, pages):  # scalar, [B, cp] -> keys [BG, L, D] (masked values), valid [BG, L], pos [L]
        pos = chunk * cp * ps + jnp.arange(cp * ps, dtype=jnp.int32)  # [L]
        valid = pos[None, :] < kv_rows[:, None]  # [BG, L]
        k = cache[pages]  # [B, cp, S, G, D]
        if bits:
            k = lax.bitcast_convert_type(k, value_dtype)
        if h_kv == 1:  # an MLA latent cache: the rows' batch is the sequences'
            k = k.reshape(b, cp * ps, d)  # [B, L, D]
        else:  # the kv heads join the batch
            k = k.reshape(b, cp * ps, h_kv, d).transpose(0, 2, 1, 3).reshape(bg, cp * ps, d)  # [BG, L, D]
        if window is not None:
            w = pos[None, :] - window.start[:, None]  # [B, L]: index into the window
            in_window = (w >= 0) & (w < jnp.reshape(window.length, (-1, 1)))  # length: scalar or [B]
            w_k = jnp.take_along_axis(window.latents, jnp.clip(w, 0, window.latents.shape[1] - 1)[..., None],
                                      axis=1)  # [B, L, D]
            k = jnp.where(in_window[..., None], w_k.astype(k.dtype), k)
        k = k.astype(jnp.float32)
        return jnp.where(valid[..., None], k, 0.0), valid, pos

    def visible(valid, pos):  # [BG, L], [L] -> [BG, L, R or 1]: the cached keys each row sees
        return pos[None, :, None] < limits[:, None, :] if causal else valid[..., None]

    def cached_chunk(carry, xs):
        chunk, pages = xs  # scalar, [B, cp]

        def attend(carry):
            k, valid, pos = chunk_keys(chunk, pages)
            return update(carry, k, visible(valid, pos))

        # Chunks past every row's cached keys change nothing: skipped (a fresh prompt's prefill has none at all).
        return lax.cond(chunk * cp * ps < jnp.max(kv_lens), attend, lambda c: c, carry), None

    def cached_chunks(carry, first: int):  # chunks first .. n_chunks - 1
        if n_chunks - first == 1:
            return cached_chunk(carry, (jnp.int32(first), table[first]))[0]
        # The cache is only read: the loop does not copy it.
        return lax.scan(cached_chunk, carry, (jnp.arange(first, n_chunks, dtype=jnp.int32), table[first:]))[0]

    if new_keys is not None:
        k_new = jnp.where(new_valid[..., None], new_keys.astype(jnp.float32), 0.0)  # [B, Q, D]
    if new_keys is None or s_q == 1:  # the first chunk holds keys of every real row: no cond
        k0, valid0, pos0 = chunk_keys(jnp.int32(0), table[0])
        if new_keys is None:
            carry = update(None, k0, visible(valid0, pos0))
        else:  # a decode step: its own key first
            keys = jnp.concatenate([k_new, k0], axis=1)  # [B, 1 + L, D]
            carry = update(None, keys, jnp.concatenate([new_valid, valid0], axis=1)[..., None])  # [B, 1 + L, 1]
        if n_chunks > 1:
            carry = cached_chunks(carry, 1)
    else:
        # Built from q so that, inside shard_map, the carry varies over the same mesh axes as the loop's output.
        zero = jnp.zeros_like(qs[..., 0])  # [BG, R]
        carry = cached_chunks((jnp.zeros_like(qs), zero - jnp.inf, zero), 0)
        query = jnp.arange(r) // m  # [R]: each row's query
        causal_new = new_valid[:, :, None] & (jnp.arange(s_q)[None, :, None] <= query[None, None, :])  # [B, Q, R]
        carry = update(carry, k_new, causal_new)
    out, lse = finish(carry, head_dim_v)  # [BG, R, V], [BG, R]
    out, lse = from_rows(out.reshape(b, h_kv, r, head_dim_v), lse.reshape(b, h_kv, r), s_q)
    return out.astype(q.dtype), lse
