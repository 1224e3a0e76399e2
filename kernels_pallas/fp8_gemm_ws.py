"""Warp-specialized, persistent FP8 block-scaled GEMM (DeepGEMM's structure) as a Mosaic GPU (Hopper) kernel.

Same contract and operand preparation as the pipelined kernel of fp8_gemm.py (which selects this one with
``kernel="warp_specialized"``): row tiles of A tagged with a group (-1: skip), padded B [G, np, kp], transposed A
scales [kb, rows], B block scales transposed [G, kb, nbw]. Structure, after DeepGEMM's fp8_gemm.cuh and JAX's
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
- tiles chained (``fp8_tiling.chains_tiles``: the ring depth divides the k-steps, which the default ring depth
  seeks): each tile's pipeline runs with ``pipeline_state`` START (the CTA's first tile: fill the ring), STEADY,
  or STOP (its last: await the final releases), so the producer never drains the ring between tiles; it refills
  each slot for the next tile as soon as the consumers release it, while they finish this tile and store it (as
  DeepGEMM's TMA warp runs ahead across blocks). Otherwise every tile fills and drains the ring itself: the
  consumers wait a load's latency at each tile's start.

Lowering semantics: Lane, as the pipelined kernel (explicit WGMMA layouts for the scale vectors); the
warp-specialized pipeline, ``nd_loop`` with a data-dependent trip count and ``num_threads=3`` lower under it for
cuda on jax 0.10.2 (tests/test_fp8_gemm.py). Not yet compiled or run on a GPU.

GPU interpret mode runs this kernel (three threads per CTA, barriers, TMA, the persistent loop over several tiles
per CTA); from jax 0.11.2 on the native code path itself, wgmma on the K-major B and ``plgpu.load`` of the scales
included. Before 0.11.2 (``_mosaic.substitute_wgmma``), as in fp8_gemm.py, the k-step product is a value-level
``dot_general`` of the same SMEM tiles and the scale vectors are plain reads. The race detector
(``detect_races=True``) is no evidence for the SMEM-slot ordering: on 0.10.2 it reports nothing here, also when the
epilogue's ``wait_smem_to_gmem`` is removed; on 0.11.2 it reports races even in a trivial ``emit_pipeline`` kernel
(docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kernels_pallas import _mosaic
from kernels_pallas.fp8_tiling import (BLOCK_K, NUM_CONSUMERS, SCALE_WINDOW, SCALE_WINDOW_ALIGN, Tiling, chains_tiles,
                                       check_knobs)

TMA_REGISTERS = 40        # DeepGEMM kNumTMARegisters; JAX matmul memory_registers=40
STRADDLE_CHUNK = 32       # promotion of a tile spanning two scale blocks: 32 columns at a time (block_n % 32 == 0)
TILE_BAND = 16            # DeepGEMM Scheduler kNumNBlocksPerGroup: column tiles per L2 band
INTERPRET_SMS = 2         # interpret mode: few CTAs, so each runs several tiles (the persistent path)


def num_sms(interpret: bool) -> int:
    """CTAs of the persistent grid: the GPU's SM count (JAX matmul ``get_num_sms``), 132 when lowering elsewhere."""
    return INTERPRET_SMS if interpret else _mosaic.device_sm_count()


def epilogue_smem(shape: tuple[int, ...], out_dtype):
    """SMEM for output tiles [..., rows, block_n], swizzled (the JAX Hopper matmul's epilogue): the WGMMA-layout
  registers then store without the bank conflicts of 2 * block_n-byte rows, and the TMA store unswizzles."""
    bits = shape[-1] * jnp.dtype(out_dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(bits, "the epilogue tile")
    elems = swizzle * 8 // (jnp.dtype(out_dtype).itemsize * 8)
    return plgpu.SMEM(shape, out_dtype, transforms=(plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)))


# B's 128x128 block scales reach a kernel as [G, kb, nbw] (``fp8_gemm.prepare_b``: the contract's [G, nb, kb],
# transposed and zero-padded; no per-column expansion). Per k-step a tile copies a window of SCALE_WINDOW of them
# (fp8_tiling.py), starting at a multiple of SCALE_WINDOW_ALIGN at or below its first block j0 = col0 // 128, so the
# window holds j0 and j0 + 1, the most a tile spans (block_n <= 256, a multiple of 32 other than 224, which the
# register rule excludes: (col0 % 128) + block_n <= 256).


def scale_window_start(col0):
    """First block scale of the window that tile columns [col0, col0 + block_n) copy (traced or static)."""
    return col0 // BLOCK_K // SCALE_WINDOW_ALIGN * SCALE_WINDOW_ALIGN


def load_scales(as_ref, win_ref, col0, block_n: int, *, sim: bool):
    """A-row scales as_ref [rows] -> (rows,) in the WGMMA row layout; B's window win_ref [SCALE_WINDOW] -> one scalar
  when the tile lies in one 128-column scale block (block_n divides 128; tiles start at multiples of block_n), so
  ``promote`` is one FMA per element (DeepGEMM multiplies scale_a by one scale_b), else (s0, s1, split): columns
  before ``split`` (tile-relative) take block j0's scale, the rest block j0 + 1's."""
    sa = as_ref[...] if sim else _mosaic.load(as_ref, plgpu.Layout.WGMMA.reduce(1))
    j0 = col0 // BLOCK_K
    i = j0 % SCALE_WINDOW_ALIGN                        # j0's place in the window
    if not straddles(block_n):
        return sa, win_ref[i]
    return sa, (win_ref[i], win_ref[i + 1], (j0 + 1) * BLOCK_K - col0)


def straddles(block_n: int) -> bool:
    """Whether a tile of block_n columns (tiles start at multiples of block_n) can span two 128-column scale
  blocks: block_n does not divide 128 (96, 160)."""
    return BLOCK_K % block_n != 0


def zero_acc(shape, *, sim: bool, chunked: bool):
    """A zero (rows, bn) f32 accumulator: one array in the WGMMA layout, or (chunked: the promoted accumulator of a
  tile that straddles scale blocks) a tuple of its bn / STRADDLE_CHUNK column chunks (``promote``)."""
    rows, bn = shape

    def zeros(cols):
        z = jnp.zeros((rows, cols), jnp.float32)
        return z if sim else plgpu.layout_cast(z, plgpu.Layout.WGMMA)

    if chunked:
        return tuple(zeros(STRADDLE_CHUNK) for _ in range(bn // STRADDLE_CHUNK))
    return zeros(bn)


def store_acc(o_ref, acc) -> None:
    """o_ref (rows, bn) <- acc (``zero_acc``'s form) cast to o_ref's dtype."""
    if not isinstance(acc, tuple):
        o_ref[...] = acc.astype(o_ref.dtype)
        return
    for i, chunk in enumerate(acc):
        o_ref[:, pl.ds(i * STRADDLE_CHUNK, STRADDLE_CHUNK)] = chunk.astype(o_ref.dtype)


def promote(acc, part, sa, sb):
    """acc + part * (As x Bs) (DeepGEMM's promotion): part (rows, bn) f32, acc in ``zero_acc``'s form; sa (rows,);
  sb one scalar or (s0, s1, split) from ``load_scales``. A straddling tile is promoted STRADDLE_CHUNK columns at a
  time, each chunk with the one B scale of its block (split is a multiple of 32: tiles start at multiples of
  block_n), as DeepGEMM picks scale_b per column group by a predicate. A per-element select over the whole tile
  (a (rows, bn) scale array) made the k-loops spill: 41 reloads per k-step at 128 x 160 (warp-specialized, ptxas
  13.0, 2026-12-02), none chunked; the chunks stay separate arrays, as Mosaic GPU's Lane lowering has no
  concatenate on jax 0.10."""
    if not isinstance(sb, tuple):
        return acc + part * lax.broadcast_in_dim(sa * sb, part.shape, [0])                     # row scale
    s0, s1, split = sb
    w = STRADDLE_CHUNK
    return tuple(chunk + part[:, i * w:(i + 1) * w]
                 * lax.broadcast_in_dim(sa * jnp.where(i * w < split, s0, s1), chunk.shape, [0])  # (rows, 32)
                 for i, chunk in enumerate(acc))


# Benchmark probes (benchmarks/kernels_fp8.py --breakdown; never used by the entries): both FP8 kernels with part of
# their work taken out, so that a GPU run can tell what bounds a kernel without a profiler's counters (which gVisor
# does not give: kernels_mla.py's probes do the same for MLA decode).
# - "mma": DeepGEMM's promotion taken out. The wgmma accumulates the unscaled product into one accumulator over all
#   k-steps (D = A @ B^T, no scales read, no per-step wait for a fresh accumulator or register FMA): the kernel as
#   a plain FP8 GEMM with the same producer, ring and tiles. Kernel near it: the promotion is hidden.
# - "stream": every k-step's compute taken out. The consumers release each stage as soon as it lands (D = 0): the
#   producer and the ring alone, i.e. how fast TMA fills SMEM with this tiling. mma near it: the feed bounds it.
PROBES = ("mma", "stream")


def check_probe(probe) -> None:
    if probe is not None and probe not in PROBES:
        raise ValueError(f"probe must be None or one of {PROBES}, got {probe!r}")


def probe_step(acc, a_smem, b_smem, *, probe: str, sim: bool):
    """One k-step of a probe (``PROBES``): "mma" accumulates A B^T of the stage's tiles (a_smem (rows, 128),
  b_smem (bn, 128) K-major) into acc, the wgmma's ACC ref (a (rows, bn) f32 value where ``sim``) and waits for
  it; "stream" does nothing. Returns acc."""
    if probe == "mma":
        if sim:
            return acc + lax.dot_general(a_smem[...], b_smem[...], (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)                   # (rows, bn)
        plgpu.wgmma(acc, a_smem, b_smem.transpose((1, 0)))
        plgpu.wgmma_wait(0)
    return acc


def run_tile(run, shape, *, probe: str | None, sim: bool):
    """Run one output tile's k pipeline, ``run(initial carry) -> final carry``, from a zero f32 accumulator of
  shape: a WGMMA-layout value carried through the k-steps (the kernels' promotion), or for the "mma" probe an ACC
  ref the wgmma accumulates into (as a plain GEMM's). Returns the tile in ``zero_acc``'s form (probes: whole)."""
    if probe == "mma" and not sim:
        return pl.run_scoped(lambda acc_ref: run(acc_ref)[...], plgpu.ACC(shape, jnp.float32))
    return run(zero_acc(shape, sim=sim, chunked=probe is None and straddles(shape[1])))   # probes never promote


def active_first(tile_group):
    """tile_group [T] -> (tile_rows [T]: row tiles, active ones first (stable); their groups [T]; active count [1])."""
    skip = tile_group < 0                                                                      # (T,)
    tile_rows = jnp.argsort(skip, stable=True).astype(jnp.int32)                               # (T,)
    num_active = (skip.size - jnp.sum(skip)).astype(jnp.int32)[None]                            # (1,)
    return tile_rows, tile_group[tile_rows], num_active


# ----------------------------------------------------------------------------------------------- kernel
def _ws_kernel(tile_rows_gmem, tile_group_gmem, num_active_gmem, a_gmem, as_gmem, b_gmem, bs_gmem, o_gmem, o_smem,
               *, cfg: Tiling, num_k: int, sim: bool, probe: str | None = None):
    """Persistent loop over (active row tile, column tile); per tile a warp-specialized k pipeline.

  tile_rows_gmem [T] i32 (row tiles, the num_active_gmem[0] active ones first), tile_group_gmem [T] i32 (their
  groups), a_gmem [T*bm, kp] e4m3, as_gmem [kb, T*bm] f32, b_gmem [G, np, kp] e4m3, bs_gmem [G, kb, nbw] f32,
  o_gmem [T*bm, np]; o_smem (2, bm/2, bn) out_dtype: one epilogue slot per consumer. Skipped row tiles are never
  visited (DeepGEMM's masked scheduler likewise stops at the last valid block). probe: ``PROBES``."""
    bm, bn = cfg.block_m, cfg.block_n
    half = bm // NUM_CONSUMERS
    num_active = num_active_gmem[0]
    n_tiles = o_gmem.shape[1] // bn
    pair = cfg.multicast == 2       # two CTAs (a cluster) take column tiles 2j, 2j + 1 of one row tile; A multicast
    wg = lax.axis_index("wg")
    swizzle = 128  # 128 fp8 = 128 bytes per k-row of a tile
    tiles = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))

    chained = chains_tiles(num_k, cfg.stages)

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
            max_concurrent_steps=cfg.stages,
            manual_consumed_barriers=True,
            compute_context=context,
            pipeline_state=state,
        )

    # Scale blocks are (1, n) rather than squeezed (None, n): older warp-specialized pipelines allocate SMEM from
    # the raw block shape, so this form works across jax releases.
    def k_step(col0, _, a_smem, b_smem, as_smem, bs_smem, *barriers_and_acc):
        *consumed, acc = barriers_and_acc
        mine = pl.ds(wg * half, half)                     # this consumer's rows of the CTA tile
        if probe is not None:
            acc = probe_step(acc, a_smem.at[mine], b_smem, probe=probe, sim=sim)
            for barrier in consumed:
                plgpu.barrier_arrive(barrier)
            return acc
        # scales first, so their SMEM latency hides under the wgmma (DeepGEMM reads them before it)
        sa, sb = load_scales(as_smem.at[0, mine], bs_smem.at[0], col0, bn, sim=sim)             # (half,), scalar(s)
        if sim:   # interpret mode: same tiles, value-level product (module docstring)
            part = lax.dot_general(a_smem.at[mine][...], b_smem[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)                          # (half, bn)
        else:
            def mma(acc_ref):
                plgpu.wgmma(acc_ref, a_smem.at[mine], b_smem.transpose((1, 0)))       # fp8, K-major B
                return acc_ref[...]                                                             # waits for it
            part = pl.run_scoped(mma, plgpu.ACC((half, bn), jnp.float32))                      # (half, bn)
        for barrier in consumed:   # every SMEM read of this stage is done: hand it back to the producer
            plgpu.barrier_arrive(barrier)
        return promote(acc, part, sa, sb)

    ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not change the allocations
    allocs = pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem.at[0], as_gmem,
                                                      bs_gmem.at[0, :, pl.ds(0, SCALE_WINDOW)])

    @functools.partial(pl.run_scoped, allocs=allocs, collective_axes="wg")
    def _scope(allocs):
        col_units = n_tiles // cfg.multicast   # column tiles, or pairs of them

        @plgpu.nd_loop((num_active * col_units,), collective_axes="sm")
        def _tile(info: plgpu.NDLoopInfo):
            slot, nj = plgpu.planar_snake(info.index[0], (num_active, col_units), 1, TILE_BAND // cfg.multicast)
            ni = nj * 2 + lax.axis_index("cluster") if pair else nj
            ti, g = tile_rows_gmem[slot], tile_group_gmem[slot]
            rows, cols = pl.ds(ti * bm, bm), pl.ds(ni * bn, bn)

            def context(run):
                acc = run_tile(run, (half, bn), probe=probe, sim=sim)      # (half, bn), or its column chunks
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


def ws_fp8_gemm_pallas(tile_group, a, a_scale_t, b, b_scale_t, *, cfg: Tiling, out_dtype, interpret: bool,
                       probe: str | None = None):
    """Pallas wrapper, same operands as fp8_gemm.tiled_fp8_gemm_pallas: tile_group [T] int32; a [T*bm, kp];
  a_scale_t [kb, T*bm]; b [G, np, kp]; b_scale_t [G, kb, nbw] (block scales, ``fp8_gemm.prepare_b``) ->
  [T*bm, np] out_dtype (skipped rows unwritten). probe: ``PROBES`` (None: the kernel)."""
    check_knobs("warp_specialized", cfg, jnp.dtype(out_dtype).itemsize)
    check_probe(probe)
    (t,) = tile_group.shape
    rows, kp = a.shape
    _, n_pad, _ = b.shape
    tile_rows, groups, num_active = active_first(tile_group)
    n_tiles = n_pad // cfg.block_n
    if cfg.multicast == 2 and interpret and not _mosaic.interpreter_runs_native():
        raise ValueError(f"multicast=2 cannot run in GPU interpret mode on jax {jax.__version__} (its interpreter has "
                         f"no cluster barriers; 0.11.2's has); it is checked by cross-lowering and natively on a GPU")
    clusters = max(1, min(num_sms(interpret) // cfg.multicast, t * n_tiles // cfg.multicast))
    cluster = dict(cluster=(2,), cluster_names=("cluster",)) if cfg.multicast == 2 else {}
    kernel = plgpu.kernel(
        functools.partial(_ws_kernel, cfg=cfg, num_k=kp // BLOCK_K, sim=_mosaic.substitute_wgmma(interpret),
                          probe=probe),
        out_type=jax.ShapeDtypeStruct((rows, n_pad), out_dtype),
        scratch_types=[epilogue_smem((NUM_CONSUMERS, cfg.block_m // NUM_CONSUMERS, cfg.block_n), out_dtype)],
        grid=(clusters,),
        grid_names=("sm",),
        **cluster,
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_mosaic.interpret_params() if interpret else False,
    )
    return kernel(tile_rows, groups, num_active, a, a_scale_t, b, b_scale_t)
