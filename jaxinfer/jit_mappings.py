"""XLA:CPU's compiled programs against Linux's limit on a process's memory mappings (vm.max_map_count).

XLA:CPU links each program it compiles (or loads from the persistent compilation cache) into the process as JIT
objects, about three mappings each (code, read-only data, data): an engine step program of the embedded model takes
~300 (docs/benchmarks.md "Compiled programs and memory mappings (CPU)"). JAX keeps every program in its caches for
the life of the process, and Linux refuses a process more than vm.max_map_count mappings (65530 on many
distributions): LLVM then cannot map the next program and aborts the process ("LLVM ERROR: Unable to allocate
section memory!"), which no Python code can catch. A few hundred programs (two engines over varied workloads, a
test session's worker) reach it.

``relieve()`` drops JAX's caches (``jax.clear_caches()``) once the process holds more than RELIEF_FRACTION of its
limit: the programs still in use compile again when next called, or load from the persistent compilation cache, and
the process lives on (a program running at that moment finishes correctly). The engine asks after steps that
compiled or loaded a program (``programs_loaded`` counts them, through jax.monitoring's events). Raising the limit
(``sysctl -w vm.max_map_count=1048576``, as several distributions now ship) keeps every program.
"""

from __future__ import annotations

import pathlib
import threading
import warnings

import jax

RELIEF_FRACTION = 0.75  # the headroom left (~16k mappings of 65530) holds the ~50 programs a few steps may add
_MAPS = pathlib.Path("/proc/self/maps")
_LIMIT = pathlib.Path("/proc/sys/vm/max_map_count")
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

# Process-wide by nature (jax.monitoring's listeners are): registered once, counting programs the process loaded.
_lock = threading.Lock()
_state = {"listening": False, "programs": 0, "warned": False}


def _count() -> None:
    _state["programs"] += 1


def _on_event(event: str, **_kwargs) -> None:
    if event == _CACHE_HIT_EVENT:
        _count()


def _on_duration(event: str, _duration: float, **_kwargs) -> None:
    if event == _COMPILE_EVENT:
        _count()


def programs_loaded() -> int:
    """Programs this process compiled or loaded from the persistent cache since the first call (which registers
    the jax.monitoring listeners that count them)."""
    with _lock:
        if not _state["listening"]:
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _state["listening"] = True
    return _state["programs"]


def mapping_count() -> int | None:
    """The process's memory mappings now (lines of /proc/self/maps), or None where there is no such file."""
    try:
        with _MAPS.open("rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return None


def mapping_limit() -> int | None:
    """Linux's vm.max_map_count, or None where it cannot be read."""
    try:
        return int(_LIMIT.read_text())
    except (OSError, ValueError):
        return None


def relieve(fraction: float = RELIEF_FRACTION) -> bool:
    """Drops JAX's compiled programs (``jax.clear_caches()``) if the process holds more than ``fraction`` of its
    mappings limit, warning the first time; returns whether it did. Programs running at that moment finish
    correctly (their executions hold them); every caller's jitted functions compile again on their next call."""
    limit = mapping_limit()
    count = mapping_count() if limit else None
    if count is None or count <= fraction * limit:
        return False
    jax.clear_caches()
    if not _state["warned"]:
        _state["warned"] = True
        warnings.warn(
            f"this process held {count} of the {limit} memory mappings Linux allows it (vm.max_map_count), most of "
            f"them XLA:CPU's compiled programs; JAX's caches were dropped (jax.clear_caches()) so that the next "
            f"program can still be mapped, and the programs in use compile again (or load from the persistent "
            f"compilation cache). To keep them, raise the limit: sysctl -w vm.max_map_count=1048576",
            RuntimeWarning, stacklevel=2)
    return True
