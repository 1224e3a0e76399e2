"""jaxinfer/host_memory.py: with glibc's malloc tuned at import, an XLA:CPU program's large temporary buffer is
reused from one execution to the next instead of being faulted in again (the kernel's page-fault counter is the
oracle: getrusage's ru_minflt), and the tuning stays off where the user or the environment configure malloc."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from jaxinfer import host_memory

PROBE = r"""
import json, resource, sys, time
import jaxinfer  # applies host_memory.tune_malloc() unless the environment says not to
import jax, jax.numpy as jnp

@jax.jit
def f(x):  # x [16M] float32: sin(x) is materialized (the barrier) in the program's 64 MB temporary buffer
    y = jax.lax.optimization_barrier(jnp.sin(x))
    return (y * 2).sum() + y.max()

x = jnp.ones(16 << 20, jnp.float32)
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    time.sleep(0.1)  # XLA:CPU frees an execution's buffers after it completes, on its own threads
print(json.dumps(faults))
"""

PAGES = (64 << 20) // 4096  # the temporary buffer's 4 KiB pages


def _faults(env_extra: dict) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k not in host_memory.USER_VARIABLES + ("JAXINFER_MALLOC",)}
    env.update(env_extra, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc only")
def test_a_programs_temporary_buffer_is_reused_not_faulted_in_again():
    tuned = _faults({})
    untouched = _faults({"JAXINFER_MALLOC": "default"})
    # Without the tuning every execution faults the buffer in again (glibc maps it afresh): the probe measures it.
    assert min(untouched[1:]) > PAGES // 2, untouched
    # With it, executions reuse freed buffers' pages once the heap has grown enough: small allocations of other
    # threads (one arena) may take a piece of a freed buffer, and then the next one grows the heap (a few times,
    # on a loaded machine, in the first executions).
    assert max(tuned[-4:]) < PAGES // 20, tuned


def test_the_environment_and_the_user_keep_their_malloc_settings():
    assert host_memory.tune_malloc({"JAXINFER_MALLOC": "default"}) is False
    for name in host_memory.USER_VARIABLES:
        assert host_memory.tune_malloc({name: "1"}) is False
