"""Multi-process runs with JAX's own multi-controller runtime (docs/architecture.md "Mesh semantics").

Every process runs the same program on the same host inputs; together they drive one global mesh. The rules:
- ``initialize`` first, before any JAX call that starts the backend (``jax.devices()``, a computation, ...).
- Host inputs enter as global arrays through ``global_array`` (each process fills only its own devices' shards).
- Results leave through ``to_host``: every process gets the whole global value as numpy.

On CPU, jax 0.10.2 uses gloo for cross-process collectives by default (``jax_cpu_collectives_implementation``
is already "gloo" once ``jax.distributed`` is initialized), so nothing beyond the device count is configured here.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.experimental import multihost_utils

_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^:\s\[\]]+):(?P<port>\d{1,5})")


def check_coordinator(coordinator: str) -> str:
    """Validates a coordinator address "HOST:PORT" (IPv6 hosts in brackets); returns it unchanged."""
    match = _HOST_PORT.fullmatch(coordinator) if isinstance(coordinator, str) else None
    if match is None or not 1 <= int(match["port"]) <= 65535:
        raise ValueError(f"--coordinator must be HOST:PORT with a port in [1, 65535] (e.g. 10.0.0.1:1234), "
                         f"got {coordinator!r}")
    return coordinator


def check_process_layout(num_processes: int, process_id: int) -> None:
    """Validates num_processes >= 1 and 0 <= process_id < num_processes."""
    if num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in [0, {num_processes}) for --num-processes {num_processes}, "
                         f"got {process_id}")


def initialize(coordinator: str, num_processes: int, process_id: int, local_device_count: int | None = None,
               timeout_s: int = 300) -> None:
    """Joins this process to a multi-process JAX run: ``jax.distributed.initialize`` on the coordinator.

    coordinator: "HOST:PORT" of process 0 (it serves there; the others connect). local_device_count: CPU devices
    this process simulates (``jax_num_cpu_devices``; ignored by GPU backends, which use their visible GPUs).
    timeout_s: how long to wait for all processes to join. Must run before any JAX call that starts the backend;
    jax raises RuntimeError otherwise. Global state: only what ``jax.distributed`` itself keeps.
    """
    check_coordinator(coordinator)
    check_process_layout(num_processes, process_id)
    if local_device_count is not None and local_device_count < 1:
        raise ValueError(f"--cpu-devices must be >= 1, got {local_device_count}")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s)
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)


def is_primary() -> bool:
    """True in process 0 (the one that prints results in a multi-process run), and in single-process runs."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process has reached the barrier ``name`` (a no-op in single-process runs).

    For host-side ordering, e.g. every process checks an output directory before process 0 writes into it."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def global_array(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global array of ``host`` (shape S, any dtype) placed on ``sharding``.

    Every process passes the same full host array; each one copies only the slices its own devices hold (no
    cross-process traffic, unlike ``jax.device_put``, which checks in multi-process runs that all processes passed
    equal values by all-gathering them). Works the same in single-process runs.
    """
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(x: jax.Array) -> np.ndarray:
    """The whole global value of ``x`` (shape S) as numpy, in every process.

    Fully addressable arrays are copied directly; replicated ones from a local shard; others are all-gathered
    across processes (a collective: every process must call this for the same array).
    """
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
