"""Plain-jnp fp32 reference of MLA decode: the oracle of the XLA path and the kernels (module common.py: shapes and
semantics)."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.mla.common import check_inputs, query_limits


def mla_decode_reference(q, kv_cache, block_table, cache_seqlens, *, head_dim_v=512, softmax_scale=None,
                         causal=False):
    """Plain-jnp fp32 MLA decode: gather every page, mask values and scores, softmax. Returns (out, lse).

    q [B, Q, N, D], kv_cache [pages, S, G, D], block_table [B, P] int32, cache_seqlens [B] int32 ->
    out [B, Q, N, V] (q's dtype), lse [B, N, Q] float32 (natural log).
    """
    b, s_q, h_q, d, h_kv, p, ps = check_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    m = h_q // h_kv
    k = kv_cache[block_table].astype(jnp.float32).reshape(b, p * ps, h_kv, d)  # [B, T, G, D]
    pos = jnp.arange(p * ps, dtype=jnp.int32)  # [T]
    k = jnp.where((pos[None, :] < cache_seqlens[:, None])[:, :, None, None], k, 0.0)  # mask values
    visible = pos[None, None, :] < query_limits(cache_seqlens, s_q, causal)[:, :, None]  # [B, Q, T]
    qg = q.astype(jnp.float32).reshape(b, s_q, h_kv, m, d)  # [B, Q, G, M, D]
    s = jnp.einsum("bqgmd,btgd->bgmqt", qg, k, precision="highest") * scale  # [B, G, M, Q, T]
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    pr = jnp.exp(s - mx)  # [B, G, M, Q, T]
    l = jnp.sum(pr, axis=-1, keepdims=True)  # [B, G, M, Q, 1]
    o = jnp.einsum("bgmqt,btgv->bqgmv", pr, k[..., :head_dim_v], precision="highest")  # [B, Q, G, M, V]
    l_o = jnp.moveaxis(l[..., 0], 3, 1)[..., None]  # [B, Q, G, M, 1]
    o = jnp.where(l_o > 0, o / jnp.where(l_o > 0, l_o, 1.0), 0.0)
    lse = jnp.log(l[..., 0]) + mx[..., 0]  # [B, G, M, Q]; -inf where nothing is visible
    return o.reshape(b, s_q, h_q, head_dim_v).astype(q.dtype), lse.reshape(b, h_q, s_q)
