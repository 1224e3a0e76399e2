"""tile_plan (the row-tile layout of moe.py's "tiled" path) against a numpy construction of the same layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.grouped_matmul import default_tile_m, tile_plan


def _layout(sizes, rows, tile_m):
    """numpy: (dest of each sorted row, group of each used tile) built group by group."""
    dest, tile_group, nxt = [], [], 0
    for g, n in enumerate(sizes):
        dest += list(range(nxt, nxt + n))
        tiles = -(-n // tile_m)
        tile_group += [g] * tiles
        nxt += tiles * tile_m
    return np.array(dest, np.int64), np.array(tile_group, np.int64)


@pytest.mark.parametrize("sizes, rows, tile_m", [
    ([3, 0, 5, 1], 9, None),         # an empty group
    ([0, 0, 7], 7, 4),               # leading empty groups, a partial tile
    ([16, 16], 32, 8),               # exact tiles
    ([2, 1, 0, 4, 0, 3], 13, 2),     # padding rows past sum(sizes) (3 of them)
    ([40, 1, 23, 0, 64], 128, None),  # prefill-like
    ([300, 0, 0, 12], 312, None),    # one hot group over many tiles
])
def test_tile_plan_matches_numpy_layout(sizes, rows, tile_m):
    plan = jax.jit(tile_plan, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), rows, tile_m)
    tm = default_tile_m(rows, len(sizes)) if tile_m is None else tile_m
    assert plan.tile_m == tm and plan.num_tiles == -(-(rows + len(sizes) * (tm - 1)) // tm)
    dest, tile_group = _layout(sizes, rows, tm)
    valid = sum(sizes)
    got = np.asarray(plan.dest)
    np.testing.assert_array_equal(got[:valid], dest)
    assert (got[valid:] >= plan.num_tiles * tm).all()  # padding rows: out of bounds (dropped)
    np.testing.assert_array_equal(np.asarray(plan.tile_group)[:len(tile_group)], tile_group)
    assert len(tile_group) <= plan.num_tiles


def test_default_tile_m():
    # the power of two >= the mean group size (rows // 16 here: 0, 8, 16, 62, 256, 6250), within [8, 128]
    assert [default_tile_m(r, 16) for r in (1, 128, 256, 1000, 4096, 100000)] == [8, 8, 16, 64, 128, 128]
