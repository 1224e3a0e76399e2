"""FP8 quantization and block-scaled FP8 GEMMs (dense, grouped contiguous, grouped masked).

Oracles, each written here in numpy: the scale formulas of DeepGEMM's tests (per_token_cast_to_fp8 /
per_block_cast_to_fp8: s = max(amax, 1e-4) / 448), float64 math on the exactly dequantized operands (tight), and
DeepGEMM's own accuracy check: calc_diff(out, bf16 product of the unquantized inputs) < 1e-3
(deep_gemm tests/test_core.py). The Pallas kernels (both variants of the ``kernel=`` knob: "pipelined" and
"warp_specialized") run in GPU interpret mode on a few small shapes, and every shipped kernel configuration must
lower for cuda to a Mosaic GPU call (so an XLA fallback cannot pass).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels_pallas import _mosaic
from kernels_pallas.fp8 import (KERNELS, fp8_gemm, fp8_gemm_reference, fp8_grouped_gemm_contiguous,
                                fp8_grouped_gemm_contiguous_reference, fp8_grouped_gemm_masked,
                                fp8_grouped_gemm_masked_reference, per_block_cast_to_fp8, per_token_cast_to_fp8)
from kernels_pallas.fp8 import tiling as fp8_tiling

F32 = jnp.float32
NATIVE_INTERPRETER = jax.__version_info__ >= (0, 11, 2)   # runs wgmma, layout loads, cluster barriers (_mosaic.py)


def calc_diff(x, y):
    """DeepGEMM tests/test_core.py: 1 - 2 sum(xy) / sum(x^2 + y^2), in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return 1.0 - 2.0 * (x * y).sum() / (x * x + y * y).sum()


def np_dequant_tokens(q, s):
    """q [..., m, k] e4m3, s [..., m, ceil(k/128)] -> float64, per token per 128 channels."""
    q = np.asarray(q).astype(np.float64)
    return q * np.repeat(np.asarray(s, np.float64), 128, axis=-1)[..., : q.shape[-1]]


def np_dequant_blocks(q, s):
    """q [..., n, k] e4m3, s [..., ceil(n/128), ceil(k/128)] -> float64, per 128x128 block."""
    q = np.asarray(q).astype(np.float64)
    s = np.repeat(np.repeat(np.asarray(s, np.float64), 128, axis=-2), 128, axis=-1)
    return q * s[..., : q.shape[-2], : q.shape[-1]]


def bf16_product(x, w):
    """The bf16 product of the unquantized inputs: bf16 operands, fp32 sums (DeepGEMM's reference)."""
    xb = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    wb = np.asarray(w, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return xb @ np.swapaxes(wb, -1, -2)


def np_quant_tokens(x):
    """numpy per-token-per-128 cast (DeepGEMM's formula): x [..., m, k] -> (e4m3, f32 scales)."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    kb = -(-k // 128)
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, kb * 128 - k)]).reshape(*x.shape[:-1], kb, 128)
    s = (np.maximum(np.abs(xp).max(-1), 1e-4) / 448.0).astype(np.float32)
    q = np.clip(xp / s[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).reshape(*x.shape[:-1], kb * 128)
    return jnp.asarray(q[..., :k]), jnp.asarray(s)


def np_quant_blocks(w):
    """numpy 128x128-block cast: w [..., n, k] -> (e4m3, f32 [..., ceil(n/128), ceil(k/128)])."""
    w = np.asarray(w, np.float32)
    *lead, n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    wp = np.pad(w, [(0, 0)] * len(lead) + [(0, nb * 128 - n), (0, kb * 128 - k)])
    wb = wp.reshape(*lead, nb, 128, kb, 128)
    s = (np.maximum(np.abs(wb).max(axis=(-3, -1)), 1e-4) / 448.0).astype(np.float32)
    q = np.clip(wb / s[..., :, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return jnp.asarray(q.reshape(*lead, nb * 128, kb * 128)[..., :n, :k]), jnp.asarray(s)


def _normal(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def make_dense(m, n, k, seed=0):
    x, w = _normal(seed, (m, k), (n, k))
    return (x, w, *np_quant_tokens(x), *np_quant_blocks(w))


def make_grouped(g, m, n, k, seed=0):
    x, w = _normal(seed, (m, k), (g, n, k))
    return (x, w, *np_quant_tokens(x), *np_quant_blocks(w))


def make_masked(g, m_max, n, k, seed=0):
    x, w = _normal(seed, (g, m_max, k), (g, n, k))
    return (x, w, *np_quant_tokens(x), *np_quant_blocks(w))


def np_contiguous(a, a_s, b, b_s, gid):
    """float64: row r times b[gid[r]] (dequantized); -1 rows zero."""
    xa, wb = np_dequant_tokens(a, a_s), np_dequant_blocks(b, b_s)
    out = np.zeros((xa.shape[0], wb.shape[1]))
    for g in range(wb.shape[0]):
        rows = np.asarray(gid) == g
        out[rows] = xa[rows] @ wb[g].T
    return out


def np_masked(a, a_s, b, b_s, masked_m):
    out = np_dequant_tokens(a, a_s) @ np.swapaxes(np_dequant_blocks(b, b_s), -1, -2)   # (G, m_max, n)
    out[np.arange(out.shape[1])[None, :] >= np.asarray(masked_m)[:, None]] = 0.0
    return out


def rel_err(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)


# ------------------------------------------------------------------------------------------------- quant
def test_per_token_cast_matches_numpy_and_bounds():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((70, 300)).astype(np.float32) * rng.choice([1e-3, 1.0, 300.0], size=(70, 1))
    x[3, :128] = 0.0                                                            # all-zero group: eps scale
    q, s = per_token_cast_to_fp8(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (70, 300) and s.shape == (70, 3) and s.dtype == F32
    xp = np.pad(x, ((0, 0), (0, 84))).reshape(70, 3, 128)
    s_np = np.maximum(np.abs(xp).max(-1), 1e-4) / 448.0
    np.testing.assert_allclose(np.asarray(s), s_np, rtol=1e-6)
    assert s[3, 0] == np.float32(1e-4 / 448.0) and not np.asarray(q[3, :128], np.float32).any()
    # e4m3 has 3 mantissa bits: |x/s - q| <= half an ulp = |x/s| * 2^-4 (normals), 2^-10 (subnormals).
    y = x / np.repeat(s_np, 128, axis=-1)[:, :300]
    err = np.abs(np.asarray(q, np.float32) - y)
    assert np.all(err <= np.maximum(np.abs(y) * 2.0**-4, 2.0**-10) * (1 + 1e-6))
    assert np.abs(np.asarray(q, np.float32)).max() == 448.0                     # amax maps to the top of the range


def test_per_block_cast_partial_blocks_and_bounds():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    w[128:, 256:] *= 1e-3                                                       # partial block: small values only
    q, s = per_block_cast_to_fp8(jnp.asarray(w))
    assert q.shape == (200, 300) and s.shape == (2, 3)
    s_np = np.array([[max(np.abs(w[i:i + 128, j:j + 128]).max(), 1e-4) / 448.0 for j in (0, 128, 256)]
                     for i in (0, 128)])
    np.testing.assert_allclose(np.asarray(s), s_np, rtol=1e-6)                  # padding never raises an amax
    deq = np_dequant_blocks(q, s)
    blk = np.repeat(np.repeat(s_np, 128, 0), 128, 1)[:200, :300] * 448.0
    assert np.all(np.abs(deq - w) <= np.maximum(np.abs(w) * 2.0**-4, blk * 2.0**-19) * (1 + 1e-6))


@pytest.mark.parametrize("cast", [per_token_cast_to_fp8, per_block_cast_to_fp8])
def test_ue8m0_scales_are_powers_of_two(cast):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((130, 260)) * 37.0, F32)
    q, s = cast(x, ue8m0=True)
    log2 = np.log2(np.asarray(s, np.float64))
    assert np.array_equal(log2, np.round(log2))
    plain = np.asarray(cast(x)[1], np.float64)                                  # amax / 448
    assert np.all(np.asarray(s) >= plain) and np.all(np.asarray(s) < 2 * plain)
    assert np.abs(np.asarray(q, np.float32)).max() <= 448.0


def test_casts_match_numpy_casts():
    x = np.random.default_rng(5).standard_normal((70, 300)).astype(np.float32) * 9.0
    for ours, theirs in ((per_token_cast_to_fp8, np_quant_tokens), (per_block_cast_to_fp8, np_quant_blocks)):
        (q, s), (q_np, s_np) = ours(jnp.asarray(x)), theirs(x)
        np.testing.assert_allclose(np.asarray(s), np.asarray(s_np), rtol=1e-6)
        diff = np.asarray(q, np.float32) != np.asarray(q_np, np.float32)
        assert diff.mean() < 1e-3                                               # rounding ties at most


def test_cast_clips_and_never_makes_nan():
    big = np.float32(3e38)
    x = jnp.asarray(np.array([[big, -big, 1.0, 0.0] * 40, [5e5, -5e5, 448.0, 1e-30] * 40], np.float32))
    for ue8m0 in (False, True):
        for q, s in (per_token_cast_to_fp8(x, ue8m0=ue8m0), per_block_cast_to_fp8(x, ue8m0=ue8m0)):
            qf = np.asarray(q, np.float32)
            assert np.isfinite(qf).all() and np.abs(qf).max() <= 448.0 and np.isfinite(np.asarray(s)).all()


# ------------------------------------------------------------------------------------------------- references
DENSE_SHAPES = [(70, 200, 300), (128, 256, 512), (1, 130, 129)]


@pytest.mark.parametrize("m,n,k", DENSE_SHAPES)
def test_fp8_gemm_reference(m, n, k):
    x, w = _normal(0, (m, k), (n, k))
    (a, a_s), (b, b_s) = per_token_cast_to_fp8(jnp.asarray(x)), per_block_cast_to_fp8(jnp.asarray(w))
    exact = np_dequant_tokens(a, a_s) @ np_dequant_blocks(b, b_s).T
    assert rel_err(fp8_gemm_reference(a, a_s, b, b_s, out_dtype=F32), exact) < 1e-5
    out = fp8_gemm_reference(a, a_s, b, b_s)
    assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
    assert calc_diff(out.astype(F32), bf16_product(x, w)) < 1e-3                # DeepGEMM's check


def test_grouped_contiguous_reference():
    g, m, n, k = 4, 150, 200, 300
    x, w, a, a_s, b, b_s = make_grouped(g, m, n, k)
    gid = np.random.default_rng(3).choice([-1, 0, 1, 3], size=m).astype(np.int32)   # group 2: zero rows
    gid[:5] = -1
    gid[-3:] = -1
    exact = np_contiguous(a, a_s, b, b_s, gid)
    out = fp8_grouped_gemm_contiguous_reference(a, a_s, b, b_s, jnp.asarray(gid), out_dtype=F32)
    assert rel_err(out, exact) < 1e-5 and not np.asarray(out)[gid < 0].any()
    out16 = fp8_grouped_gemm_contiguous_reference(a, a_s, b, b_s, jnp.asarray(gid))
    ref = np.where((gid >= 0)[:, None], np.take_along_axis(bf16_product(x, w), np.maximum(gid, 0)[None, :, None],
                                                           axis=0)[0], 0.0)
    assert calc_diff(out16.astype(F32), ref) < 1e-3


def test_grouped_masked_reference():
    g, m_max, n, k = 3, 70, 200, 300
    masked_m = np.array([0, 70, 33], np.int32)                                  # empty, full, partial
    x, w, a, a_s, b, b_s = make_masked(g, m_max, n, k)
    out = fp8_grouped_gemm_masked_reference(a, a_s, b, b_s, jnp.asarray(masked_m), out_dtype=F32)
    assert rel_err(out, np_masked(a, a_s, b, b_s, masked_m)) < 1e-5
    out16 = np.asarray(fp8_grouped_gemm_masked_reference(a, a_s, b, b_s, jnp.asarray(masked_m)).astype(F32))
    ref = bf16_product(x, w)
    for gi, mm in enumerate(masked_m):
        assert not out16[gi, mm:].any()
        if mm:
            assert calc_diff(out16[gi, :mm], ref[gi, :mm]) < 1e-3


# ------------------------------------------------------------------------------------------------- xla paths
@settings(max_examples=5, deadline=None, derandomize=True)
@given(m=st.integers(1, 150), n=st.integers(1, 300), k=st.integers(1, 400), seed=st.integers(0, 2**16))
def test_fp8_gemm_xla_matches_reference(m, n, k, seed):
    _, _, a, a_s, b, b_s = make_dense(m, n, k, seed)
    xla = fp8_gemm(a, a_s, b, b_s, out_dtype=F32, implementation="xla")
    assert xla.shape == (m, n)
    assert rel_err(xla, fp8_gemm_reference(a, a_s, b, b_s, out_dtype=F32)) < 1e-5


@settings(max_examples=4, deadline=None, derandomize=True)
@given(g=st.integers(1, 5), m=st.integers(1, 120), seed=st.integers(0, 2**16))
def test_grouped_contiguous_xla_matches_reference(g, m, seed):
    _, _, a, a_s, b, b_s = make_grouped(g, m, 136, 200, seed)
    gid = jnp.asarray(np.random.default_rng(seed).integers(-1, g, size=m), jnp.int32)
    xla = fp8_grouped_gemm_contiguous(a, a_s, b, b_s, gid, out_dtype=F32, implementation="xla")
    ref = fp8_grouped_gemm_contiguous_reference(a, a_s, b, b_s, gid, out_dtype=F32)
    assert np.abs(np.asarray(xla) - np.asarray(ref)).max() <= 1e-5 * max(np.abs(np.asarray(ref)).max(), 1.0)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(g=st.integers(1, 4), m_max=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_grouped_masked_xla_matches_reference(g, m_max, seed):
    _, _, a, a_s, b, b_s = make_masked(g, m_max, 72, 260, seed)
    masked_m = jnp.asarray(np.random.default_rng(seed).integers(0, m_max + 1, size=g), jnp.int32)
    xla = fp8_grouped_gemm_masked(a, a_s, b, b_s, masked_m, out_dtype=F32, implementation="xla")
    ref = fp8_grouped_gemm_masked_reference(a, a_s, b, b_s, masked_m, out_dtype=F32)
    assert np.abs(np.asarray(xla) - np.asarray(ref)).max() <= 1e-5 * max(np.abs(np.asarray(ref)).max(), 1.0)


def test_default_implementation_on_cpu_is_xla():
    _, _, a, a_s, b, b_s = make_dense(8, 16, 128)
    assert not _mosaic.has_mosaic_gpu_call(_mosaic.lower_for_cuda(fp8_gemm, a, a_s, b, b_s, interpret=False))


# ------------------------------------------------------------------------------------------------- bad input
def test_bad_input_raises_value_error_with_numbers():
    _, _, a, a_s, b, b_s = make_dense(8, 16, 200)
    with pytest.raises(ValueError, match="k=200.*k=199"):
        fp8_gemm(a, a_s, b[:, :199], b_s)
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm(a, a_s[:, :1], b, b_s)
    with pytest.raises(ValueError, match="b_scale"):
        fp8_gemm(a, a_s, b, jnp.ones((2, 2), F32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm(a.astype(jnp.bfloat16), a_s, b, b_s)
    with pytest.raises(ValueError, match="block_k"):
        fp8_gemm(a, a_s, b, b_s, implementation="pallas", block_k=64)
    with pytest.raises(ValueError, match="implementation"):
        fp8_gemm(a, a_s, b, b_s, implementation="triton")
    with pytest.raises(ValueError, match="kernel must be one of"):
        fp8_gemm(a, a_s, b, b_s, implementation="xla", kernel="ws")
    ws = dict(implementation="pallas", kernel="warp_specialized")
    with pytest.raises(ValueError, match="block_m must be 128 or 256.*block_m=64"):
        fp8_gemm(a, a_s, b, b_s, block_m=64, **ws)
    with pytest.raises(ValueError, match="block_n must be a multiple of 32.*block_n=40"):
        fp8_gemm(a, a_s, b, b_s, block_n=40, **ws)
    with pytest.raises(ValueError, match="block_m=256 x block_n=128 .* needs 256 fp32 accumulator registers"):
        fp8_gemm(a, a_s, b, b_s, block_m=256, block_n=128, **ws)
    with pytest.raises(ValueError, match="block_m=128 x block_n=128 .* needs 256 fp32 accumulator registers"):
        fp8_gemm(a, a_s, b, b_s, implementation="pallas", block_m=128, block_n=128)       # pipelined: one warpgroup
    with pytest.raises(ValueError, match="stages=6 .* shared memory"):
        fp8_gemm(a, a_s, b, b_s, block_n=128, stages=6, interpret=True, **ws)
    with pytest.raises(ValueError, match="multicast must be 1, or 2 with kernel='warp_specialized'"):
        fp8_gemm(a, a_s, b, b_s, implementation="pallas", multicast=2)
    with pytest.raises(ValueError, match="n=16 with block_n=32 gives 1 tiles, an odd number"):
        fp8_gemm(a, a_s, b, b_s, multicast=2, **ws)
    with pytest.raises(ValueError, match="stages=9 .* shared memory"):
        fp8_gemm(a, a_s, b, b_s, implementation="pallas", block_n=128, stages=9)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        fp8_gemm(a, a_s, b, b_s, stages=0, **ws)
    _, _, ga, ga_s, gb, gb_s = make_grouped(2, 8, 16, 200)
    with pytest.raises(ValueError, match=r"group_ids must have shape \(8,\)"):
        fp8_grouped_gemm_contiguous(ga, ga_s, gb, gb_s, jnp.zeros((7,), jnp.int32))
    with pytest.raises(ValueError, match="masked_m"):
        fp8_grouped_gemm_masked(ga[None].repeat(2, 0), ga_s[None].repeat(2, 0), gb, gb_s, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="kernel must be one of"):
        fp8_grouped_gemm_contiguous(ga, ga_s, gb, gb_s, jnp.zeros((8,), jnp.int32), kernel="persistent")
    with pytest.raises(ValueError, match="block_m must be 128 or 256"):
        fp8_grouped_gemm_masked(ga[None].repeat(2, 0), ga_s[None].repeat(2, 0), gb, gb_s, jnp.zeros((2,), jnp.int32),
                                implementation="pallas", kernel="warp_specialized", block_m=64)


# ------------------------------------------------------------------------------------------------- pallas (interpret)
# A kernel whose barriers deadlock hangs GPU interpret mode (and the worker's later interpret calls); the thread
# timeout ends the worker, so the test fails instead (calls take 5-15 s).
INTERPRET_TIMEOUT = pytest.mark.timeout(300, method="thread")

# block_m per variant: the pipelined kernel's 64-row tiles, the warp-specialized kernel's 128 (two 64-row consumer
# halves; its interpret grid has 2 CTAs, so the cases with more tiles also run the persistent loop).
def _rows(kernel, block_m):
    return block_m if kernel == "pipelined" else max(block_m, 128)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m,n,k,block_m,block_n", [(70, 200, 300, 64, 128), (130, 96, 256, 128, 32),
                                             (70, 200, 300, 64, 96),     # 96: tiles straddle 128-column scale blocks
                                             (70, 2200, 260, 64, 160)])  # 160: straddles; windows past the 16th block
@INTERPRET_TIMEOUT
def test_fp8_gemm_pallas_interpret(kernel, m, n, k, block_m, block_n):
    _, _, a, a_s, b, b_s = make_dense(m, n, k)
    out = fp8_gemm(a, a_s, b, b_s, out_dtype=F32, implementation="pallas", interpret=True, kernel=kernel,
                   block_m=_rows(kernel, block_m), block_n=block_n, stages=2)
    assert rel_err(out, fp8_gemm_reference(a, a_s, b, b_s, out_dtype=F32)) < 1e-5


@pytest.mark.parametrize("kernel", KERNELS)
def test_interpreted_kernel_runs_its_own_wgmma_from_jax_0_11_2(kernel):
    """From jax 0.11.2 on, interpret mode runs the native code path (the kernel's jaxpr holds its wgmma), so the
    interpret tests here check the instructions a GPU runs; before, value-level stand-ins take the wgmma's place."""
    S = jax.ShapeDtypeStruct
    args = (S((64, 256), jnp.float8_e4m3fn), S((64, 2), F32), S((64, 256), jnp.float8_e4m3fn), S((1, 2), F32))
    text = str(jax.make_jaxpr(lambda *x: fp8_gemm(*x, implementation="pallas", interpret=True, kernel=kernel))(*args))
    assert ("wgmma" in text) == NATIVE_INTERPRETER


@pytest.mark.parametrize("entry", ["dense", "contiguous"])
@INTERPRET_TIMEOUT
def test_warp_specialized_multicast_interpret(entry):
    """multicast=2 (CTA pairs share their A tile): 4 column tiles of 64 = 2 pairs per row tile, on the interpret
    grid's one cluster of 2 CTAs; dense: 2 row tiles; contiguous: 3 groups (one empty) over unaligned segments and
    -1 rows: 2 active row tiles of the plan's 7, the rest skipped. Interpret mode has cluster barriers from jax
    0.11.2 on; before, it refuses."""
    kw = dict(out_dtype=F32, implementation="pallas", interpret=True, kernel="warp_specialized", block_m=128,
              block_n=64, stages=2, multicast=2)
    if entry == "dense":   # 4 k-steps over the 2-deep ring: the tiles' pipelines chain (fp8_tiling.chains_tiles)
        _, _, a, a_s, b, b_s = make_dense(256, 256, 512)
        run = lambda: fp8_gemm(a, a_s, b, b_s, **kw)                                          # noqa: E731
        exact = np.asarray(fp8_gemm_reference(a, a_s, b, b_s, out_dtype=F32))
    else:
        _, _, a, a_s, b, b_s = make_grouped(3, 400, 256, 300, seed=7)
        gid = np.concatenate([np.full(70, 0), np.full(150, -1), np.full(100, 2), np.full(80, -1)]).astype(np.int32)
        run = lambda: fp8_grouped_gemm_contiguous(a, a_s, b, b_s, jnp.asarray(gid), **kw)     # noqa: E731
        exact = np_contiguous(a, a_s, b, b_s, gid)
    if not NATIVE_INTERPRETER:
        with pytest.raises(ValueError, match="multicast=2 cannot run in GPU interpret mode on jax"):
            run()
        return
    assert rel_err(run(), exact) < 1e-5


@pytest.mark.parametrize("entry", ["dense", "contiguous"])
@INTERPRET_TIMEOUT
def test_warp_specialized_chained_tiles_interpret(entry):
    """Tiles whose pipelines chain (the ring depth divides the k-steps): each of the interpret grid's 2 CTAs runs
    several tiles, the first with pipeline_state START, the last STOP, STEADY between, and the producer refills each
    slot for the next tile while the consumers finish the current one. Contiguous: a data-dependent tile count (3
    active row tiles of 5, one CTA gets an odd share of the 6 active tiles x 2 column tiles)."""
    stages, k = 3, 6 * 128 - 40                                                  # 6 k-steps: two rounds of the ring
    assert fp8_tiling.chains_tiles(-(-k // 128), stages) and not fp8_tiling.chains_tiles(-(-k // 128), 4)
    kw = dict(out_dtype=F32, implementation="pallas", interpret=True, kernel="warp_specialized", block_m=128,
              block_n=64, stages=stages)
    if entry == "dense":
        _, _, a, a_s, b, b_s = make_dense(3 * 128 - 9, 4 * 64 - 5, k, seed=3)     # 12 tiles: 6 per CTA
        out, exact = fp8_gemm(a, a_s, b, b_s, **kw), fp8_gemm_reference(a, a_s, b, b_s, out_dtype=F32)
    else:
        _, _, a, a_s, b, b_s = make_grouped(3, 330, 128, k, seed=8)
        gid = np.concatenate([np.full(100, 1), np.full(60, -1), np.full(130, 0), np.full(40, 2)]).astype(np.int32)
        out = fp8_grouped_gemm_contiguous(a, a_s, b, b_s, jnp.asarray(gid), **kw)
        exact = np_contiguous(a, a_s, b, b_s, gid)
    assert rel_err(out, exact) < 1e-5


@INTERPRET_TIMEOUT
def test_fp8_gemm_warp_specialized_256_rows_interpret():
    _, _, a, a_s, b, b_s = make_dense(300, 96, 384)                              # 2 row tiles of 256 (128 per consumer)
    out = fp8_gemm(a, a_s, b, b_s, out_dtype=F32, implementation="pallas", interpret=True,
                   kernel="warp_specialized", block_m=256, block_n=32, stages=2)
    assert rel_err(out, fp8_gemm_reference(a, a_s, b, b_s, out_dtype=F32)) < 1e-5


@pytest.mark.parametrize("kernel", KERNELS)
@INTERPRET_TIMEOUT
def test_grouped_contiguous_pallas_interpret(kernel):
    g, m, n, k = 4, 100, 136, 200                                               # unaligned segments, -1 anywhere
    _, _, a, a_s, b, b_s = make_grouped(g, m, n, k)
    gid = np.random.default_rng(4).choice([-1, 0, 1, 3], size=m).astype(np.int32)   # group 2 empty
    out = fp8_grouped_gemm_contiguous(a, a_s, b, b_s, jnp.asarray(gid), out_dtype=F32, implementation="pallas",
                                      interpret=True, kernel=kernel, block_m=_rows(kernel, 64), block_n=128, stages=2)
    assert rel_err(out, np_contiguous(a, a_s, b, b_s, gid)) < 1e-5 and not np.asarray(out)[gid < 0].any()


@pytest.mark.parametrize("kernel", KERNELS)
@INTERPRET_TIMEOUT
def test_grouped_masked_pallas_interpret(kernel):
    g, m_max, n, k = 3, 70, 136, 200
    masked_m = np.array([0, 70, 33], np.int32)
    _, _, a, a_s, b, b_s = make_masked(g, m_max, n, k)
    out = fp8_grouped_gemm_masked(a, a_s, b, b_s, jnp.asarray(masked_m), implementation="pallas", interpret=True,
                                  kernel=kernel, block_m=_rows(kernel, 64), block_n=128, stages=2)
    assert out.dtype == jnp.bfloat16
    exact = np_masked(a, a_s, b, b_s, masked_m)
    assert rel_err(out.astype(F32), exact) < 1e-2 and not np.asarray(out.astype(F32))[0].any()


@pytest.mark.parametrize("kernel", KERNELS)
@INTERPRET_TIMEOUT
def test_benchmark_probes_interpret(kernel, benchmark_script):
    """The benchmark probes (benchmarks/kernels_fp8.py ``PROBES``, --breakdown: the kernels' accumulation hook
    replaced), both kernels: "mma" is the product without scales, sum over k of A B^T in fp32 (against float64
    numpy of the fp8 values); "stream" computes nothing and writes zeros. 4 k-steps over a 2-deep ring,
    3 x 2 output tiles (the warp-specialized kernel's 2 CTAs each run several, their pipelines chained, as the
    headline shape's default tiling runs)."""
    from kernels_pallas.fp8.pallas import dense_pallas, resolve_tiling

    km = benchmark_script("kernels_fp8")
    m, n, k = 3 * _rows(kernel, 64) - 5, 2 * 64 - 3, 4 * 128 - 7
    assert fp8_tiling.chains_tiles(4, 2)
    _, _, a, a_s, b, b_s = make_dense(m, n, k, seed=9)
    tiling = resolve_tiling(kernel, _rows(kernel, 64), 64, 128, 2, rows=m, n=n, k=k, out_dtype=F32, interpret=True)
    run = functools.partial(dense_pallas, a, a_s, b, b_s, tiling=tiling, out_dtype=F32, interpret=True)
    exact = np.asarray(a.astype(F32), np.float64) @ np.asarray(b.astype(F32), np.float64).T          # (m, n)
    assert rel_err(run(accumulation=km.probe_accumulation("mma")), exact) < 1e-5
    np.testing.assert_array_equal(np.asarray(run(accumulation=km.probe_accumulation("stream"))), 0.0)
    with pytest.raises(ValueError, match="probe must be None or one of"):
        km.probe_accumulation("promote")


@INTERPRET_TIMEOUT
def test_benchmark_breakdown_interpret(benchmark_script):
    """benchmarks/kernels_fp8.py --breakdown on a small shape in interpret mode (its plumbing: the kernel and both
    probes run), and its numbers worked by hand. m = n = k = 256, the pipelined kernel's default tiling there
    64 x 128: 4 x 2 tiles x 2 k-steps, each bringing 64 * 128 + 128 * 128 bytes of e4m3 and 4 * (64 + 32) of
    scales = 24960 bytes: 399360 in all. The line: 399360 B in 1 us is 0.40 TB/s; 2 * 256^3 flops in 2 us is 16.8
    TFLOPS, in 4 us 8.4."""
    km = benchmark_script("kernels_fp8")
    st = km.breakdown_case(256, 256, 256, "pipelined", interpret=True, iters=1, repeats=1)
    assert (st["tiling"].block_m, st["tiling"].block_n) == (64, 128)
    assert st["tile_bytes"] == 399360 and st["flops"] == 2 * 256 ** 3
    assert all(st[key] > 0 for key in ("kernel", "mma", "stream"))
    st.update(stream=1e-6, mma=2e-6, kernel=4e-6)
    assert km.breakdown_line("x", st) == (
        f"  probes x [64x128x{st['tiling'].stages}]: stream 1.0 us (0.40 TB/s of tiles into SMEM), mma 2.0 us "
        "(16.8 TFLOPS), kernel 4.0 us (8.4 TFLOPS)")


# ------------------------------------------------------------------------------------------------- cross-lowering
# The shipped configurations: every tiling the entries choose by default (fp8_tiling.resolve, 132 SMs) on
# DeepGEMM's shapes (dense m in 64, 128, 4096 x its six (n, k); grouped contiguous and masked rows with its grouped
# (n, k) pairs: (4096, 7168) and (7168, 2048)), both kernels.
DEEPGEMM_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
DEEPGEMM_ROWS = [(m, n, k) for m in (64, 128, 4096) for n, k in DEEPGEMM_NK] + [
    (g * m, n, k) for g, m in ((4, 8192), (8, 4096), (1, 1024), (2, 512), (4, 256)) for n, k in ((4096, 7168),
                                                                                               (7168, 2048))]


def _shipped():
    picked = {(kernel, fp8_tiling.resolve(kernel, None, None, 128, None, rows=m, n=n, num_sms=132, out_itemsize=2,
                                          k_steps=k // 128))
              for kernel in KERNELS for m, n, k in DEEPGEMM_ROWS}
    return [dict(kernel=kernel, block_m=t.block_m, block_n=t.block_n, stages=t.stages)
            for kernel, t in sorted(picked, key=lambda x: (x[0], x[1].block_m, x[1].block_n, x[1].stages))]


SHIPPED = _shipped() + [dict(kernel="warp_specialized", block_m=128, block_n=128, stages=5, multicast=2)]


def within_bf16_rounding(out, exact):
    """Every element of a bf16 result within bf16's rounding of the exact fp32 sum (2^-9 relative; 2^-8 leaves room
    for the summation order), plus 1e-6 of the largest magnitude."""
    out, exact = np.asarray(out.astype(F32), np.float64), np.asarray(exact, np.float64)
    return bool(np.all(np.abs(out - exact) <= 2.0 ** -8 * np.abs(exact) + 1e-6 * np.abs(exact).max()))


@pytest.mark.parametrize("cfg", SHIPPED, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@INTERPRET_TIMEOUT
def test_shipped_tilings_interpret(cfg):
    """Every default tiling (SHIPPED) on 2 row tiles x 4 column tiles, both ragged, and a k that wraps the
    stage ring, the last k-step partial: stages + 2 k-steps, or for the warp-specialized kernel, whose default
    ring divides the k-steps (its tiles' pipelines chain), 2 x stages; bf16 out as the entries default to."""
    if cfg.get("multicast") == 2 and not NATIVE_INTERPRETER:
        pytest.skip("multicast=2 needs the cluster barriers of jax >= 0.11.2's interpreter (the refusal is tested)")
    steps = 2 * cfg["stages"] if cfg["kernel"] == "warp_specialized" else cfg["stages"] + 2
    m, n, k = 2 * cfg["block_m"] - 6, 4 * cfg["block_n"] - 8, steps * 128 - 40
    _, _, a, a_s, b, b_s = make_dense(m, n, k, seed=6)
    out = fp8_gemm(a, a_s, b, b_s, implementation="pallas", interpret=True, **cfg)
    assert out.dtype == jnp.bfloat16 and within_bf16_rounding(out, fp8_gemm_reference(a, a_s, b, b_s, out_dtype=F32))


def test_default_block_n_follows_deepgemm_wave_rule():
    """Worked by hand from DeepGEMM's rule (fewest waves over 132 SMs, then the fullest last wave), widths dividing n
    first. m=64, n=7168 (pipelined, 1 row tile; 96 does not divide 7168): 128 -> 56 tiles, 64 -> 112, 32 -> 224 (two
    waves): 64. m=4096, n=2112 (warp_specialized, 32 row tiles; 2112 = 64 * 33, so of the default widths 128, 64,
    32 only 64 and 32 divide it): 64 -> 1056 tiles (8 waves), 32 -> 2112 (16): 64; among 192, 96, 64 (192 and 96
    divide too) 192 -> 352 tiles (3 waves) would win. m=4096, n=7168 (pipelined, 64 row tiles): 128 -> 28 waves,
    the fewest: 128."""
    pick = fp8_tiling.pick_block_n
    assert pick(1, 7168, 132, fp8_tiling.PIPELINED_BLOCK_NS) == 64
    assert pick(32, 2112, 132, fp8_tiling.WS_BLOCK_NS) == 64
    assert pick(32, 2112, 132, (192, 96, 64)) == 192
    assert pick(64, 7168, 132, fp8_tiling.PIPELINED_BLOCK_NS) == 128
    assert pick(1, 100, 132, (128, 64)) == 64                      # nothing divides n: every candidate counts


@pytest.mark.parametrize("block_n,k_steps,stages", [(128, None, 5), (128, 56, 4), (128, 128, 4), (128, 12, 4),
                                                    (128, 4, 4), (128, 15, 5), (128, 7, 5), (64, 56, 8),
                                                    (64, 12, 6), (64, 4, 4), (64, 9, 3)])
def test_warp_specialized_default_ring_divides_k_steps(block_n, k_steps, stages):
    """The deepest ring that fits SMEM and divides the k-steps (so the tiles' pipelines chain), at least 3 deep,
    else the deepest that fits. Worked by hand, bf16 out: a stage of 128 x 128 takes (128 + 128) * 128 + 4 * (128 +
    32) = 33408 bytes, the epilogue tile 32768, the slack 2048, so 5 stages fit 227 KB (6 need 235264 bytes); at
    128 x 64, 25216 per stage, 16384 + 2048 besides: 8 fit. k = 7168 is 56 k-steps: 4 at 128 x 128, 8 at 128 x 64;
    7 k-steps: no fitting divisor of at least 3, so 5, unchained."""
    t = fp8_tiling.resolve("warp_specialized", 128, block_n, 128, None, rows=4096, n=7168, num_sms=132,
                           out_itemsize=2, k_steps=k_steps)
    assert t.stages == stages
    if k_steps is not None:
        assert fp8_tiling.chains_tiles(k_steps, stages) == (k_steps % stages == 0)


@pytest.mark.parametrize("cfg", SHIPPED, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("entry", ["dense", "contiguous", "masked"])
def test_kernels_lower_for_cuda(entry, cfg):
    sds = jax.ShapeDtypeStruct
    e4, f32, i32 = jnp.float8_e4m3fn, F32, jnp.int32
    if entry == "dense":
        fn, args = fp8_gemm, (sds((200, 384), e4), sds((200, 3), f32), sds((256, 384), e4), sds((2, 3), f32))
    elif entry == "contiguous":
        fn, args = fp8_grouped_gemm_contiguous, (sds((300, 384), e4), sds((300, 3), f32), sds((4, 256, 384), e4),
                                                 sds((4, 2, 3), f32), sds((300,), i32))
    else:
        fn, args = fp8_grouped_gemm_masked, (sds((4, 96, 384), e4), sds((4, 96, 3), f32), sds((4, 256, 384), e4),
                                             sds((4, 2, 3), f32), sds((4,), i32))
    text = _mosaic.lower_for_cuda(fn, *args, implementation="pallas", interpret=False, **cfg)
    assert _mosaic.has_mosaic_gpu_call(text)


@pytest.mark.parametrize("kernel,block_m", [("pipelined", 64), ("warp_specialized", 128)])
@pytest.mark.parametrize("block_n", [96, 160])
def test_straddling_tilings_lower_for_cuda(kernel, block_m, block_n):
    """Tiles that span two 128-column scale blocks (block_n 96, 160: not defaults, valid knobs, the GPU sweep's
    128x160x4) lower for cuda on every supported jax: their promotion keeps 32-column chunks apart (jax 0.10's
    Mosaic GPU Lane lowering has no concatenate) and their epilogue stores each chunk."""
    m, n, k = 256, 7168, 1024
    S = jax.ShapeDtypeStruct
    args = (S((m, k), jnp.float8_e4m3fn), S((m, k // 128), F32), S((n, k), jnp.float8_e4m3fn),
            S((n // 128, k // 128), F32))
    text = _mosaic.lower_for_cuda(fp8_gemm, *args, implementation="pallas", interpret=False, kernel=kernel,
                                  block_m=block_m, block_n=block_n, stages=4)
    assert _mosaic.has_mosaic_gpu_call(text)


@pytest.mark.parametrize("probe", ["mma", "stream"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_benchmark_probes_lower_for_cuda(kernel, probe, benchmark_script):
    """The probes the GPU run's --breakdown times, in the headline shape's default tiling (m=4096 n=7168 k=16384),
    lower for cuda to one Mosaic GPU kernel (so an XLA fallback or a kernel that cannot compile fails here)."""
    from kernels_pallas.fp8.pallas import dense_pallas, resolve_tiling

    km = benchmark_script("kernels_fp8")

    m, n, k = 4096, 7168, 16384
    S = jax.ShapeDtypeStruct
    args = (S((m, k), jnp.float8_e4m3fn), S((m, k // 128), F32), S((n, k), jnp.float8_e4m3fn),
            S((n // 128, k // 128), F32))
    tiling = resolve_tiling(kernel, None, None, 128, None, rows=m, n=n, k=k, out_dtype=jnp.bfloat16,
                            interpret=False)
    text = _mosaic.lower_for_cuda(dense_pallas, *args, tiling=tiling, out_dtype=jnp.bfloat16, interpret=False,
                                  accumulation=km.probe_accumulation(probe))
    assert _mosaic.has_mosaic_gpu_call(text)


# The CUDA launch Mosaic GPU builds for a goal shape (m=4096 n=7168 k=2048, the default tilings): the pipelined
# kernel's grid is (column tiles, row tiles) with the column tiles on blockIdx.x, one warpgroup, and little enough
# SMEM for the two CTAs per SM its default assumes; the warp-specialized one is persistent (one CTA per SM, three
# warpgroups). Tiling.smem_bytes bounds Mosaic GPU's allocation from above by at most its slack.
@pytest.mark.parametrize("kernel,grid,threads", [("pipelined", (7168 // 128, 4096 // 64, 1), 128),
                                                 ("warp_specialized", (132, 1, 1), 384)])
def test_default_tiling_launch(kernel, grid, threads):
    m, n, k = 4096, 7168, 2048
    S = jax.ShapeDtypeStruct
    args = (S((m, k), jnp.float8_e4m3fn), S((m, k // 128), jnp.float32), S((n, k), jnp.float8_e4m3fn),
            S((n // 128, k // 128), jnp.float32))
    (launch,) = _mosaic.kernel_launches(fp8_gemm, *args, implementation="pallas", interpret=False, kernel=kernel)
    tiling = fp8_tiling.resolve(kernel, None, None, 128, None, rows=m, n=n, num_sms=132, out_itemsize=2,
                                k_steps=k // 128)
    assert launch.grid == grid and launch.block == (threads, 1, 1)
    estimate = tiling.smem_bytes(2)
    assert estimate - fp8_tiling.SMEM_SLACK <= launch.smem_bytes <= estimate
    if kernel == "pipelined":
        assert 2 * launch.smem_bytes <= fp8_tiling.SMEM_BYTES


def test_pipelined_k_step_has_one_fenced_barrier():
    """The pipelined kernel runs without Pallas's automatic barriers (one before each of a k-step's four refill
    copies) and places its own: each k-step's body holds exactly one warpgroup barrier, after an async-proxy
    fence, so every thread's reads of a ring slot are done before the slot's refill. Interpret mode cannot see a
    missing one (a warpgroup is one thread there), hence this check of the module a GPU compiles."""
    m, n, k = 256, 256, 1024
    S = jax.ShapeDtypeStruct
    args = (S((m, k), jnp.float8_e4m3fn), S((m, k // 128), F32), S((n, k), jnp.float8_e4m3fn),
            S((n // 128, k // 128), F32))
    (module,) = _mosaic.kernel_modules(fp8_gemm, *args, implementation="pallas", interpret=False,
                                       kernel="pipelined")
    (body,) = _mosaic.loop_bodies(module.text)                                   # the k-loop: emit_pipeline's scf.for
    barriers = [i for i, line in enumerate(body) if "bar.sync" in line]
    fences = [i for i, line in enumerate(body) if "fence.proxy" in line and "async" in line]
    assert len(barriers) == 1 and fences and fences[-1] < barriers[0]
    copies = [i for i, line in enumerate(body) if "cp.async.bulk.tensor" in line or "async_load" in line]
    assert copies and barriers[0] < min(copies)                          # the refills come after it


@pytest.mark.parametrize("kernel", KERNELS)
@INTERPRET_TIMEOUT
def test_grouped_masked_wide_n_interpret(kernel):
    """Column tiles past the 16th 128-column scale block: their B-scale windows start at block 16, per group."""
    g, m_max, n, k = 2, 40, 2200, 130
    masked_m = np.array([40, 17], np.int32)
    _, _, a, a_s, b, b_s = make_masked(g, m_max, n, k)
    out = fp8_grouped_gemm_masked(a, a_s, b, b_s, jnp.asarray(masked_m), out_dtype=F32, implementation="pallas",
                                  interpret=True, kernel=kernel, block_m=_rows(kernel, 64), block_n=128, stages=2)
    exact = np_masked(a, a_s, b, b_s, masked_m)
    assert rel_err(out, exact) < 1e-5
