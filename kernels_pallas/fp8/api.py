"""FP8 GEMMs with fine-grained scales (DeepGEMM's contract, docs/architecture.md "DeepGEMM FP8 contract"): the public
entries, dense and MoE-grouped (contiguous and masked layouts).

D[m, n] = sum over k-blocks kb of dot(A[m, kb], B[n, kb]) * As[m, kb] * Bs[n // 128, kb], fp32 accumulation. A [m, k]
e4m3 with per-token-per-128 scales [m, ceil(k/128)]; B [n, k] e4m3 (checkpoint layout out x in) with 128x128 block
scales [ceil(n/128), ceil(k/128)]. Partial last blocks are zero-padded.

Four parts (docs/architecture.md "Kernels"): the Mosaic GPU kernel bodies (pipelined.py, warp_specialized.py) ->
their ``plgpu.kernel`` wrappers, run by the Pallas paths (pallas.py, grouped.py) -> the jitted entries here
(``implementation="pallas" | "xla"``, tuning knobs: ``Tiling``, tiling.py) -> the ``*_reference`` functions
(reference.py, plain jnp, fp32). xla.py holds the XLA paths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import _mosaic
from kernels_pallas.common import choose_implementation
from kernels_pallas.fp8.common import check_contiguous, check_masked, check_operands
from kernels_pallas.fp8.grouped import contiguous_pallas, masked_pallas
from kernels_pallas.fp8.pallas import dense_pallas, resolve_tiling
from kernels_pallas.fp8.tiling import BLOCK_K, check_kernel
from kernels_pallas.fp8.xla import contiguous_xla, gemm_xla, masked_xla

_STATIC = ("out_dtype", "implementation", "interpret", "block_m", "block_n", "block_k", "stages", "kernel",
           "multicast")


def resolve_implementation(implementation, interpret):
    """implementation None -> "pallas" on a CUDA GPU, "xla" elsewhere; interpret None -> per backend."""
    implementation = choose_implementation(implementation, gpu=not _mosaic.default_interpret())
    if interpret is None:
        interpret = _mosaic.default_interpret()
    return implementation, bool(interpret)


def _dispatch(xla_path, pallas_path, *, rows, n, k, out_dtype, implementation, interpret, kernel, multicast,
              **tiles):
    """Run the XLA path (xla_path(out_dtype)) or the Pallas path for the resolved tiling (pallas_path(tiling=,
    out_dtype=, interpret=)); rows: rows whose tiles may run; tiles: block_m, block_n, block_k, stages."""
    check_kernel(kernel)
    implementation, interpret = resolve_implementation(implementation, interpret)
    if implementation == "xla":
        return xla_path(out_dtype)
    tiling = resolve_tiling(kernel, tiles["block_m"], tiles["block_n"], tiles["block_k"], tiles["stages"], rows=rows,
                            n=n, k=k, out_dtype=out_dtype, interpret=interpret, multicast=multicast)
    return pallas_path(tiling=tiling, out_dtype=out_dtype, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_gemm(a, a_scale, b, b_scale, *, out_dtype=jnp.bfloat16, implementation=None, interpret=None,
             block_m=None, block_n=None, block_k=BLOCK_K, stages=None, kernel="pipelined", multicast=1):
    """D [m, n] = A [m, k] (e4m3, per-token-per-128 scales) x B [n, k]^T (e4m3, 128x128 block scales).

  implementation None: "pallas" on a CUDA GPU, "xla" elsewhere. interpret None: interpret the kernel where the
  backend cannot run it. Tuning (None: tiling.py's DeepGEMM-style defaults for this shape and GPU): kernel
  ("pipelined" | "warp_specialized", pallas.py), block_m (pipelined: 64 | 128, None: 64; warp_specialized:
  128 | 256, None: 128), block_n (multiple of 32 in [32, 256] whose accumulators fit registers: pipelined <= 160
  at block_m 64, <= 64 at 128; warp_specialized <= 160 at 128, <= 64 at 256), block_k (must be 128: one scale per
  k-step), stages (TMA pipeline depth; the ring and the epilogue tile must fit in 227 KB of SMEM), multicast
  (warp_specialized: 2 = pairs of CTAs take adjacent column tiles of one row tile and share its A tile by TMA
  multicast, DeepGEMM's; needs an even number of column tiles; not in interpret mode)."""
    m, n, k = check_operands(a, a_scale, b, b_scale)
    return _dispatch(functools.partial(gemm_xla, a, a_scale, b, b_scale),
                     functools.partial(dense_pallas, a, a_scale, b, b_scale), rows=m, n=n, k=k,
                     out_dtype=out_dtype, implementation=implementation, interpret=interpret, kernel=kernel,
                     multicast=multicast, block_m=block_m, block_n=block_n, block_k=block_k, stages=stages)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_grouped_gemm_contiguous(a, a_scale, b, b_scale, group_ids, *, out_dtype=jnp.bfloat16, implementation=None,
                                interpret=None, block_m=None, block_n=None, block_k=BLOCK_K, stages=None,
                                kernel="pipelined", multicast=1):
    """a [m, k] e4m3 (+ [m, ceil(k/128)] scales), b [G, n, k] e4m3 (+ [G, ceil(n/128), ceil(k/128)]),
  group_ids [m] int (-1 = padding, anywhere; segments need not be aligned) -> [m, n], padding rows zero.
  Knobs as fp8_gemm's."""
    m, n, k, _ = check_contiguous(a, a_scale, b, b_scale, group_ids)
    ops = (a, a_scale, b, b_scale, group_ids)
    return _dispatch(functools.partial(contiguous_xla, *ops), functools.partial(contiguous_pallas, *ops), rows=m,
                     n=n, k=k, out_dtype=out_dtype, implementation=implementation, interpret=interpret,
                     kernel=kernel, multicast=multicast, block_m=block_m, block_n=block_n, block_k=block_k,
                     stages=stages)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_grouped_gemm_masked(a, a_scale, b, b_scale, masked_m, *, out_dtype=jnp.bfloat16, implementation=None,
                            interpret=None, block_m=None, block_n=None, block_k=BLOCK_K, stages=None,
                            kernel="pipelined", multicast=1):
    """a [G, m_max, k] e4m3 (+ [G, m_max, ceil(k/128)]), b [G, n, k] (+ [G, ceil(n/128), ceil(k/128)]),
  masked_m [G] int -> [G, m_max, n]; rows at or past masked_m[g] are zero. Knobs as fp8_gemm's."""
    g, m_max, n, k = check_masked(a, a_scale, b, b_scale, masked_m)
    ops = (a, a_scale, b, b_scale, masked_m)
    return _dispatch(functools.partial(masked_xla, *ops), functools.partial(masked_pallas, *ops), rows=g * m_max,
                     n=n, k=k, out_dtype=out_dtype, implementation=implementation, interpret=interpret,
                     kernel=kernel, multicast=multicast, block_m=block_m, block_n=block_n, block_k=block_k,
                     stages=stages)
