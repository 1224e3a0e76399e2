"""Executables of a jitted step compiled ahead of use for a family of sizes of one argument's leading axis.

The engine's prefill steps in query blocks (EngineConfig.prefill_layout="blocks") differ only in their block count,
a power of two up to prefill_capacity // PREFILL_BLOCK per rank. A workload repeated with prefix hits (shorter
chunks, regrouped) reaches block counts its first run never compiled; compiling the whole family once the first
of it is needed, in a background thread, means no step after that waits for a compilation (vLLM compiles its
token-count buckets at start-up for the same reason; here the first step is not delayed).

A JAX executable compiled ahead (``jit(f).lower(...).compile()``) is not in ``f``'s own dispatch cache, so calls go
through the ``jax.stages.Compiled`` objects kept here. The compiling thread stops taking work once the main thread
has finished (a script that generates once exits after at most the compilation under way).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence

import jax


class CompiledFamily:
    """``fn`` (a jax.jit function) called through executables compiled per (leading size of argument ``vary``,
    static arguments), the other sizes of ``sizes`` compiled in a background thread when a key is first met.

    Every argument but ``vary`` must keep its shape, dtype and sharding from call to call (the engine's model state,
    caches and buffers); ``vary``'s other axes, dtype and sharding too.
    """

    def __init__(self, fn, *, static_argnums: Sequence[int], vary: int, sizes: Sequence[int]):
        self.fn = fn
        self.static = tuple(static_argnums)
        self.vary = vary
        self.sizes = tuple(sizes)
        self._lock = threading.Lock()
        self._futures: dict[tuple, concurrent.futures.Future] = {}

    def __call__(self, *args):
        key = self._key(args[self.vary].shape[0], args)
        with self._lock:
            future = self._futures.get(key)
            first = future is None
            if first:  # compiled here, now; its siblings in the background
                future = self._futures[key] = concurrent.futures.Future()
        if first:
            try:
                future.set_result(self.fn.lower(*args).compile())
            except BaseException as e:
                future.set_exception(e)
                raise
            self._ahead(args)
        dynamic = [a for i, a in enumerate(args) if i not in self.static]
        return future.result()(*dynamic)

    def _key(self, size: int, args) -> tuple:
        return (size,) + tuple(args[i] for i in self.static)

    def _ahead(self, args) -> None:
        # Shapes only: the arrays themselves may be donated to a step before the thread lowers.
        shaped = [a if i in self.static else jax.tree.map(_abstract, a) for i, a in enumerate(args)]
        x = shaped[self.vary]
        jobs = []
        with self._lock:
            for size in self.sizes:
                key = self._key(size, args)
                if key not in self._futures:
                    shaped[self.vary] = jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype, sharding=x.sharding)
                    self._futures[key] = concurrent.futures.Future()
                    jobs.append((self._futures[key], tuple(shaped)))
        if jobs:
            threading.Thread(target=self._compile, args=(jobs,), name="compile-ahead").start()

    def _compile(self, jobs) -> None:
        for future, shaped in jobs:
            if not threading.main_thread().is_alive():  # the interpreter is exiting: nobody will call these
                future.cancel()
                continue
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.fn.lower(*shaped).compile())
                except BaseException as e:  # noqa: BLE001 - handed to whoever calls this size
                    future.set_exception(e)

    def wait(self) -> None:
        """Blocks until every compilation started so far has finished (raising the first error)."""
        with self._lock:
            futures = list(self._futures.values())
        for future in futures:
            if not future.cancelled():
                future.result()


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
