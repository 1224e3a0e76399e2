"""The Pallas path of the FP8 GEMMs: operand preparation shared by the dense and grouped entries, the tiling's
defaults, the dispatch to the kernel variant, and the dense GEMM (the grouped ones: grouped.py).

Every kernel multiplies row tiles of A, each tagged with the group whose weights it uses (-1: skip the tile, its
output rows are left unwritten); the dense GEMM is the one-group case. B's block scales stay blocks: ``prepare_b``
only transposes and pads them ([G, kb, nbw], about 1/16384 byte per weight), and each k-step copies a window of
them (tiling.py ``SCALE_WINDOW``). Kernel variants (``Tiling.kernel``):
- "pipelined" (default): pipelined.py, one warpgroup per CTA, grid (row tiles, column tiles);
- "warp_specialized": warp_specialized.py, DeepGEMM's structure (a TMA producer warpgroup and two consumer
  warpgroups, persistent grid of one CTA per SM, epilogue stores overlapped with the next tile). Same operands, tile
  -> group table and skipped tiles; the default stays the variant measured on a GPU (docs/benchmarks.md "Kernels
  on GPU (H200)").
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.common import cdiv, round_up
from kernels_pallas.fp8.pallas_common import PROMOTED, Accumulation, num_sms, scale_window_start
from kernels_pallas.fp8.pipelined import pipelined_pallas
from kernels_pallas.fp8.tiling import BLOCK_K, SCALE_WINDOW, Tiling, resolve
from kernels_pallas.fp8.warp_specialized import ws_pallas


def resolve_tiling(kernel: str, block_m, block_n, block_k: int, stages, *, rows: int, n: int, k: int, out_dtype,
                   interpret: bool, multicast: int = 1) -> Tiling:
    """The static knobs of a Pallas entry, None filled by tiling.py's DeepGEMM-style defaults and all checked
  (ValueError naming the knob). rows: rows whose tiles may run (dense m, contiguous m, masked G * m_max)."""
    return resolve(kernel, block_m, block_n, block_k, stages, rows=rows, n=n, num_sms=num_sms(interpret),
                   out_itemsize=jnp.dtype(out_dtype).itemsize, multicast=multicast, k_steps=cdiv(k, BLOCK_K))


def run_tiles(tile_group, a, a_scale_t, b, b_scale_t, *, tiling: Tiling, out_dtype, interpret: bool,
              accumulation: Accumulation = PROMOTED):
    """Run the ``tiling.kernel`` variant (same operands, same result): tile_group [T] int32, a [T*bm, kp], a_scale_t
  [kb, T*bm], b [G, np, kp], b_scale_t [G, kb, nbw] -> [T*bm, np] out_dtype. accumulation: the kernels' per-tile
  hook (pallas_common.Accumulation)."""
    run = ws_pallas if tiling.kernel == "warp_specialized" else pipelined_pallas
    return run(tile_group, a, a_scale_t, b, b_scale_t, tiling=tiling, out_dtype=out_dtype, interpret=interpret,
               accumulation=accumulation)


def prepare_b(b, b_scale, block_n):
    """b [G, n, k], b_scale [G, nb, kb] -> padded b [G, np, kp] and the block scales transposed [G, kb, nbw],
  zero-padded so that every tile's window (tiling.py ``SCALE_WINDOW``) lies inside."""
    _, n, k = b.shape
    kb, nb = cdiv(k, BLOCK_K), b_scale.shape[1]
    n_pad = round_up(n, block_n)
    b_p = jnp.pad(b, ((0, 0), (0, n_pad - n), (0, kb * BLOCK_K - k)))                          # (G, np, kp)
    nbw = scale_window_start(n_pad - 1) + SCALE_WINDOW                   # the last tile's window end (>= nb)
    bs_t = jnp.pad(b_scale, ((0, 0), (0, nbw - nb), (0, 0))).swapaxes(1, 2)                     # (G, kb, nbw)
    return b_p, bs_t


def prepare_a(a, a_scale, rows):
    """a [m, k], a_scale [m, kb] -> a [rows, kp] zero-padded, transposed scales [kb, rows]."""
    m, k = a.shape
    kb = cdiv(k, BLOCK_K)
    a_p = jnp.pad(a, ((0, rows - m), (0, kb * BLOCK_K - k)))                                    # (rows, kp)
    return a_p, jnp.pad(a_scale, ((0, rows - m), (0, 0))).T                                     # (kb, rows)


def dense_pallas(a, a_scale, b, b_scale, *, tiling: Tiling, out_dtype, interpret: bool,
                 accumulation: Accumulation = PROMOTED):
    """fp8_gemm's Pallas path for a resolved tiling (checked operands): pad, run the kernel, crop -> [m, n].
  accumulation: the kernels' per-tile hook (benchmarks/kernels_fp8.py's probes substitute it)."""
    m, n = a.shape[0], b.shape[0]
    rows = round_up(m, tiling.block_m)
    a_p, as_t = prepare_a(a, a_scale, rows)
    b_p, bs_t = prepare_b(b[None], b_scale[None], tiling.block_n)
    tile_group = jnp.zeros((rows // tiling.block_m,), jnp.int32)
    out = run_tiles(tile_group, a_p, as_t, b_p, bs_t, tiling=tiling, out_dtype=out_dtype, interpret=interpret,
                    accumulation=accumulation)                                                     # (rows, np)
    return out[:m, :n]
