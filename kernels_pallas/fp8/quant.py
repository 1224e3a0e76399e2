"""FP8 (e4m3) casts with fine-grained scales, DeepSeek-V3 / DeepGEMM style.

Activations: one scale per token per 128 channels; weights: one scale per 128x128 block. Scale formula
from DeepGEMM's tests (tests/test_core.py, per_token_cast_to_fp8 / per_block_cast_to_fp8; docs/architecture.md
"DeepGEMM FP8 contract"): s = max(amax, 1e-4) / 448; UE8M0 (DeepGEMM ``ceil_to_ue8m0``, V3.1 ``scale_fmt``):
s = 2 ** ceil(log2 s). Values are clipped to +-448 before the cast because float8_e4m3fn has no inf
(beyond ~464 the cast gives NaN). Partial last blocks are zero-padded, so padding never raises an amax.
The inverses (``dequantize_per_token``, ``dequantize_per_block``) are exact in float32: the XLA paths' operands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.common import cdiv

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
AMAX_EPS = 1e-4


def _scale(amax: jax.Array, ue8m0: bool) -> jax.Array:
    s = jnp.maximum(amax, AMAX_EPS) / FP8_MAX
    if ue8m0:
        s = jnp.exp2(jnp.ceil(jnp.log2(s)))
    return s


def _cast(x_f32: jax.Array, s: jax.Array) -> jax.Array:
    return jnp.clip(x_f32 / s, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


@functools.partial(jax.jit, static_argnames=("group", "ue8m0"))
def per_token_cast_to_fp8(x: jax.Array, *, group: int = 128, ue8m0: bool = False):
    """x [m, k] float -> (q [m, k] float8_e4m3fn, s [m, ceil(k/group)] float32); x ~= q * s per group."""
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [m, k], got shape {x.shape}")
    m, k = x.shape
    kb = cdiv(k, group)
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kb * group - k)))           # (m, kb*group)
    xg = xp.reshape(m, kb, group)                                                # (m, kb, group)
    s = _scale(jnp.max(jnp.abs(xg), axis=-1), ue8m0)                             # (m, kb)
    q = _cast(xg, s[:, :, None]).reshape(m, kb * group)[:, :k]                   # (m, k)
    return q, s


@functools.partial(jax.jit, static_argnames=("block", "ue8m0"))
def per_block_cast_to_fp8(w: jax.Array, *, block: int = 128, ue8m0: bool = False):
    """w [n, k] float -> (q [n, k] float8_e4m3fn, s [ceil(n/block), ceil(k/block)] float32)."""
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [n, k], got shape {w.shape}")
    n, k = w.shape
    nb, kb = cdiv(n, block), cdiv(k, block)
    wp = jnp.pad(w.astype(jnp.float32), ((0, nb * block - n), (0, kb * block - k)))
    wg = wp.reshape(nb, block, kb, block)                                        # (nb, bn, kb, bk)
    s = _scale(jnp.max(jnp.abs(wg), axis=(1, 3)), ue8m0)                         # (nb, kb)
    q = _cast(wg, s[:, None, :, None]).reshape(nb * block, kb * block)[:n, :k]   # (n, k)
    return q, s


def dequantize_per_token(q: jax.Array, s: jax.Array, *, group: int = 128) -> jax.Array:
    """Inverse of per_token_cast_to_fp8 (float32): q [..., m, k], s [..., m, ceil(k/group)]."""
    k = q.shape[-1]
    return q.astype(jnp.float32) * jnp.repeat(s, group, axis=-1)[..., :k]


def dequantize_per_block(q: jax.Array, s: jax.Array, *, block: int = 128) -> jax.Array:
    """Inverse of per_block_cast_to_fp8 (float32): q [..., n, k], s [..., ceil(n/block), ceil(k/block)]."""
    n, k = q.shape[-2:]
    s_full = jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :n, :k]
    return q.astype(jnp.float32) * s_full
