"""Paged MLA attention for a step laid out in query blocks: a chunk of n new tokens spans ceil(n / Q) consecutive
rows of Q columns (its last token in the last column of its last row), each row a block with its own cached
length and block table, so a step's shape is [blocks, Q] whatever its chunks' lengths.

Why: the engine's prefill steps are [rows, T] grids (jaxinfer/engine/inputs.py), which compile once per (rows, T,
pages) bucket, and prefix hits shorten chunks into pairs a first run never compiled; steps of fixed-width blocks
over fixed-width block tables compile once per block count, a family small enough to compile ahead. The blocks of
one chunk need each other's keys, which the engine's XLA path has not written to the cache yet (it writes after
the step: jaxinfer/models/attention.py): a row reads them from the step's own latents, rows ``first_block[b] .. b``
of its chunk. docs/benchmarks.md "Prefill layouts (CPU)" measures both layouts on the same chunks.

Loops with traced trip counts: the cached keys are read page chunk by page chunk up to the longest cached length
of the step, and the earlier blocks up to the most any row has, so a block table of fixed width and blocks of a
long chunk cost only the work present (no chunk skipped by a cond, no trip count in the compiled shape).

``expanded_new_key_attention``: the same blocks of a step without cached keys in the expanded (multi-head) form,
per-head keys and values decompressed from the latents (jaxinfer/models/mla.py).

Shapes (letters as in common.py, G = 1: an MLA latent cache): q [B, Q, N, D], new_keys [B, Q, D], cache [pages,
S, 1, D], block_table [B, P].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import cdiv
from kernels_pallas.mla.common import LOG2E, from_rows, to_rows
from kernels_pallas.mla.xla import finish, online_update


def query_block_attention(q, new_keys, new_valid, cache, block_table, cached_len, first_block, *, head_dim_v: int,
                          softmax_scale: float, chunk_pages: int, blocks_per_step: int = 1, value_dtype=None):
    """Attention of a step's query blocks over their sequences' cached keys and their chunks' new keys. Returns
    (out [B, Q, N, V] in q's dtype, lse [B, N, Q] float32, natural log; out 0 and lse -inf for a query that sees no
    key).

    new_valid [B, Q] bool: the real tokens (padding columns lead a chunk's first block); cached_len [B] int32: row
    b's cached keys are positions 0 .. cached_len[b] - 1 (its sequence's keys before the chunk; slots at or past it
    are masked as values); first_block [B] int32: the row of the first block of row b's chunk (<= b; the blocks of
    a chunk are consecutive rows). Query i of row b sees the cached keys, the valid new keys of rows first_block[b]
    .. b - 1, and the valid new keys j <= i of its own row. cache may hold bit patterns (an unsigned dtype as wide
    as ``value_dtype``). chunk_pages: pages per online-softmax step over the cache; blocks_per_step: earlier blocks
    of a chunk per online-softmax step over its new keys.
    """
    b, s_q, h_q, d = q.shape
    _, ps, h_kv, _ = cache.shape
    if h_kv != 1:
        raise ValueError(f"query blocks read an MLA latent cache [pages, page_size, 1, d], got h_kv={h_kv}")
    if new_keys.shape != (b, s_q, d) or new_valid.shape != (b, s_q):
        raise ValueError(f"new_keys must be [b, s_q, d] = {(b, s_q, d)} and new_valid [b, s_q], got "
                         f"{new_keys.shape} and {new_valid.shape}")
    bits = jnp.issubdtype(cache.dtype, jnp.unsignedinteger)
    if bits and (value_dtype is None or jnp.dtype(value_dtype).itemsize != cache.dtype.itemsize):
        raise ValueError(f"a {cache.dtype} cache holds bit patterns: pass value_dtype of the same width")
    r = s_q * h_q
    cp = max(1, min(chunk_pages, block_table.shape[1]))
    n_chunks = cdiv(block_table.shape[1], cp)
    table = jnp.pad(block_table, ((0, 0), (0, n_chunks * cp - block_table.shape[1])))  # [B, C * cp]
    qs = to_rows(q.astype(jnp.float32) * (softmax_scale * LOG2E), 1).reshape(b, r, d)  # [B, R, D], log2 units
    update = functools.partial(online_update, qs)
    zero = jnp.zeros_like(qs[..., 0])  # [B, R]
    carry = (jnp.zeros_like(qs), zero - jnp.inf, zero)

    def cached_chunk(state):  # keys of page chunk c of every row
        c, carry = state
        pages = lax.dynamic_slice_in_dim(table, c * cp, cp, axis=1)  # [B, cp]
        k = cache[pages]  # [B, cp, S, 1, D]
        if bits:
            k = lax.bitcast_convert_type(k, value_dtype)
        pos = c * cp * ps + jnp.arange(cp * ps, dtype=jnp.int32)  # [L]
        valid = pos[None, :] < cached_len[:, None]  # [B, L]
        k = jnp.where(valid[..., None], k.reshape(b, cp * ps, d).astype(jnp.float32), 0.0)  # [B, L, D]
        return c + 1, update(carry, k, valid[..., None])

    chunks = cdiv(jnp.max(cached_len), cp * ps)  # traced: the chunks any row has keys in
    _, carry = lax.while_loop(lambda state: state[0] < chunks, cached_chunk, (jnp.int32(0), carry))

    keys = jnp.where(new_valid[..., None], new_keys.astype(jnp.float32), 0.0)  # [B, Q, D]

    def earlier(carry, src, same_chunk):  # src, same_chunk [B, w]: w earlier blocks of each row
        w = src.shape[1]
        visible = same_chunk[..., None] & new_valid[src]  # [B, w, Q]: every query sees them
        return update(carry, keys[src].reshape(b, w * s_q, d), visible.reshape(b, w * s_q, 1))

    carry = _over_earlier_blocks(carry, first_block, blocks_per_step, earlier)
    query = jnp.arange(r) // h_q  # [R]: each row's query column
    own = new_valid[:, :, None] & (jnp.arange(s_q)[None, :, None] <= query[None, None, :])  # [B, Q, R]
    out, lse = finish(update(carry, keys, own), head_dim_v)  # [B, R, V], [B, R]
    out, lse = from_rows(out.reshape(b, 1, r, head_dim_v), lse.reshape(b, 1, r), s_q)
    return out.astype(q.dtype), lse


def expanded_new_key_attention(q, k, v, valid, first_block=None, *, softmax_scale: float, blocks_per_step: int = 1):
    """Attention of a step's queries over the step's own keys in the expanded (multi-head) form: per head, keys
    [K_nope | k_pe] and values V decompressed from the latents (DeepSeek's and vLLM's MLA prefill form; MQA over the
    latents is the decode form). For a step without cached keys: each row sees only new keys. Returns (out [B, H, Q,
    V] float32, lse [B, H, Q] float32, natural log; out 0 and lse -inf for a query that sees no key).

    q [B, H, Q, E], k [B, H, Q, E], v [B, H, Q, V] (any float dtype; computed in float32); valid [B, Q] bool: the
    real tokens; first_block [B] int32 or None: as query_block_attention's (the blocks of a chunk are consecutive
    rows), or None for a grid step (every row its own chunk). Query i of row b sees key j of its own row iff
    valid[b, j] and j <= i, and every valid key of rows first_block[b] .. b - 1. blocks_per_step: earlier blocks per
    online-softmax step.
    """
    b, h, s_q, e = q.shape
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or valid.shape != (b, s_q):
        raise ValueError(f"k must be q's shape {q.shape}, v [b, h, s_q, v] and valid [b, s_q]; got {k.shape}, "
                         f"{v.shape}, {valid.shape}")
    qs = q.astype(jnp.float32) * (softmax_scale * LOG2E)  # log2 units
    k = k.astype(jnp.float32)  # a padding key's scores are replaced (where), its values zeroed: they may be NaN
    v = jnp.where(valid[:, None, :, None], v.astype(jnp.float32), 0.0)

    def update(carry, k, v, visible):  # k [B, H, L, E], v [B, H, L, V], visible [B, 1, Q or 1, L]
        s = jnp.where(visible, jnp.einsum("bhqe,bhle->bhql", qs, k), -jnp.inf)  # [B, H, Q, L]
        mx = jnp.max(s, axis=-1) if carry is None else jnp.maximum(carry[1], jnp.max(s, axis=-1))  # [B, H, Q]
        mx_use = jnp.where(mx == -jnp.inf, 0.0, mx)
        p = jnp.exp2(s - mx_use[..., None])
        l, acc = jnp.sum(p, axis=-1), jnp.einsum("bhql,bhlv->bhqv", p, v)  # [B, H, Q], [B, H, Q, V]
        if carry is not None:
            alpha = jnp.exp2(carry[1] - mx_use)
            l, acc = carry[2] * alpha + l, carry[0] * alpha[..., None] + acc
        return acc, mx, l

    own = (jnp.arange(s_q)[None, :] <= jnp.arange(s_q)[:, None])[None, None] & valid[:, None, None, :]  # [B,1,Q,Q]
    carry = update(None, k, v, own)
    if first_block is not None:
        def earlier(carry, src, same_chunk):  # src, same_chunk [B, w]: w earlier blocks of each row
            w = src.shape[1]
            visible = same_chunk[..., None] & valid[src]  # [B, w, Q]
            kj = k[src].transpose(0, 2, 1, 3, 4).reshape(b, h, w * s_q, e)  # [B, H, w * Q, E]
            vj = v[src].transpose(0, 2, 1, 3, 4).reshape(b, h, w * s_q, v.shape[-1])
            return update(carry, kj, vj, visible.reshape(b, 1, 1, w * s_q))

        carry = _over_earlier_blocks(carry, first_block, blocks_per_step, earlier)
    acc, mx, l = carry
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = jnp.where(l > 0, (jnp.where(mx == -jnp.inf, 0.0, mx) + jnp.log2(jnp.where(l > 0, l, 1.0))) / LOG2E,
                    -jnp.inf)
    return out, lse


def _over_earlier_blocks(carry, first_block, blocks_per_step: int, attend):
    """carry after ``attend(carry, src, same_chunk)`` over every row's earlier blocks: src [B, w] the rows 1 .. w
    (then w + 1 .. 2w, ...) above each row (clipped at 0), same_chunk [B, w] whether they belong to its chunk. w =
    blocks_per_step while a whole step of them remains, then 1: short chunks (one or two blocks) do not compute a
    wide step of masked keys. Loops with traced trip counts (the most earlier blocks any row has), skipped by a
    cond for a step of one-block chunks (entering them costs XLA:CPU copies of their state)."""
    b = first_block.shape[0]
    rows = jnp.arange(b, dtype=jnp.int32)
    most = jnp.max(rows - first_block)  # traced: the most earlier blocks any row has
    w = max(1, min(blocks_per_step, b))

    def blocks(width):
        def body(state):
            j, carry = state
            above = rows[:, None] - j - jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, width]
            return j + width, attend(carry, jnp.maximum(above, 0), above >= first_block[:, None])
        return body

    def loops(carry):
        j = jnp.int32(1)
        if w > 1:
            wide_end = most // w * w  # blocks 1 .. wide_end in steps of w
            j, carry = lax.while_loop(lambda state: state[0] <= wide_end, blocks(w), (j, carry))
        return lax.while_loop(lambda state: state[0] <= most, blocks(1), (j, carry))[1]

    return lax.cond(most > 0, loops, lambda carry: carry, carry)
