"""A hand-over's page moves (engine/page_io.py take_from_rank, put_on_rank) against numpy: one DP rank's pages of a
prefill mesh's cache, read onto that rank's device alone, written into one rank of a decode mesh's cache; every
other page of both caches unchanged, and the programs move nothing between devices."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxinfer.engine.page_io import _put_per_rank, _take_per_rank, put_on_rank, take_from_rank
from jaxinfer.kv.paged_cache import cache_sharding
from jaxinfer.parallel.mesh import AXES

PAGES, S, W, L = 6, 4, 8, 3  # pages per rank, page size, latent width, layers
COLLECTIVES = re.compile(r"all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter")


def _mesh(first: int, data: int, expert: int) -> Mesh:
    return Mesh(np.array(jax.devices()[first:first + data * expert]).reshape(data, expert), AXES)


def _cache(mesh: Mesh, dtype, seed: int) -> tuple[np.ndarray, tuple]:
    """(numpy copy [L, R * PAGES, S, 1, W], the cache's layers on the mesh)."""
    rng = np.random.default_rng(seed)
    host = rng.integers(0, 60000, (L, mesh.size * PAGES, S, 1, W)).astype(dtype)
    return host, tuple(jax.device_put(layer, cache_sharding(mesh)) for layer in host)


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])  # uint16: a cache of bf16 bit patterns
def test_pages_move_from_one_rank_to_another_and_nothing_else_changes(dtype):
    prefill, decode = _mesh(0, 1, 2), _mesh(2, 2, 2)
    p_host, p_layers = _cache(prefill, dtype, 0)
    d_host, d_layers = _cache(decode, dtype, 1)
    src, dst = [3, 0, 5], [1, 4, 2]
    p_layers, latents = take_from_rank(p_layers, prefill, 1, src)
    want = np.stack([p_host[i, [PAGES + p for p in src], :, 0, :] for i in range(L)], axis=1)  # [n, L, S, W]
    assert latents.devices() == {prefill.devices.flat[1]} and latents.dtype == dtype
    np.testing.assert_array_equal(np.asarray(latents), want)
    np.testing.assert_array_equal(np.stack([np.asarray(a) for a in p_layers]), p_host)

    d_layers = put_on_rank(d_layers, decode, PAGES, 2, dst, latents)
    expect = d_host.copy()
    for j, page in enumerate(dst):
        expect[:, 2 * PAGES + page, :, 0, :] = want[j]  # [L, S, W]
    np.testing.assert_array_equal(np.stack([np.asarray(a) for a in d_layers]), expect)
    assert all(a.sharding == cache_sharding(decode) for a in d_layers)


def test_the_programs_move_nothing_between_devices():
    mesh = _mesh(0, 2, 2)
    layers = tuple(jax.ShapeDtypeStruct((mesh.size * PAGES, S, 1, W), np.float32, sharding=cache_sharding(mesh))
                   for _ in range(L))
    idx = jax.ShapeDtypeStruct((mesh.size * 3,), np.int32, sharding=cache_sharding(mesh))
    data = jax.ShapeDtypeStruct((mesh.size * 3, L, S, W), np.float32, sharding=cache_sharding(mesh))
    for lowered in (_take_per_rank.lower(layers, idx, mesh), _put_per_rank.lower(layers, idx, data, mesh)):
        assert not COLLECTIVES.search(lowered.compile().as_text())
