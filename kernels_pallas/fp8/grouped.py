"""The Pallas paths of the MoE-grouped FP8 GEMMs (DeepGEMM's two grouped layouts; docs/architecture.md "DeepGEMM FP8
contract"): the row plans around the kernels.

- contiguous (prefill): a [m, k] rows of all groups, group_ids [m] (-1 = padding row, anywhere), b [G, n, k]
  -> [m, n]; row r uses b[group_ids[r]]; padding rows (and ids outside [0, G)) give zeros. DeepGEMM requires
  each group's segment to be aligned to its M tile; here segments may have any length and order.
- masked (decode): a [G, m_max, k], masked_m [G] -> [G, m_max, n]; rows at or past masked_m[g] are zero.

Both run the kernels (pallas.py: one group per row tile, -1 = skip; either variant), with different row plans:
- contiguous: the wrapper gathers rows into tile-aligned segments (stable sort by group, each group padded to a
  multiple of block_m) and gathers the results back. Chosen over per-tile group boundaries inside the kernel
  because every tile then is a plain dense tile with one weight matrix (no row masks, no second pass over B for
  tiles that straddle groups), -1 rows anywhere and unaligned segments come for free, and the gathers move
  m*(k + 2n) bytes, small next to the GEMM's m*n*k flops. Tile count is static: the worst case over group
  sizes, cdiv(m + min(G, m) * (block_m - 1), block_m); unused tiles are skipped by the kernel.
- masked: grid over (G * m tiles, n tiles); tiles that start at or past masked_m[g] are skipped; rows past
  masked_m inside the last tile (and the skipped tiles, which are not written) are zeroed by one select after
  the kernel.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.common import cdiv, round_up
from kernels_pallas.fp8.common import row_mask, sort_by_group
from kernels_pallas.fp8.pallas import prepare_a, prepare_b, run_tiles
from kernels_pallas.fp8.tiling import Tiling


def contiguous_plan(group_ids, num_groups: int, block_m: int):
    """group_ids [m] -> (src [T*bm] row of a per tiled row (m = none), dest [m] tiled row per row, tile_group [T]).

  Rows are stably sorted by group, each group padded to a multiple of block_m; T is static (worst case)."""
    (m,) = group_ids.shape
    g = num_groups
    num_tiles = cdiv(m + min(g, m) * (block_m - 1), block_m)
    valid, key, order, sizes = sort_by_group(group_ids, g)                                    # key G = padding
    padded = round_up(sizes, block_m)                                                          # (G,)
    start, pstart = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded                     # (G,)
    skey = key[order]                                                                          # (m,) sorted keys
    gk = jnp.minimum(skey, g - 1)
    dest_sorted = jnp.where(skey < g, jnp.arange(m) - start[gk] + pstart[gk], num_tiles * block_m)
    dest = jnp.zeros((m,), jnp.int32).at[order].set(dest_sorted.astype(jnp.int32))            # (m,)
    src = jnp.full((num_tiles * block_m,), m, jnp.int32).at[dest].set(jnp.arange(m, dtype=jnp.int32), mode="drop")
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    tile_group = jnp.searchsorted(jnp.cumsum(padded), tile_start, side="right")                # (T,)
    tile_group = jnp.where(tile_group < g, tile_group, -1).astype(jnp.int32)
    return src, dest, valid, tile_group


def contiguous_pallas(a, a_scale, b, b_scale, group_ids, *, out_dtype, tiling: Tiling, interpret: bool):
    """fp8_grouped_gemm_contiguous's Pallas path (checked operands): gather rows into tile-aligned segments, run the
  kernel, gather the results back -> [m, n], rows whose id is outside [0, G) zero."""
    m, k = a.shape
    _, n, _ = b.shape
    src, dest, valid, tile_group = contiguous_plan(group_ids, b.shape[0], tiling.block_m)
    rows = src.shape[0]
    a_g = jnp.concatenate([a, jnp.zeros((1, k), a.dtype)])[src]                                # (T*bm, k)
    as_g = jnp.concatenate([a_scale, jnp.zeros((1, a_scale.shape[1]), a_scale.dtype)])[src]  # (T*bm, kb)
    a_p, as_t = prepare_a(a_g, as_g, rows)
    b_p, bs_t = prepare_b(b, b_scale, tiling.block_n)
    out = run_tiles(tile_group, a_p, as_t, b_p, bs_t, tiling=tiling, out_dtype=out_dtype,
                    interpret=interpret)                                                       # (T*bm, np)
    out = jnp.take(out[:, :n], jnp.minimum(dest, rows - 1), axis=0)                            # (m, n)
    return jnp.where(valid[:, None], out, jnp.zeros((), out_dtype))


def masked_pallas(a, a_scale, b, b_scale, masked_m, *, out_dtype, tiling: Tiling, interpret: bool):
    """fp8_grouped_gemm_masked's Pallas path (checked operands) -> [G, m_max, n], rows past masked_m zero."""
    g, m_max, k = a.shape
    _, n, _ = b.shape
    block_m = tiling.block_m
    mp = round_up(m_max, block_m)
    per_g = mp // block_m
    a_p = jnp.pad(a, ((0, 0), (0, mp - m_max), (0, 0))).reshape(g * mp, k)                    # (G*mp, k)
    as_p = jnp.pad(a_scale, ((0, 0), (0, mp - m_max), (0, 0))).reshape(g * mp, -1)           # (G*mp, kb)
    a_p, as_t = prepare_a(a_p, as_p, g * mp)
    b_p, bs_t = prepare_b(b, b_scale, tiling.block_n)
    t = jnp.arange(g * per_g, dtype=jnp.int32)
    tile_group = jnp.where((t % per_g) * block_m < masked_m[t // per_g], t // per_g, -1).astype(jnp.int32)
    out = run_tiles(tile_group, a_p, as_t, b_p, bs_t, tiling=tiling, out_dtype=out_dtype,
                    interpret=interpret)                                                       # (G*mp, np)
    out = out.reshape(g, mp, -1)[:, :m_max, :n]                                                # (G, m_max, n)
    return jnp.where(row_mask(masked_m, m_max)[..., None], out, jnp.zeros((), out_dtype))
