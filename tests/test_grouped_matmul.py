"""Grouped matmul (tiled and ragged_dot forms) against a float64 numpy loop over groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.grouped_matmul import grouped_matmul, tile_plan


def _reference(x, w, sizes):
    out = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for g, n in enumerate(sizes):
        out[start: start + n] = x[start: start + n].astype(np.float64) @ w[g].astype(np.float64).T
        start += n
    return out


@pytest.mark.parametrize("sizes, rows, tile_m", [
    ([3, 0, 5, 1], 9, None),         # an empty group
    ([0, 0, 7], 7, 4),               # leading empty groups, a partial tile
    ([16, 16], 32, 8),               # exact tiles
    ([2, 1, 0, 4, 0, 3], 13, 2),     # padding rows past sum(sizes) (3 of them)
    ([40, 1, 23, 0, 64], 128, None),  # prefill-like
])
@pytest.mark.parametrize("implementation", ["tiled", "ragged_dot"])
def test_grouped_matmul_matches_loop(sizes, rows, tile_m, implementation):
    rng = np.random.default_rng(len(sizes) * 100 + rows)
    k, n = 24, 10
    x = rng.standard_normal((rows, k), np.float32)
    w = rng.standard_normal((len(sizes), n, k), np.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    plan = tile_plan(gs, rows, tile_m) if implementation == "tiled" else None
    got = np.asarray(jax.jit(grouped_matmul, static_argnames="implementation")(
        jnp.asarray(x), jnp.asarray(w), gs, plan=plan, implementation=implementation))
    valid = sum(sizes)
    ref = _reference(x, w, sizes)
    np.testing.assert_allclose(got[:valid], ref[:valid], rtol=1e-5, atol=1e-5)
    if implementation == "tiled":
        np.testing.assert_array_equal(got[valid:], 0.0)


def test_bad_implementation():
    with pytest.raises(ValueError, match="implementation"):
        grouped_matmul(jnp.ones((2, 3)), jnp.ones((1, 4, 3)), jnp.asarray([2]), implementation="loop")
