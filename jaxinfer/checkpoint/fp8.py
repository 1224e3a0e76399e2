"""DeepSeek's FP8 weight format: float8_e4m3fn weights with one float32 multiplier per 128x128 block.

A quantized projection ``W [out, in]`` is stored as ``weight`` (F8_E4M3) plus ``weight_scale_inv`` (F32) of shape
``[ceil(out/128), ceil(in/128)]``; the HF config says ``quantization_config = {"quant_method": "fp8",
"fmt": "e4m3", "weight_block_size": [128, 128], ...}`` (V3.1 adds ``"scale_fmt": "ue8m0"``).

Sources of the formulas:
- dequantization: DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``: ``y = x.to(float32) * s`` with one ``s``
  per BLOCK_SIZE x BLOCK_SIZE tile, edge tiles masked (partial blocks); used by ``fp8_cast_bf16.py``.
- quantization: DeepSeek's ``act_quant`` (V3.2-Exp ``inference/kernel.py``) applied to 2-D blocks:
  ``s = max(amax, 1e-4) / 448``; with ``scale_fmt="ue8m0"`` ``s = 2**ceil(log2(s))`` (``fast_round_scale``);
  ``y = x / s`` cast to e4m3. float8_e4m3fn has no inf (beyond ~464 a cast gives NaN), so we clip to +-448 first.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxinfer.checkpoint.errors import CheckpointError

FP8_MAX = 448.0  # largest finite float8_e4m3fn (ml_dtypes.finfo(float8_e4m3fn).max)
SCALE_FLOOR = 1e-4  # amax floor of DeepSeek's act_quant: an all-zero block still gets a finite scale
BLOCK = (128, 128)  # HF quantization_config.weight_block_size of DeepSeek-V3/R1


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"block must be two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """Shape of the block scales of a weight: [..., out, in] -> [..., ceil(out/bo), ceil(in/bi)]."""
    bo, bi = _check_block(block)
    if len(weight_shape) not in (2, 3):
        raise CheckpointError(f"block-quantized weights are [out, in] or [E, out, in], got shape {weight_shape}")
    *lead, rows, cols = weight_shape
    return (*lead, math.ceil(rows / bo), math.ceil(cols / bi))


def _check_shapes(weight_shape: tuple[int, ...], scale_inv_shape: tuple[int, ...], block: tuple[int, int]) -> None:
    expected = scale_shape(tuple(weight_shape), block)
    if tuple(scale_inv_shape) != expected:
        raise CheckpointError(
            f"weight shape {tuple(weight_shape)} with block {tuple(block)} needs scale_inv shape {expected}, "
            f"got {tuple(scale_inv_shape)}")


def _expand(scale, shape: tuple[int, ...], block: tuple[int, int], xp):
    """Per-element scales: [..., R, C] -> [..., out, in], each block's scale repeated then cropped."""
    rows, cols = shape[-2:]
    s = xp.repeat(scale, block[0], axis=-2)[..., :rows, :]  # [..., R*bo, C] -> [..., out, C]
    return xp.repeat(s, block[1], axis=-1)[..., :cols]  # [..., out, C*bi] -> [..., out, in]


def dequantize_blockwise(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = BLOCK) -> np.ndarray:
    """Exact dequantization ``w[..., i, j] = f32(weight[..., i, j]) * scale_inv[..., i // bo, j // bi]``.

    weight: [out, in] or [E, out, in], any dtype (float8_e4m3fn in DeepSeek releases).
    scale_inv: [ceil(out/bo), ceil(in/bi)] (with the same leading E), cast to float32.
    Returns float32 of weight's shape. One float32 multiply per element: exact up to that rounding.
    """
    block = _check_block(block)
    weight = np.asarray(weight)
    scale_inv = np.asarray(scale_inv)
    _check_shapes(weight.shape, scale_inv.shape, block)
    out = weight.astype(np.float32)
    out *= _expand(scale_inv.astype(np.float32), weight.shape, block, np)
    return out


# The float32 value of each e4m3 byte (NaN for the two NaN codes): a table lookup decodes e4m3 faster than XLA:CPU's
# convert (1.48 against 1.05 G elements/s in a fused dequantization, docs/benchmarks.md "Checkpoint loading").
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # [256]


def dequantize_blockwise_jnp(weight: jax.Array, scale_inv: jax.Array, block: tuple[int, int] = BLOCK,
                             dtype=jnp.float32, lookup: bool = False) -> jax.Array:
    """jnp twin of ``dequantize_blockwise`` (usable under jit): float32 product, then cast to ``dtype``.

    weight: [out, in] or [E, out, in]; scale_inv: [..., ceil(out/bo), ceil(in/bi)]. Shapes are checked at trace
    time. With dtype=float32 the result equals ``dequantize_blockwise`` bit for bit. lookup: decode e4m3 weights
    through a 256-entry table (the same values; for whole-tensor dequantization, e.g. at load time: a gather in a
    model's forward would not pay).
    """
    block = _check_block(block)
    _check_shapes(weight.shape, scale_inv.shape, block)
    if lookup and weight.dtype == jnp.float8_e4m3fn:
        values = jnp.asarray(_E4M3_VALUES)[jax.lax.bitcast_convert_type(weight, jnp.uint8)]
    else:
        values = weight.astype(jnp.float32)
    out = values * _expand(scale_inv.astype(jnp.float32), weight.shape, block, jnp)
    return out.astype(dtype)


def saturate_cast_e4m3(x: np.ndarray) -> np.ndarray:
    """Clip to +-448 then cast (round to nearest even) to float8_e4m3fn; a plain cast turns |x| > ~464 into NaN."""
    return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def _pow2_ceil(s: np.ndarray) -> np.ndarray:
    """2**ceil(log2(s)) for positive float32 s, exactly (frexp: s = m * 2**e with m in [0.5, 1))."""
    m, e = np.frexp(s)
    return np.ldexp(np.ones_like(s), np.where(m == 0.5, e - 1, e))


def quantize_blockwise(w: np.ndarray, block: tuple[int, int] = BLOCK,
                       scale_fmt: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Block-wise FP8 quantization in DeepSeek's release format (the inverse of ``dequantize_blockwise``).

    w: [out, in] or [E, out, in], finite, any float dtype (computed in float32).
    Per block (a partial edge block is zero-padded, which leaves its amax unchanged):
    ``s = max(amax, 1e-4) / 448``; ``scale_fmt="ue8m0"``: ``s = 2**ceil(log2(s))``; ``q = e4m3(clip(w / s))``.
    Returns (q float8_e4m3fn [..., out, in], scale_inv = s float32 [..., ceil(out/bo), ceil(in/bi)]).
    """
    block = _check_block(block)
    if scale_fmt not in (None, "ue8m0"):
        raise CheckpointError(f"scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    x = np.asarray(w).astype(np.float32)
    scales_shape = scale_shape(x.shape, block)  # [..., R, C]
    if not np.all(np.isfinite(x)):
        raise CheckpointError(f"cannot quantize a weight of shape {x.shape} with non-finite values")
    *lead, rows, cols = x.shape
    n_r, n_c = scales_shape[-2:]
    padded = np.zeros((*lead, n_r * block[0], n_c * block[1]), np.float32)
    padded[..., :rows, :cols] = np.abs(x)
    amax = padded.reshape(*lead, n_r, block[0], n_c, block[1]).max(axis=(-3, -1))  # [..., R, C]
    s = np.maximum(amax, np.float32(SCALE_FLOOR)) / np.float32(FP8_MAX)
    if scale_fmt == "ue8m0":
        s = _pow2_ceil(s)
    q = saturate_cast_e4m3(x / _expand(s, x.shape, block, np))
    return q, s.astype(np.float32)
