"""FP8 GEMM, kernel="pipelined" (the default): one warpgroup per CTA, grid (row tiles, column tiles), per k-step a
wgmma, its wait and the promotion (pallas_common.py), K-steps TMA-pipelined ``stages`` deep (``plgpu.emit_pipeline``).

A CTA's tensor cores idle during each wait and promotion; the default tiles (64 rows, a pipeline shallow enough for
two CTAs per SM: tiling.py) let a second CTA fill them. Operands as every FP8 kernel's (pallas.py): row tiles of A,
each tagged with the group whose weights it uses (-1: skip the tile, its output rows are left unwritten).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kernels_pallas import _mosaic
from kernels_pallas.fp8.pallas_common import (PROMOTED, Accumulation, epilogue_smem, operand_transforms,
                                              scale_window_start, store_acc)
from kernels_pallas.fp8.tiling import BLOCK_K, SCALE_WINDOW, Tiling


def pipelined_kernel(tile_group_gmem, a_gmem, as_gmem, b_gmem, bs_gmem, o_gmem, o_smem, *, tiling: Tiling,
                     num_k: int, sim: bool, accumulation: Accumulation = PROMOTED):
    """One (block_m, block_n) output tile of row tile ti, group tile_group[ti] (-1: skip).

  a_gmem [T*bm, kp] e4m3, as_gmem [kb, T*bm] f32 (A scales, transposed), b_gmem [G, np, kp] e4m3,
  bs_gmem [G, kb, nbw] f32 (B block scales, transposed: pallas.prepare_b), o_gmem [T*bm, np]; o_smem (bm, bn)
  scratch. accumulation: the per-tile hook (pallas_common.Accumulation; benchmarks substitute it).
  """
    block_m, block_n = tiling.block_m, tiling.block_n
    ti, ni = lax.axis_index("m"), lax.axis_index("n")
    g = tile_group_gmem[ti]
    tiles = operand_transforms()

    @pl.when(g >= 0)
    def _():
        gg = jnp.maximum(g, 0)

        def k_step(_, a_smem, b_smem, as_smem, bs_smem, acc):
            # release: the step's one barrier: every thread's reads of this ring slot (scales, wgmma operands) are
            # done before emit_pipeline refills it right after this body. It stands in for the four barriers Pallas
            # would put before the four refill copies (CompilerParams(unsafe_no_auto_barriers=True) below).
            return accumulation.step(acc, a_smem, b_smem, as_smem, bs_smem, ni * block_n, sim=sim,
                                     release=plgpu.commit_smem)

        rows, cols = pl.ds(ti * block_m, block_m), pl.ds(ni * block_n, block_n)

        def run(acc0):
            return plgpu.emit_pipeline(
                k_step,
                grid=(num_k,),
                in_specs=[
                    plgpu.BlockSpec((block_m, BLOCK_K), lambda k: (0, k), transforms=tiles),
                    plgpu.BlockSpec((block_n, BLOCK_K), lambda k: (0, k), transforms=tiles),
                    plgpu.BlockSpec((None, block_m), lambda k: (k, 0)),
                    plgpu.BlockSpec((None, SCALE_WINDOW), lambda k: (k, 0)),
                ],
                max_concurrent_steps=tiling.stages,
                init_carry=acc0,
            )(a_gmem.at[rows], b_gmem.at[gg, cols], as_gmem.at[:, rows],
              bs_gmem.at[gg, :, pl.ds(scale_window_start(ni * block_n), SCALE_WINDOW)])

        acc = accumulation.tile(run, (block_m, block_n), sim=sim)              # (bm, bn), or its column chunks
        store_acc(o_smem, acc)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)


def pipelined_pallas(tile_group, a, a_scale_t, b, b_scale_t, *, tiling: Tiling, out_dtype, interpret: bool,
                     accumulation: Accumulation = PROMOTED):
    """Pallas wrapper. tile_group [T] int32; a [T*bm, kp]; a_scale_t [kb, T*bm]; b [G, np, kp];
  b_scale_t [G, kb, nbw] (pallas.prepare_b) -> [T*bm, np] out_dtype (rows of skipped tiles unwritten). kp = kb*128,
  np % bn = 0."""
    (t,) = tile_group.shape
    rows, kp = a.shape
    _, n_pad, _ = b.shape
    kernel = plgpu.kernel(
        functools.partial(pipelined_kernel, tiling=tiling, num_k=kp // BLOCK_K,
                          sim=_mosaic.substitute_wgmma(interpret), accumulation=accumulation),
        out_type=jax.ShapeDtypeStruct((rows, n_pad), out_dtype),
        scratch_types=[epilogue_smem((tiling.block_m, tiling.block_n), out_dtype)],
        grid=(t, n_pad // tiling.block_n),
        grid_names=("m", "n"),
        # No automatic barriers: Pallas puts a warpgroup barrier before each of a k-step's four refill copies (A, B
        # and both scale windows: jax/_src/pallas/mosaic_gpu/primitives.py, copy_gmem_to_smem); the kernel places
        # the one it needs per k-step itself (k_step), and its epilogue's commit_smem orders the output tile's
        # writes before the TMA store. Safe by CompilerParams' two conditions: no thread reads and writes the same
        # SMEM, and no committed SMEM is read and then overwritten by an async copy.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             unsafe_no_auto_barriers=True),
        interpret=_mosaic.interpret_params() if interpret else False,
    )
    return kernel(tile_group, a, a_scale_t, b, b_scale_t)
