"""Pages between the device's latent cache and the KV storage tier (kv/page_store.py; docs/architecture.md "KV
storage tier").

``place``: pages read from the tier at admission (SchedulerOutput.page_loads) are written into the cache before
the step that reads them. ``copy_out``: pages the prefix cache registered (Scheduler.take_stores) are gathered from
the cache by a program dispatched at once, in the device's order of work: after the steps that wrote them and
before any later step could reuse them, so the copy is the page's data whatever happens to the page afterwards (no
reference is held). A background thread brings the copy to the host and writes the files, behind the steps.

Both programs (``put_pages``, ``take_pages``; prefill/decode disaggregation's hand-over uses them too) take the
cache (every layer, the MTP module's included) donated and return it, so a step dispatched after them never waits
on them; the tier's page counts are padded to powers of two (a few programs). ``take_from_rank`` and
``put_on_rank`` (prefill/decode disaggregation's hand-over) read and write one DP rank's pages on that rank's
device alone.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxinfer.engine.buckets import bucket
from jaxinfer.kv.page_store import PageStore
from jaxinfer.kv.paged_cache import cache_sharding


@functools.partial(jax.jit, donate_argnums=0)
def put_pages(layers, idx, data):
    """layers: per layer [G, S, 1, W]; idx [n] global page ids (G: a padding entry, dropped); data [n, L, S, W]."""
    return tuple(a.at[idx].set(data[:, i, :, None, :], mode="drop") for i, a in enumerate(layers))


@functools.partial(jax.jit, donate_argnums=0)
def take_pages(layers, idx):
    """(the layers unchanged, [n, L, S, W]: the pages ``idx`` of every layer)."""
    return layers, jnp.stack([a[idx, :, 0, :] for a in layers], axis=1)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=2)
def _take_per_rank(layers, idx, mesh: Mesh):
    """take_pages on every device at once (shard_map). idx [R * n] rank-local page ids, split over the DP ranks as
    the cache is; returns (layers, [R * n, L, S, W] split likewise)."""
    spec = cache_sharding(mesh).spec
    return jax.shard_map(take_pages, mesh=mesh, in_specs=((spec,) * len(layers), spec),
                         out_specs=((spec,) * len(layers), spec))(layers, idx)


def _rank_shard(sharding, shape, rank: int, n: int) -> jax.Device:
    """The device holding rows [rank * n, (rank + 1) * n) of an array of ``shape`` split like the cache."""
    return next(d for d, index in sharding.addressable_devices_indices_map(shape).items()
                if index[0].indices(shape[0])[0] == rank * n)  # slice(None) on a one-device mesh


def _rank_idx(mesh: Mesh, rank: int, pages, other: int) -> jax.Array:
    """[R * n] page ids split over the DP ranks as the cache is: ``pages`` on ``rank``, ``other`` on the rest."""
    n = len(pages)
    idx = np.full(mesh.size * n, other, np.int32)
    idx[rank * n:(rank + 1) * n] = pages
    return jax.device_put(idx, cache_sharding(mesh))


def take_from_rank(layers: tuple, mesh: Mesh, rank: int, pages) -> tuple[tuple, jax.Array]:
    """(``layers`` (donated and returned), [n, L, S, W]: rank-local ``pages`` of DP rank ``rank``, every layer, on
    that rank's device alone). The other devices gather their null page (work of n pages each, kept there): a
    gather over the whole split cache would combine every device's part into a copy on each device."""
    n = len(pages)
    sharding = cache_sharding(mesh)
    layers, data = _take_per_rank(tuple(layers), _rank_idx(mesh, rank, pages, 0), mesh)
    device = _rank_shard(sharding, data.shape, rank, n)
    return layers, next(s.data for s in data.addressable_shards if s.device == device)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _put_per_rank(layers, idx, data, mesh: Mesh):
    """put_pages on every device at once (shard_map: nothing moves between devices). layers: per layer [G, S, 1,
    W], idx [R * n] rank-local page ids (the rank's page count: padding, dropped), data [R * n, L, S, W]; all split
    over the DP ranks as the cache is (kv/paged_cache.py cache_sharding)."""
    spec = cache_sharding(mesh).spec
    return jax.shard_map(put_pages, mesh=mesh, in_specs=((spec,) * len(layers), spec, spec),
                         out_specs=(spec,) * len(layers))(layers, idx, data)


def put_on_rank(layers: tuple, mesh: Mesh, pages_per_rank: int, rank: int, pages, latents: jax.Array) -> tuple:
    """``layers`` (the cache, donated) with rank-local ``pages`` of DP rank ``rank`` set to ``latents`` ([n, L, S,
    W] on any single device: a prefill engine's). Only that rank's device receives a copy of the latents; the other
    devices' parts of the write are zeros allocated in place and dropped, so a hand-over costs one copy of its
    latents however many ranks the mesh has (a replicated copy would cost one per device)."""
    n = len(pages)
    sharding = cache_sharding(mesh)
    shape = (mesh.size * n, *latents.shape[1:])
    target = _rank_shard(sharding, shape, rank, n)
    shards = [jax.device_put(latents, d) if d == target else jnp.zeros(latents.shape, latents.dtype, device=d)
              for d in sharding.addressable_devices]
    data = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    idx = _rank_idx(mesh, rank, pages, pages_per_rank)  # out of bounds on the other ranks: dropped
    return _put_per_rank(tuple(layers), idx, data, mesh)


class PageIO:
    """Moves pages between a cache of ``pages_per_rank`` pages per DP rank and ``store`` (pages in the model's
    value dtype ``value_dtype``; the cache may hold their bit patterns, paged_cache.py)."""

    def __init__(self, store: PageStore, pages_per_rank: int, value_dtype):
        self.store = store
        self.pages_per_rank = pages_per_rank
        self.value_dtype = np.dtype(value_dtype)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-kv-writer")
        self._pending: list[concurrent.futures.Future] = []
        self._lock = threading.Lock()
        atexit.register(self.flush)  # a script that ends right after generate still gets its pages written

    def place(self, layers: tuple, loads: tuple) -> tuple:
        """``layers`` with the pages of ``loads`` (per rank: (rank-local page, data [L, S, W])) written in."""
        entries = [(rank * self.pages_per_rank + page, data) for rank, pages in enumerate(loads)
                   for page, data in pages]
        n = bucket(len(entries))
        idx = np.full(n, layers[0].shape[0], np.int32)  # padding: out of bounds, dropped
        data = np.zeros((n, *entries[0][1].shape), layers[0].dtype)
        for i, (page, page_data) in enumerate(entries):
            idx[i] = page
            data[i] = np.asarray(page_data).view(layers[0].dtype)  # bit patterns: the same bytes
        return put_pages(layers, jnp.asarray(idx), jnp.asarray(data))

    def copy_out(self, layers: tuple, stores: list[tuple[int, int, bytes]]) -> tuple:
        """Dispatches the copy of ``stores`` ((rank, rank-local page, storage key)) and queues their writes;
        returns the layers (donated through the copy)."""
        n = bucket(len(stores))
        idx = np.zeros(n, np.int32)  # padding: the null page, copied and ignored
        for i, (rank, page, _) in enumerate(stores):
            idx[i] = rank * self.pages_per_rank + page
        layers, data = take_pages(layers, jnp.asarray(idx))
        keys = [key for _, _, key in stores]
        future = self._writer.submit(self._write, keys, data)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [future]
        return layers

    def _write(self, keys: list[bytes], data: jax.Array) -> None:
        pages = np.asarray(jax.device_get(data)).view(self.value_dtype)  # [n, L, S, W]
        for key, page in zip(keys, pages):
            self.store.put(key, page)

    def flush(self) -> None:
        """Waits for the queued writes (their errors, already reported by the store as warnings, are not raised)."""
        with self._lock:
            pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)
