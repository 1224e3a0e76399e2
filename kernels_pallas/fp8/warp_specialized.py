"""Warp-specialized, persistent FP8 block-scaled GEMM (DeepGEMM's structure) as a Mosaic GPU (Hopper) kernel.

Same contract and operands as the pipelined kernel (pipelined.py; this one is ``kernel="warp_specialized"``): row
tiles of A tagged with a group (-1: skip), padded B [G, np, kp], transposed A scales [kb, rows], B block scales
transposed [G, kb, nbw] (pallas.py). Structure, after DeepGEMM's fp8_gemm.cuh and JAX's
Hopper matmul (jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py):

- three warpgroups per CTA (``num_threads=3``): one TMA producer and two consumers (DeepGEMM:
  ``get_num_math_warpgroups(128) = 2``, 128 TMA threads + 2 x 128 math threads). The producer streams the A, B, A-scale
  and B-scale tiles of each k-step of 128 into a ``stages``-deep SMEM ring (``plgpu.emit_pipeline_warp_specialized``).
  Register split 40 / 232 per thread (DeepGEMM ``kNumTMARegisters = 40``, ``kNumMathRegisters = 232``; the pipeline
  gives the consumers min(256, (512 - 40) / 2) rounded down to 8 = 232).
- each consumer owns one half (block_m / 2 rows) of the CTA tile and its own fp32 register accumulator, carried
  through the pipeline. Per k-step: read its A-row and the B-column scales, fp8 wgmma into a fresh accumulator
  (B K-major via ``ref.transpose``), wait, release the stage (manual consumed barriers, arrived right after the last
  SMEM read, as DeepGEMM's ``empty_barrier_arrive`` after ``warpgroup_wait<0>``), then promote
  ``acc += part * (As x Bs)`` in registers. While one consumer promotes, the other's wgmma keeps the tensor cores
  busy (DeepGEMM's overlap of promotion and MMA).
- persistent grid: one CTA per SM, ``plgpu.nd_loop`` deals output tiles round-robin (DeepGEMM's scheduler:
  ``block = iter * gridDim.x + blockIdx.x``), in ``plgpu.planar_snake`` order over bands of 16 column tiles
  (DeepGEMM ``kNumNBlocksPerGroup = 16``: for L2 reuse). The loop runs over the active row tiles only (listed
  first in ``tile_rows``, their count read in the kernel), so skipped tiles (-1) cost nothing and leave no SM idle,
  as DeepGEMM's masked scheduler, which never visits blocks past a group's masked_m.
- ``multicast=2`` (opt-in, DeepGEMM's TMA multicast for m >= 512): clusters of two CTAs take column tiles 2j and
  2j + 1 of the same row tile, and the A tile they share is loaded half by each and multicast to both (the A
  BlockSpec's ``collective_axes``; the pipeline's consumed barriers become cluster barriers), halving A's L2 traffic.
  GPU interpret mode has cluster barriers from jax 0.11.2 on (it copies the whole shared A tile into each CTA, which
  is what a multicast copy means); before, this path is checked by cross-lowering and natively only.
- epilogue: each consumer casts its half to out_dtype into its own SMEM slot and TMA-stores it; the store runs
  while the next tile's main loop does, and is awaited only before that slot is rewritten (the JAX matmul's
  ``wait_smem_to_gmem(0, wait_read_only=True)`` pattern).
- tiles chained (``tiling.chains_tiles``: the ring depth divides the k-steps, which the default ring depth
  seeks): each tile's pipeline runs with ``pipeline_state`` START (the CTA's first tile: fill the ring), STEADY,
  or STOP (its last: await the final releases), so the producer never drains the ring between tiles; it refills
  each slot for the next tile as soon as the consumers release it, while they finish this tile and store it (as
  DeepGEMM's TMA warp runs ahead across blocks). Otherwise every tile fills and drains the ring itself: the
  consumers wait a load's latency at each tile's start.

Lowering semantics: Lane, as the pipelined kernel (explicit WGMMA layouts for the scale vectors); the
warp-specialized pipeline, ``nd_loop`` with a data-dependent trip count and ``num_threads=3`` lower under it for
cuda on jax 0.10.2 (tests/kernels/fp8/test_fp8_gemm.py).

GPU interpret mode runs this kernel (three threads per CTA, barriers, TMA, the persistent loop over several tiles
per CTA), with the k-step as pallas_common.py describes for each jax release. The race detector
(``detect_races=True``) is no evidence for the SMEM-slot ordering: on 0.10.2 it reports nothing here, also when the
epilogue's ``wait_smem_to_gmem`` is removed; on 0.11.2 it reports races even in a trivial ``emit_pipeline`` kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kernels_pallas import _mosaic
from kernels_pallas.fp8.pallas_common import (PROMOTED, Accumulation, epilogue_smem, num_sms, operand_transforms,
                                              scale_window_start, store_acc)
from kernels_pallas.fp8.tiling import BLOCK_K, NUM_CONSUMERS, SCALE_WINDOW, Tiling, chains_tiles, check_knobs

TMA_REGISTERS = 40        # DeepGEMM kNumTMARegisters; JAX matmul memory_registers=40
TILE_BAND = 16            # DeepGEMM Scheduler kNumNBlocksPerGroup: column tiles per L2 band


def active_first(tile_group):
    """tile_group [T] -> (tile_rows [T]: row tiles, active ones first (stable); their groups [T]; active count [1])."""
    skip = tile_group < 0                                                                      # (T,)
    tile_rows = jnp.argsort(skip, stable=True).astype(jnp.int32)                               # (T,)
    num_active = (skip.size - jnp.sum(skip)).astype(jnp.int32)[None]                            # (1,)
    return tile_rows, tile_group[tile_rows], num_active


def ws_kernel(tile_rows_gmem, tile_group_gmem, num_active_gmem, a_gmem, as_gmem, b_gmem, bs_gmem, o_gmem, o_smem, *,
              tiling: Tiling, num_k: int, sim: bool, accumulation: Accumulation = PROMOTED):
    """Persistent loop over (active row tile, column tile); per tile a warp-specialized k pipeline.

  tile_rows_gmem [T] i32 (row tiles, the num_active_gmem[0] active ones first), tile_group_gmem [T] i32 (their
  groups), a_gmem [T*bm, kp] e4m3, as_gmem [kb, T*bm] f32, b_gmem [G, np, kp] e4m3, bs_gmem [G, kb, nbw] f32,
  o_gmem [T*bm, np]; o_smem (2, bm/2, bn) out_dtype: one epilogue slot per consumer. Skipped row tiles are never
  visited (DeepGEMM's masked scheduler likewise stops at the last valid block). accumulation: the per-tile hook
  (pallas_common.Accumulation; benchmarks substitute it)."""
    bm, bn = tiling.block_m, tiling.block_n
    half = bm // NUM_CONSUMERS
    num_active = num_active_gmem[0]
    n_tiles = o_gmem.shape[1] // bn
    pair = tiling.multicast == 2       # two CTAs (a cluster) take column tiles 2j, 2j + 1 of one row tile; A multicast
    wg = lax.axis_index("wg")
    tiles = operand_transforms()

    chained = chains_tiles(num_k, tiling.stages)

    def pipeline(body, context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(num_k,),
            memory_registers=TMA_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bm, BLOCK_K), lambda k: (0, k), transforms=tiles,     # A (bm, 128), shared by
                                collective_axes=("cluster",) if pair else ()),             # the pair: multicast
                plgpu.BlockSpec((bn, BLOCK_K), lambda k: (0, k), transforms=tiles),     # B (bn, 128), K-major
                plgpu.BlockSpec((1, bm), lambda k: (k, 0)),                             # A scales (1, bm)
                plgpu.BlockSpec((1, SCALE_WINDOW), lambda k: (k, 0)),                   # B block scales
            ],
            wg_axis="wg",
            num_compute_wgs=NUM_CONSUMERS,
            max_concurrent_steps=tiling.stages,
            manual_consumed_barriers=True,
            compute_context=context,
            pipeline_state=state,
        )

    # Scale blocks are (1, n) rather than squeezed (None, n): older warp-specialized pipelines allocate SMEM from
    # the raw block shape, so this form works across jax releases.
    def k_step(col0, _, a_smem, b_smem, as_smem, bs_smem, *barriers_and_acc):
        *consumed, acc = barriers_and_acc
        mine = pl.ds(wg * half, half)                     # this consumer's rows of the CTA tile

        def release():   # every SMEM read of this stage is done: hand it back to the producer
            for barrier in consumed:
                plgpu.barrier_arrive(barrier)

        return accumulation.step(acc, a_smem.at[mine], b_smem, as_smem.at[0, mine], bs_smem.at[0], col0, sim=sim,
                                 release=release)

    ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not change the allocations
    allocs = pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem.at[0], as_gmem,
                                                      bs_gmem.at[0, :, pl.ds(0, SCALE_WINDOW)])

    @functools.partial(pl.run_scoped, allocs=allocs, collective_axes="wg")
    def _scope(allocs):
        col_units = n_tiles // tiling.multicast   # column tiles, or pairs of them

        @plgpu.nd_loop((num_active * col_units,), collective_axes="sm")
        def _tile(info: plgpu.NDLoopInfo):
            slot, nj = plgpu.planar_snake(info.index[0], (num_active, col_units), 1, TILE_BAND // tiling.multicast)
            ni = nj * 2 + lax.axis_index("cluster") if pair else nj
            ti, g = tile_rows_gmem[slot], tile_group_gmem[slot]
            rows, cols = pl.ds(ti * bm, bm), pl.ds(ni * bn, bn)

            def context(run):
                acc = accumulation.tile(run, (half, bn), sim=sim)      # (half, bn), or its column chunks
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # this slot's previous store has read it
                store_acc(o_smem.at[wg], acc)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[pl.ds(ti * bm + wg * half, half), cols])

            state = None
            if chained:   # START fills the ring, STOP awaits its last releases (one tile: START, nothing to await)
                last = info.local_index == info.num_local_steps - 1
                state = jnp.where(info.local_index == 0, plgpu.PipelinePipeline.START,
                                  jnp.where(last, plgpu.PipelinePipeline.STOP, plgpu.PipelinePipeline.STEADY))
            window = pl.ds(scale_window_start(ni * bn), SCALE_WINDOW)
            pipeline(functools.partial(k_step, ni * bn), context, state)(
                a_gmem.at[rows], b_gmem.at[g, cols], as_gmem.at[:, rows], bs_gmem.at[g, :, window],
                allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # all stores issued by this warpgroup are out


def ws_pallas(tile_group, a, a_scale_t, b, b_scale_t, *, tiling: Tiling, out_dtype, interpret: bool,
              accumulation: Accumulation = PROMOTED):
    """Pallas wrapper, same operands as pipelined.pipelined_pallas: tile_group [T] int32; a [T*bm, kp];
  a_scale_t [kb, T*bm]; b [G, np, kp]; b_scale_t [G, kb, nbw] (block scales, ``pallas.prepare_b``) ->
  [T*bm, np] out_dtype (skipped rows unwritten)."""
    check_knobs(tiling, jnp.dtype(out_dtype).itemsize)
    (t,) = tile_group.shape
    rows, kp = a.shape
    _, n_pad, _ = b.shape
    tile_rows, groups, num_active = active_first(tile_group)
    n_tiles = n_pad // tiling.block_n
    if tiling.multicast == 2 and interpret and not _mosaic.interpreter_runs_native():
        raise ValueError(f"multicast=2 cannot run in GPU interpret mode on jax {jax.__version__} (its interpreter has "
                         f"no cluster barriers; 0.11.2's has); it is checked by cross-lowering and natively on a GPU")
    clusters = max(1, min(num_sms(interpret) // tiling.multicast, t * n_tiles // tiling.multicast))
    cluster = dict(cluster=(2,), cluster_names=("cluster",)) if tiling.multicast == 2 else {}
    kernel = plgpu.kernel(
        functools.partial(ws_kernel, tiling=tiling, num_k=kp // BLOCK_K, sim=_mosaic.substitute_wgmma(interpret),
                          accumulation=accumulation),
        out_type=jax.ShapeDtypeStruct((rows, n_pad), out_dtype),
        scratch_types=[epilogue_smem((NUM_CONSUMERS, tiling.block_m // NUM_CONSUMERS, tiling.block_n), out_dtype)],
        grid=(clusters,),
        grid_names=("sm",),
        **cluster,
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_mosaic.interpret_params() if interpret else False,
    )
    return kernel(tile_rows, groups, num_active, a, a_scale_t, b, b_scale_t)
