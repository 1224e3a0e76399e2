"""Plain-jnp fp32 references of the FP8 GEMMs: the contract's sum one k-block at a time (docs/architecture.md
"DeepGEMM FP8 contract"), the oracle of the XLA paths and the kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import cdiv
from kernels_pallas.fp8.common import check_contiguous, check_masked, check_operands, row_mask
from kernels_pallas.fp8.tiling import BLOCK_K


def block_product(a, a_scale, b, b_scale):
    """fp32 [m, n] = sum_kb (A_kb @ B_kb^T) * As[:, kb] * Bs[n // 128, kb], one k-block at a time (contract)."""
    m, k = a.shape
    n = b.shape[0]
    kb = cdiv(k, BLOCK_K)
    ap = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, kb * BLOCK_K - k))).reshape(m, kb, BLOCK_K)  # (m, kb, 128)
    bp = jnp.pad(b.astype(jnp.float32), ((0, 0), (0, kb * BLOCK_K - k))).reshape(n, kb, BLOCK_K)  # (n, kb, 128)
    bs_col = jnp.repeat(b_scale, BLOCK_K, axis=0)[:n]                                              # (n, kb)

    def step(acc, j):
        part = jnp.dot(ap[:, j], bp[:, j].T, precision=lax.Precision.HIGHEST)                       # (m, n)
        return acc + part * a_scale[:, j, None] * bs_col[None, :, j], None

    acc, _ = lax.scan(step, jnp.zeros((m, n), jnp.float32), jnp.arange(kb))
    return acc


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_gemm_reference(a, a_scale, b, b_scale, *, out_dtype=jnp.bfloat16):
    """Plain-jnp fp32 reference of fp8_gemm: a [m, k] e4m3, b [n, k] e4m3 -> [m, n] out_dtype."""
    check_operands(a, a_scale, b, b_scale)
    return block_product(a, a_scale, b, b_scale).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_grouped_gemm_contiguous_reference(a, a_scale, b, b_scale, group_ids, *, out_dtype=jnp.bfloat16):
    """Plain-jnp fp32 reference: row r -> the fp8_gemm contract with b[group_ids[r]]; -1 rows zero."""
    m, n, _, _ = check_contiguous(a, a_scale, b, b_scale, group_ids)

    def one_group(out, xs):
        g, b_g, bs_g = xs
        d = block_product(a, a_scale, b_g, bs_g)                                                 # (m, n)
        return jnp.where((group_ids == g)[:, None], d, out), None

    out, _ = lax.scan(one_group, jnp.zeros((m, n), jnp.float32), (jnp.arange(b.shape[0]), b, b_scale))
    return out.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_grouped_gemm_masked_reference(a, a_scale, b, b_scale, masked_m, *, out_dtype=jnp.bfloat16):
    """Plain-jnp fp32 reference: group g -> the fp8_gemm contract on a[g], b[g]; rows >= masked_m[g] zero."""
    _, m_max, _, _ = check_masked(a, a_scale, b, b_scale, masked_m)
    out = jax.vmap(block_product)(a, a_scale, b, b_scale)                                      # (G, m_max, n)
    return jnp.where(row_mask(masked_m, m_max)[..., None], out, 0.0).astype(out_dtype)
