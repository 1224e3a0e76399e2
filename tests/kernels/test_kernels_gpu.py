"""Native Mosaic GPU kernels against their references, at DeepSeek-V3 shapes: runs only on a CUDA GPU
(the CPU suite checks the same kernels in GPU interpret mode and by cross-lowering; see mla/test_mla_decode.py and
fp8/test_fp8_gemm.py). Run on the GPU machine by scripts/gpu_check.sh (the warp-specialized FP8 cases in a step of
their own).

Metrics: FlashMLA's cal_diff < 1e-5 against the fp32 reference (tests/test_flash_mla.py); DeepGEMM's calc_diff
< 1e-3 against the bf16 product of the unquantized inputs (tests/test_core.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import (fp8_gemm, fp8_grouped_gemm_contiguous, fp8_grouped_gemm_masked, mla_decode,
                            mla_decode_reference, per_block_cast_to_fp8, per_token_cast_to_fp8)
from kernels_pallas._mosaic import default_interpret

pytestmark = pytest.mark.skipif(default_interpret(), reason="native Mosaic GPU kernels need a CUDA GPU")


def diff(x, y):
    """1 - 2 sum(xy) / sum(x^2 + y^2) in float64 (FlashMLA's cal_diff = DeepGEMM's calc_diff)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return 1.0 - 2.0 * (x * y).sum() / (x * x + y * y).sum()


@pytest.mark.parametrize("kernel", ["recompute_scores", "shared_scores", "pingpong"])
@pytest.mark.parametrize("b, s_k, h_q, s_q", [(4, 130, 16, 1), (4, 4096, 128, 1), (2, 1, 16, 1),
                                              (4, 2000, 128, 2), (1, 8192, 16, 2)])
def test_mla_decode_native(b, s_k, h_q, s_q, kernel):
    d, dv, page = 576, 512, 64
    rng = np.random.default_rng(s_k + h_q)
    pages = -(-s_k // page)
    q = jnp.asarray(rng.standard_normal((b, s_q, h_q, d)), jnp.bfloat16)
    kv = rng.standard_normal((b * pages + 1, page, 1, d)).astype(np.float32)
    kv[-1] = np.nan  # an unused page; slots past each length are NaN too
    table = rng.permutation(b * pages).reshape(b, pages).astype(np.int32)
    seqlens = np.maximum(rng.integers(s_k // 2, s_k + 1, b), s_q).astype(np.int32)
    for i in range(b):  # NaN in the slots past the length
        for pos in range(seqlens[i], pages * page):
            kv[table[i, pos // page], pos % page] = np.nan
    args = (q, jnp.asarray(kv, jnp.bfloat16), jnp.asarray(table), jnp.asarray(seqlens))
    out, lse = mla_decode(*args, head_dim_v=dv, causal=s_q > 1, implementation="pallas", kernel=kernel)
    ref_out, ref_lse = mla_decode_reference(*args, head_dim_v=dv, causal=s_q > 1)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert diff(out, ref_out) < 1e-5 and diff(lse, ref_lse) < 1e-5


def _quantized(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
    return x, w, per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)


def _check_dense(m, n, k, **knobs):
    x, w, (a, sa), (bq, sb) = _quantized(m, n, k)
    out = fp8_gemm(a, sa, bq, sb, implementation="pallas", **knobs)
    assert diff(out, (x.astype(jnp.float32) @ w.astype(jnp.float32).T).astype(jnp.bfloat16)) < 1e-3
    assert diff(out, fp8_gemm(a, sa, bq, sb, implementation="xla")) < 1e-6


@pytest.mark.parametrize("m, n, k", [(64, 2112, 7168), (128, 24576, 1536), (4096, 7168, 2048), (70, 200, 300)])
def test_fp8_gemm_native(m, n, k):
    _check_dense(m, n, k)


def test_fp8_gemm_native_straddling_tiles():
    """block_n=96: tiles straddle 128-column scale blocks (promoted in 32-column chunks, fp8 pallas_common.promote)."""
    _check_dense(4096, 7168, 2048, block_n=96)


def _check_grouped(**knobs):
    g, m_max, n, k = 4, 256, 4096, 7168
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((g, n, k)), jnp.bfloat16)
    bq, sb = jax.vmap(per_block_cast_to_fp8)(w)
    x = jnp.asarray(rng.standard_normal((g, m_max, k)), jnp.bfloat16)
    a, sa = jax.vmap(per_token_cast_to_fp8)(x)
    masked_m = jnp.asarray([0, 17, 256, 100], jnp.int32)
    out = fp8_grouped_gemm_masked(a, sa, bq, sb, masked_m, implementation="pallas", **knobs)
    ref = fp8_grouped_gemm_masked(a, sa, bq, sb, masked_m, implementation="xla")
    assert diff(out, ref) < 1e-6
    group_ids = jnp.asarray(rng.integers(-1, g, 700), jnp.int32)
    flat_a, flat_s = per_token_cast_to_fp8(jnp.asarray(rng.standard_normal((700, k)), jnp.bfloat16))
    out = fp8_grouped_gemm_contiguous(flat_a, flat_s, bq, sb, group_ids, implementation="pallas", **knobs)
    ref = fp8_grouped_gemm_contiguous(flat_a, flat_s, bq, sb, group_ids, implementation="xla")
    assert diff(out, ref) < 1e-6
    assert not np.asarray(out)[np.asarray(group_ids) < 0].any()


def test_fp8_grouped_native():
    _check_grouped()


# The warp-specialized variant (kernel="warp_specialized", fp8/warp_specialized.py), same oracles. Kept last and selected by
# name (-k warp_specialized) so that scripts/gpu_check.sh runs it in its own step after everything else.
# The defaults chain the tiles' pipelines (fp8/tiling.py chains_tiles: a 4-deep ring over 16 k-steps at
# (4096, 7168, 2048), ~14 tiles per CTA); stages=5 does not divide 16, so each tile fills and drains its own ring.
# block_n=160: tiles straddle 128-column scale blocks (promoted in 32-column chunks, fp8 pallas_common.promote).
@pytest.mark.parametrize("m, n, k, stages, block_n", [(64, 2112, 7168, None, None), (4096, 7168, 2048, None, None),
                                                      (70, 200, 300, None, None), (4096, 7168, 2048, 5, None),
                                                      (4096, 7168, 2048, 4, 160)])
def test_fp8_gemm_native_warp_specialized(m, n, k, stages, block_n):
    _check_dense(m, n, k, kernel="warp_specialized", stages=stages, block_n=block_n)


def test_fp8_grouped_native_warp_specialized():
    _check_grouped(kernel="warp_specialized")


# multicast=2 (CTA pairs sharing their A tile): interpret mode runs it only from jax 0.11.2 on, and even there each
# CTA copies the whole A tile (the copy's meaning); here the hardware splits the load and multicasts it.
def test_fp8_gemm_native_warp_specialized_multicast():
    _check_dense(4096, 7168, 2048, kernel="warp_specialized", multicast=2)
    _check_grouped(kernel="warp_specialized", multicast=2)
