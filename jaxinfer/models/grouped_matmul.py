"""The row-tile layout of grouped matmuls for routed experts: rows sorted by group (expert), each group's rows
padded to whole tiles of ``tile_m`` rows, every tile belonging to one group.

This is what grouped-GEMM kernels compute over (MegaBlocks; DeepGEMM's contiguous layout aligns each group to its
M tile the same way): work is (rows + groups * (tile_m - 1)) rows instead of rows * groups. ``jax.lax.ragged_dot``
has the semantics of a grouped matmul, but XLA:CPU computes it as if every row met every group
(docs/architecture.md "Platform facts": "costs about as much as computing every expert"). moe.py's "grouped" path
runs the tiles of this plan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Where each sorted row goes in the padded, tiled layout. Built once, shared by the three projections."""

    dest: jax.Array  # [M] int32: padded row of each sorted row (rows past sum(group_sizes): out of bounds)
    tile_group: jax.Array  # [num_tiles] int32: the group of each tile (tiles past the used ones: the last group)
    tile_m: int = dataclasses.field(metadata=dict(static=True))
    num_tiles: int = dataclasses.field(metadata=dict(static=True))


def default_tile_m(rows: int, groups: int) -> int:
    """A power of two near the mean group size, in [8, 128]: small for decode batches, full tiles for prefill."""
    mean = max(rows // max(groups, 1), 1)
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def tile_plan(group_sizes: jax.Array, rows: int, tile_m: int | None = None) -> TilePlan:
    """group_sizes [G] int32 (sum <= rows) -> the tiling of ``rows`` sorted rows: group g's rows take the tiles
    after those of groups < g, in order; num_tiles is the worst case over all group sizes."""
    groups = group_sizes.shape[0]
    tile_m = default_tile_m(rows, groups) if tile_m is None else tile_m
    num_tiles = -(-(rows + groups * (tile_m - 1)) // tile_m)  # worst case over all group sizes
    padded = (group_sizes + tile_m - 1) // tile_m * tile_m  # [G]
    start = jnp.cumsum(group_sizes) - group_sizes  # [G] first sorted row of each group
    padded_start = jnp.cumsum(padded) - padded  # [G] first padded row of each group
    row = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.searchsorted(jnp.cumsum(group_sizes), row, side="right")  # [M], G for padding rows
    valid = group < groups
    g = jnp.minimum(group, groups - 1)
    dest = jnp.where(valid, row - start[g] + padded_start[g], num_tiles * tile_m).astype(jnp.int32)
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * tile_m
    tile_group = jnp.searchsorted(jnp.cumsum(padded), tile_start, side="right")
    return TilePlan(dest, jnp.minimum(tile_group, groups - 1).astype(jnp.int32), tile_m, num_tiles)
