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
    rows = jnp.arange(b, dtype=jnp.int32)

    def earlier_blocks(w):  # blocks j .. j + w - 1 rows above each row, where they belong to the same chunk
        def body(state):
            j, carry = state
            above = rows[:, None] - j - jnp.arange(w, dtype=jnp.int32)[None, :]  # [B, w]
            src = jnp.maximum(above, 0)
            visible = (above >= first_block[:, None])[..., None] & new_valid[src]  # [B, w, Q]: every query sees them
            k = keys[src].reshape(b, w * s_q, d)  # [B, w * Q, D]
            return j + w, update(carry, k, visible.reshape(b, w * s_q, 1))
        return body

    # Earlier blocks w at a time while a whole step of them remains, then one at a time: short chunks (one or two
    # blocks) do not compute a wide step of masked keys.
    w = max(1, min(blocks_per_step, b))
    most = jnp.max(rows - first_block)  # traced: the most earlier blocks any row has
    j = jnp.int32(1)
    if w > 1:
        wide_end = most // w * w  # blocks 1 .. wide_end in steps of w
        j, carry = lax.while_loop(lambda state: state[0] <= wide_end, earlier_blocks(w), (j, carry))
    _, carry = lax.while_loop(lambda state: state[0] <= most, earlier_blocks(1), (j, carry))
    query = jnp.arange(r) // h_q  # [R]: each row's query column
    own = new_valid[:, :, None] & (jnp.arange(s_q)[None, :, None] <= query[None, None, :])  # [B, Q, R]
    out, lse = finish(update(carry, keys, own), head_dim_v)  # [B, R, V], [B, R]
    out, lse = from_rows(out.reshape(b, 1, r, head_dim_v), lse.reshape(b, 1, r), s_q)
    return out.astype(q.dtype), lse

