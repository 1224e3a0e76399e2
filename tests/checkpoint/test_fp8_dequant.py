"""Block-wise FP8 (DeepSeek release format): exact dequantization, its jnp twin, and quantization error bounds."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.checkpoint.fp8 import (
    FP8_MAX,
    dequantize_blockwise,
    dequantize_blockwise_jnp,
    quantize_blockwise,
    saturate_cast_e4m3,
)

SHAPES = [(300, 200), (128, 128), (129, 257), (1, 5), (3, 130, 70)]
E4M3 = ml_dtypes.float8_e4m3fn


def random_fp8(rng, shape):
    """Finite e4m3 values over the whole range (normals and subnormals)."""
    return saturate_cast_e4m3(rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 2.5, shape))


def random_scales(rng, weight_shape, block):
    *lead, rows, cols = weight_shape
    shape = (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    return (2.0 ** rng.uniform(-20, 2, shape)).astype(np.float32)


def reference_dequant(weight, scale_inv, block):
    """Independent reference: a loop over blocks, float64 arithmetic (the product of an e4m3 value (4 significant
    bits) and a float32 scale (24 bits) is exact in float64, so rounding it to float32 once is the exact answer)."""
    w = weight.astype(np.float64)
    out = np.empty(w.shape, np.float64)
    for idx in np.ndindex(*scale_inv.shape):
        *lead, r, c = idx
        rows = slice(r * block[0], (r + 1) * block[0])
        cols = slice(c * block[1], (c + 1) * block[1])
        out[(*lead, rows, cols)] = w[(*lead, rows, cols)] * np.float64(scale_inv[idx])
    return out.astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_dequantize_matches_block_loop(shape, block):
    rng = np.random.default_rng(hash((shape, block)) % 2**32)
    weight, scale = random_fp8(rng, shape), random_scales(rng, shape, block)
    out = dequantize_blockwise(weight, scale, block)
    assert out.dtype == np.float32 and out.shape == shape
    np.testing.assert_array_equal(out, reference_dequant(weight, scale, block))  # exact


@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("shape", [(129, 257), (3, 130, 70)])
def test_jnp_twin_bit_exact(shape, lookup):
    """Both e4m3 decodes (XLA's convert, the loader's table) give the numpy reference's bits; every byte value,
    the NaN codes included, appears among the weights."""
    rng = np.random.default_rng(1)
    weight, scale = random_fp8(rng, shape), random_scales(rng, shape, (128, 128))
    weight.reshape(-1).view(np.uint8)[:256] = np.arange(256, dtype=np.uint8)
    expected = dequantize_blockwise(weight, scale)
    f32 = jax.jit(functools.partial(dequantize_blockwise_jnp, lookup=lookup))(jnp.asarray(weight), jnp.asarray(scale))
    assert f32.dtype == jnp.float32
    assert np.asarray(f32).tobytes() == expected.tobytes()
    bf16 = jax.jit(functools.partial(dequantize_blockwise_jnp, dtype=jnp.bfloat16, lookup=lookup))(weight, scale)
    assert np.asarray(bf16).tobytes() == expected.astype(ml_dtypes.bfloat16).tobytes()


@pytest.mark.parametrize("fn", [dequantize_blockwise, dequantize_blockwise_jnp])
def test_dequantize_rejects_bad_scale_shape(fn):
    weight = np.zeros((300, 200), E4M3)
    with pytest.raises(CheckpointError, match=r"weight shape \(300, 200\) .* needs scale_inv shape \(3, 2\), "
                                              r"got \(2, 2\)"):
        fn(weight, np.ones((2, 2), np.float32))
    with pytest.raises(CheckpointError, match=r"\[out, in\] or \[E, out, in\], got shape \(5,\)"):
        fn(np.zeros((5,), E4M3), np.ones((1,), np.float32))


def block_amax_loop(w, block):
    """Per-block max |w| by slicing (independent of the padded reshape in quantize_blockwise)."""
    rows, cols = w.shape
    out = np.zeros((math.ceil(rows / block[0]), math.ceil(cols / block[1])), np.float32)
    for r, c in np.ndindex(*out.shape):
        out[r, c] = np.abs(w[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]]).max()
    return out


@pytest.mark.parametrize("shape", [(300, 200), (129, 257), (1, 5)])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_quantize_error_bound(shape, scale_fmt):
    rng = np.random.default_rng(2)
    # Magnitudes vary between and within blocks, so both e4m3 normals and subnormals occur.
    w = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 3, shape)).astype(np.float32)
    w[:1, :3] = 0.0
    q, s = quantize_blockwise(w, scale_fmt=scale_fmt)
    assert q.dtype == E4M3 and q.shape == w.shape and s.dtype == np.float32
    expected_s = np.maximum(block_amax_loop(w, (128, 128)), np.float32(1e-4)) / np.float32(FP8_MAX)
    if scale_fmt is None:
        np.testing.assert_array_equal(s, expected_s)
    else:  # UE8M0: the smallest power of two >= the plain scale
        assert np.all(np.frexp(s)[0] == 0.5) and np.all(s >= expected_s) and np.all(s < 2 * expected_s)
    deq = dequantize_blockwise(q, s).astype(np.float64)
    s_full = np.repeat(np.repeat(s, 128, 0), 128, 1)[: shape[0], : shape[1]].astype(np.float64)
    # e4m3 has 3 mantissa bits: rounding x = w/s to nearest costs at most 2**-4 relative where |x| >= 2**-6
    # (normals) and 2**-10 absolute (half the subnormal spacing 2**-9) below; then scaled back by s. The slack
    # term covers the float32 roundings of w/s and of q*s (2**-24 relative each).
    normal = np.abs(w) >= 2.0**-6 * s_full
    bound = np.where(normal, 2.0**-4 * np.abs(w), 2.0**-10 * s_full) + 2.0**-22 * (np.abs(w) + s_full)
    ratio = np.abs(deq - w) / bound
    assert ratio.max() <= 1.0, float(ratio.max())
    if w.size > 1000:  # both regimes occur and the bound is tight
        assert ratio[normal].max() > 0.5 and ratio[~normal].max() > 0.5


def test_quantize_never_produces_nan():
    assert np.isnan(np.float32(500.0).astype(E4M3))  # why clipping is needed: e4m3fn has no inf
    np.testing.assert_array_equal(saturate_cast_e4m3(np.array([500.0, -1e30, 464.0, 448.0], np.float32))
                                  .astype(np.float32), [448.0, -448.0, 448.0, 448.0])
    rng = np.random.default_rng(3)
    for scale_fmt in (None, "ue8m0"):  # block amaxes land on every float32 rounding of amax / s
        w = (rng.standard_normal((256, 384)) * 10.0 ** rng.uniform(-30, 30, (256, 384))).astype(np.float32)
        q, _ = quantize_blockwise(w, scale_fmt=scale_fmt)
        assert not np.isnan(q.astype(np.float32)).any()
        assert np.abs(q.astype(np.float32)).max() <= FP8_MAX


def test_quantize_partial_block_padding_and_zero_block():
    w = np.zeros((129, 257), np.float32)
    w[128:, 256:] = 3e-3  # the 1x1 corner block
    w[:128, :128] = -7.0
    _, s = quantize_blockwise(w)
    assert s.shape == (2, 3)
    assert s[1, 2] == np.float32(3e-3) / np.float32(448)  # zero padding leaves the amax alone
    assert s[0, 0] == np.float32(7.0) / np.float32(448)
    assert s[0, 1] == np.float32(1e-4) / np.float32(448)  # all-zero block: the 1e-4 floor


def test_quantize_3d_matches_per_expert():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((3, 130, 70)).astype(np.float32)
    q, s = quantize_blockwise(w)
    for e in range(3):
        q_e, s_e = quantize_blockwise(w[e])
        assert q[e].tobytes() == q_e.tobytes() and s[e].tobytes() == s_e.tobytes()


def test_quantize_rejects_bad_input():
    with pytest.raises(CheckpointError, match="non-finite"):
        quantize_blockwise(np.array([[1.0, np.inf]]))
    with pytest.raises(CheckpointError, match="scale_fmt"):
        quantize_blockwise(np.ones((2, 2)), scale_fmt="e8m0")
    with pytest.raises(CheckpointError, match="block must be two positive ints"):
        quantize_blockwise(np.ones((2, 2)), block=(0, 128))
