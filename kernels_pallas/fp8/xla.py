"""The XLA paths of the FP8 GEMMs: dequantize exactly in fp32 (quant.py's inverses), then one fp32 product: the
contract's sum, reassociated. Dense: one dot; masked: a batched dot; contiguous: rows sorted by group and
``jax.lax.ragged_dot``: exact (up to fp32 summation order), jittable, O(m*k + G*n*k) memory; on CPU ragged_dot costs
about as much as every group (docs/architecture.md "Platform facts"), which is fine for a fallback path."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels_pallas.fp8.common import row_mask, sort_by_group
from kernels_pallas.fp8.quant import dequantize_per_block, dequantize_per_token


def gemm_xla(a, a_scale, b, b_scale, out_dtype):
    """a [m, k], b [n, k] (checked operands) -> [m, n] out_dtype."""
    out = jnp.dot(dequantize_per_token(a, a_scale), dequantize_per_block(b, b_scale).T,
                  precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)                 # (m, n)
    return out.astype(out_dtype)


def contiguous_xla(a, a_scale, b, b_scale, group_ids, out_dtype):
    """a [m, k], b [G, n, k], group_ids [m] -> [m, n] out_dtype; rows whose id is outside [0, G) are zero."""
    valid, _, order, sizes = sort_by_group(group_ids, b.shape[0])
    x = dequantize_per_token(a, a_scale)[order]                                                # (m, k) sorted
    w = dequantize_per_block(b, b_scale)                                                       # (G, n, k)
    out_sorted = lax.ragged_dot(x, w.swapaxes(1, 2), sizes, precision=lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)                            # (m, n)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted)                                 # (m, n) rows
    return jnp.where(valid[:, None], out, 0.0).astype(out_dtype)


def masked_xla(a, a_scale, b, b_scale, masked_m, out_dtype):
    """a [G, m_max, k], b [G, n, k], masked_m [G] -> [G, m_max, n] out_dtype; rows past masked_m zero."""
    out = jnp.einsum("gmk,gnk->gmn", dequantize_per_token(a, a_scale), dequantize_per_block(b, b_scale),
                     precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)     # (G, m_max, n)
    return jnp.where(row_mask(masked_m, a.shape[1])[..., None], out, 0.0).astype(out_dtype)
