"""Shapes and checks every MLA decode path shares (reference, XLA, Pallas), after FlashMLA's contract
(docs/architecture.md "FlashMLA decode contract").

Letters used throughout the package: B batch, Q query tokens per sequence (s_q), N query heads (h_q), G kv heads
(h_kv), M = N // G query heads per kv head, D = q/k head dim (576 for V3: 512 latent + 64 rope), V = head_dim_v (512;
V = K[..., :V]), P pages per sequence (block table width), S page size (64 in FlashMLA), R = Q * M rows of one kv
head's queries (FlashMLA packs them the same way: row r is query r // M, head r % M).

Semantics (FlashMLA tests/test_flash_mla.py): key t of sequence b lives at kv_cache[block_table[b, t // S], t % S];
query i (of Q) sees keys t < seqlen[b] (causal: t < seqlen[b] - Q + i + 1); head n uses kv head n // M;
out = softmax(q k^T * scale) v; lse = natural-log sum of exp(scores) over visible keys. A query that sees no key
gets out 0 and lse -inf. Cache slots at or past a sequence's length are never read into the result (their values
are masked, not only their scores, since 0 * NaN = NaN).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

LOG2E = math.log2(math.e)  # the XLA path and the kernels keep scores and lse in log2 units (exp2 is the fast path)


def check_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v):
    """Validate shapes and dtypes (ValueError naming the bad argument); returns (B, Q, N, D, G, P, S)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [b, s_q, h_q, d], got rank {q.ndim} shape {q.shape}")
    if kv_cache.ndim != 4:
        raise ValueError(f"kv_cache must be [num_pages, page_size, h_kv, d], got rank {kv_cache.ndim} "
                         f"shape {kv_cache.shape}")
    if block_table.ndim != 2:
        raise ValueError(f"block_table must be [b, max_pages], got rank {block_table.ndim} "
                         f"shape {block_table.shape}")
    if cache_seqlens.ndim != 1:
        raise ValueError(f"cache_seqlens must be [b], got rank {cache_seqlens.ndim} shape {cache_seqlens.shape}")
    b, s_q, h_q, d = q.shape
    _, page_size, h_kv, d_k = kv_cache.shape
    if d_k != d:
        raise ValueError(f"q head dim {d=} must equal kv_cache head dim {d_k}")
    if not 0 < head_dim_v <= d:
        raise ValueError(f"{head_dim_v=} must be in [1, d={d}]")
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"{h_q=} must be a multiple of {h_kv=}")
    if block_table.shape[0] != b or cache_seqlens.shape[0] != b:
        raise ValueError(f"batch mismatch: q has b={b}, block_table {block_table.shape[0]}, "
                         f"cache_seqlens {cache_seqlens.shape[0]}")
    for name, x in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array (int32), got dtype {x.dtype}")
    for name, x in (("q", q), ("kv_cache", kv_cache)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating array, got dtype {x.dtype}")
    if s_q < 1 or page_size < 1:
        raise ValueError(f"{s_q=} and {page_size=} must be >= 1")
    return b, s_q, h_q, d, h_kv, block_table.shape[1], page_size


def query_limits(cache_seqlens, s_q, causal):
    """Number of visible keys per (sequence, query): [B, Q] int32 (causal: seqlen - Q + i + 1 for query i)."""
    seqlens = cache_seqlens.astype(jnp.int32)[:, None]  # [B, 1]
    if not causal:
        return jnp.broadcast_to(seqlens, (seqlens.shape[0], s_q))
    return seqlens - s_q + 1 + jnp.arange(s_q, dtype=jnp.int32)[None, :]  # [B, Q]


def to_rows(x, h_kv):
    """x [B, Q, N, D] -> [B, G, R, D]: row r of kv head g is query r // M, head g * M + r % M (M = N // G)."""
    b, s_q, h_q, d = x.shape
    m = h_q // h_kv
    return x.reshape(b, s_q, h_kv, m, d).transpose(0, 2, 1, 3, 4).reshape(b, h_kv, s_q * m, d)


def from_rows(out, lse, s_q):
    """out [B, G, R, V], lse [B, G, R] (R = Q * M) -> out [B, Q, N, V], lse [B, N, Q] (FlashMLA's layouts)."""
    b, h_kv, r, dv = out.shape
    m = r // s_q
    out = out.reshape(b, h_kv, s_q, m, dv).transpose(0, 2, 1, 3, 4).reshape(b, s_q, h_kv * m, dv)
    lse = lse.reshape(b, h_kv, s_q, m).transpose(0, 1, 3, 2).reshape(b, h_kv * m, s_q)
    return out, lse
