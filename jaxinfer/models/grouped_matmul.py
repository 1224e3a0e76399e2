"""Grouped matmul for routed experts: rows sorted by group (expert), one weight matrix per group.

``jax.lax.ragged_dot`` has these semantics, but XLA:CPU computes it as if every row met every group (DESIGN.md:
"costs about as much as computing every expert"), E times the useful work. The "tiled" form here is what
grouped-GEMM kernels do (MegaBlocks, DeepGEMM's contiguous layout): each group's rows are padded to a multiple
of a row tile, every tile belongs to one group, and one batched matmul multiplies each tile by its group's
weight. Work is (rows + groups * (tile - 1)) rows instead of rows * groups; the result is the same row by row.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Implementation = Literal["tiled", "ragged_dot"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Where each sorted row goes in the padded, tiled layout. Built once, shared by the three projections."""

    dest: jax.Array  # [M] int32: padded row of each sorted row (rows past sum(group_sizes): out of bounds)
    tile_group: jax.Array  # [num_tiles] int32: the group of each tile
    tile_m: int = dataclasses.field(metadata=dict(static=True))
    num_tiles: int = dataclasses.field(metadata=dict(static=True))


def default_tile_m(rows: int, groups: int) -> int:
    """A power of two near the mean group size, in [8, 128]: small for decode batches, full tiles for prefill."""
    mean = max(rows // max(groups, 1), 1)
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def tile_plan(group_sizes: jax.Array, rows: int, tile_m: int | None = None) -> TilePlan:
    """group_sizes [G] int32 (sum <= rows) -> the tiling of ``rows`` sorted rows."""
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


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, plan: TilePlan | None = None,
                   implementation: Implementation = "tiled", preferred_element_type=jnp.float32) -> jax.Array:
    """x [M, K] (rows sorted by group), w [G, N, K] (checkpoint layout: out x in), group_sizes [G] -> [M, N].

    Row r of group g gives x[r] @ w[g].T. Rows past sum(group_sizes) are padding: their output is unspecified
    for "ragged_dot" and zero for "tiled"."""
    if implementation == "ragged_dot":
        return jax.lax.ragged_dot(x, w.swapaxes(1, 2), group_sizes, preferred_element_type=preferred_element_type)
    if implementation != "tiled":
        raise ValueError(f"implementation must be 'tiled' or 'ragged_dot', got {implementation!r}")
    plan = tile_plan(group_sizes, x.shape[0]) if plan is None else plan
    padded = jnp.zeros((plan.num_tiles * plan.tile_m, x.shape[1]), x.dtype).at[plan.dest].set(x, mode="drop")
    tiles = padded.reshape(plan.num_tiles, plan.tile_m, x.shape[1])  # [T, m, K]
    out = jnp.einsum("tmk,tnk->tmn", tiles, w[plan.tile_group], preferred_element_type=preferred_element_type)
    return jnp.take(out.reshape(-1, w.shape[1]), plan.dest, axis=0, mode="fill", fill_value=0)  # [M, N]
