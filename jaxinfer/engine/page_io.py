"""Pages between the device's latent cache and the KV storage tier (kv/page_store.py; docs/architecture.md "KV
storage tier").

``place``: pages read from the tier at admission (SchedulerOutput.page_loads) are written into the cache before
the step that reads them. ``copy_out``: pages the prefix cache registered (Scheduler.take_stores) are gathered from
the cache by a program dispatched at once, in the device's order of work: after the steps that wrote them and
before any later step could reuse them, so the copy is the page's data whatever happens to the page afterwards (no
reference is held). A background thread brings the copy to the host and writes the files, behind the steps.

Both programs (``put_pages``, ``take_pages``; prefill/decode disaggregation's hand-over uses them too) take the
cache (every layer, the MTP module's included) donated and return it, so a step dispatched after them never waits
on them; the tier's page counts are padded to powers of two (a few programs).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.buckets import bucket
from jaxinfer.kv.page_store import PageStore


@functools.partial(jax.jit, donate_argnums=0)
def put_pages(layers, idx, data):
    """layers: per layer [G, S, 1, W]; idx [n] global page ids (G: a padding entry, dropped); data [n, L, S, W]."""
    return tuple(a.at[idx].set(data[:, i, :, None, :], mode="drop") for i, a in enumerate(layers))


@functools.partial(jax.jit, donate_argnums=0)
def take_pages(layers, idx):
    """(the layers unchanged, [n, L, S, W]: the pages ``idx`` of every layer)."""
    return layers, jnp.stack([a[idx, :, 0, :] for a in layers], axis=1)


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
