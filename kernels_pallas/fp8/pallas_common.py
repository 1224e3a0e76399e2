"""Pieces both FP8 GEMM kernels share (pipelined.py, warp_specialized.py): the operand tiles' SMEM layout, the scale
windows, the k-step product, DeepGEMM's promotion and the per-tile accumulation hook, the epilogue tile.

Per output tile and k-step of 128 (one A scale per row, one B scale per column): an fp8 wgmma into a fresh fp32
accumulator, then promotion into the main fp32 accumulator with the outer product of the A-row and B-column scales
(DeepGEMM's two-level accumulation: the tensor cores' fp8 accumulation only ever sums 128 products). A tile inside one
128-block of n reads its single B scale as one scalar; a tile that spans two (block_n 96, 160) is promoted 32 columns
at a time, each chunk with its block's scale (``load_scales``, ``promote``).

GPU interpret mode runs the native code path itself from jax 0.11.2 on (the wgmma on the K-major B ref,
``plgpu.load`` with a layout; layouts are no-ops there). Before 0.11.2 (``_mosaic.substitute_wgmma``: ``sim`` below)
it cannot run either: the k-step product is then a value-level ``dot_general`` of the same two SMEM tiles and the
scale vectors are plain reads.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kernels_pallas import _mosaic
from kernels_pallas.fp8.tiling import BLOCK_K, SCALE_WINDOW_ALIGN

STRADDLE_CHUNK = 32       # promotion of a tile spanning two scale blocks: 32 columns at a time (block_n % 32 == 0)
INTERPRET_SMS = 2         # interpret mode: few CTAs, so each runs several tiles (the persistent path)
SWIZZLE = 128             # 128 fp8 = 128 bytes per k-row of an operand tile


def num_sms(interpret: bool) -> int:
    """CTAs of the persistent grid: the GPU's SM count (JAX matmul ``get_num_sms``), 132 when lowering elsewhere."""
    return INTERPRET_SMS if interpret else _mosaic.device_sm_count()


def operand_transforms():
    """SMEM transforms of the A and B operand tiles ((rows, 128) e4m3): (8, 128) tiles, the 128-byte swizzle."""
    return plgpu.TilingTransform((8, SWIZZLE)), plgpu.SwizzleTransform(SWIZZLE)


def epilogue_smem(shape: tuple[int, ...], out_dtype):
    """SMEM for output tiles [..., rows, block_n], swizzled (the JAX Hopper matmul's epilogue): the WGMMA-layout
  registers then store without the bank conflicts of 2 * block_n-byte rows, and the TMA store unswizzles."""
    bits = shape[-1] * jnp.dtype(out_dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(bits, "the epilogue tile")
    elems = swizzle * 8 // (jnp.dtype(out_dtype).itemsize * 8)
    return plgpu.SMEM(shape, out_dtype, transforms=(plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)))


# B's 128x128 block scales reach a kernel as [G, kb, nbw] (``pallas.prepare_b``: the contract's [G, nb, kb],
# transposed and zero-padded; no per-column expansion). Per k-step a tile copies a window of SCALE_WINDOW of them
# (tiling.py), starting at a multiple of SCALE_WINDOW_ALIGN at or below its first block j0 = col0 // 128, so the
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
  block_n), as DeepGEMM picks scale_b per column group by a predicate: a per-element select over the whole tile
  (a (rows, bn) scale array) makes the k-loops spill. The chunks stay separate arrays, as Mosaic GPU's Lane lowering
  has no concatenate on jax 0.10."""
    if not isinstance(sb, tuple):
        return acc + part * lax.broadcast_in_dim(sa * sb, part.shape, [0])                     # row scale
    s0, s1, split = sb
    w = STRADDLE_CHUNK
    return tuple(chunk + part[:, i * w:(i + 1) * w]
                 * lax.broadcast_in_dim(sa * jnp.where(i * w < split, s0, s1), chunk.shape, [0])  # (rows, 32)
                 for i, chunk in enumerate(acc))


def mma(a_smem, b_smem, *, sim: bool):
    """A B^T of one stage's tiles, a_smem (rows, 128) and b_smem (bn, 128) e4m3 (K-major B), as a fresh (rows, bn)
  f32 value: a wgmma into its own accumulator, awaited (where ``sim``: a dot_general of the same tiles)."""
    if sim:
        return lax.dot_general(a_smem[...], b_smem[...], (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)                                # (rows, bn)

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))                             # fp8, K-major B
        return acc_ref[...]                                                                     # waits for it

    return pl.run_scoped(run, plgpu.ACC((a_smem.shape[0], b_smem.shape[0]), jnp.float32))


class Accumulation(NamedTuple):
    """How a consumer warpgroup turns an output tile's k-steps into its result, as static callables: the kernels take
  it as ``accumulation=`` (``PROMOTED``, theirs), so a benchmark can change it without a branch in them
  (benchmarks/kernels_fp8.py's probes).

  tile(run, shape, *, sim) -> the tile (rows, bn) in ``zero_acc``'s form: runs the tile's k pipeline,
  ``run(initial carry) -> final carry``. step(acc, a_smem, b_smem, a_scales, b_scales, col0, *, sim, release) ->
  acc: one k-step on the stage's tiles a_smem (rows, 128) and b_smem (bn, 128), its A-row scales a_scales (rows,)
  and B's scale window b_scales (SCALE_WINDOW,), for tile columns col0 .. col0 + bn - 1; release() hands the stage
  back once every SMEM read of it is done."""

    tile: Callable
    step: Callable


def _promoted_tile(run, shape, *, sim):
    return run(zero_acc(shape, sim=sim, chunked=straddles(shape[1])))


def _promoted_step(acc, a_smem, b_smem, a_scales, b_scales, col0, *, sim, release):
    # scales first, so their SMEM latency hides under the wgmma (DeepGEMM reads them before it)
    sa, sb = load_scales(a_scales, b_scales, col0, b_smem.shape[0], sim=sim)               # (rows,), scalar(s)
    part = mma(a_smem, b_smem, sim=sim)                                                     # (rows, bn)
    release()
    return promote(acc, part, sa, sb)


# DeepGEMM's two-level accumulation: per k-step a fresh wgmma product, promoted with the scales into the tile's
# register accumulator.
PROMOTED = Accumulation(tile=_promoted_tile, step=_promoted_step)
