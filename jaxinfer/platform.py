"""The platform policy: every choice that depends on the backend JAX runs on, decided in one place.

``current()`` reads ``jax.default_backend()`` once. The engine, the model's GEMM forms and the MoE path ask it
instead of the backend (docs/architecture.md "Layers").
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import numpy as np

# Decode iterations per decode step on CPU (vLLM's multi-step scheduling). A decode step's host CPU time (arrays,
# transfer, dispatch, bookkeeping) comes out of the device's threads on a 2-core machine; k iterations pay it once
# per k tokens. 8: the measured choice (docs/benchmarks.md "Engine steps and host overhead (CPU)").
CPU_SCHEDULER_STEPS = 8
# CPU features (Linux /proc/cpuinfo) with bf16 dot-product instructions: x86's AVX512-BF16 and AMX-BF16, Arm's BF16.
# XLA:CPU's bf16 products ran at about twice its float32 rate on one CI machine and at half to three quarters of it
# on another with AVX2 only (a Zen 3 EPYC), converting bf16 to float32 on the way (docs/benchmarks.md "Routed-expert
# paths (CPU)").
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@dataclasses.dataclass(frozen=True)
class Platform:
    """name: jax.default_backend() ("cpu", "gpu", "tpu", ...); native_bf16: its products take bf16 operands at
    least at their float32 rate (accelerators; a CPU with NATIVE_BF16_CPU_FLAGS)."""

    name: str
    native_bf16: bool = True

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    @property
    def is_gpu(self) -> bool:
        return self.name == "gpu"

    @property
    def attention_backend(self) -> str:
        """The engine's default attention backend (models/attention.py): the Pallas kernel on GPUs, XLA elsewhere."""
        return "pallas" if self.is_gpu else "xla"

    @property
    def num_scheduler_steps(self) -> int:
        """Default decode iterations per decode step: CPU_SCHEDULER_STEPS on CPU; 1 elsewhere (not measured)."""
        return CPU_SCHEDULER_STEPS if self.is_cpu else 1

    def greedy_screening(self, dtype) -> bool:
        """The greedy head screen's default (models/screened_head.py): on for a float32 model on CPU, where the
        int8 screen reads a quarter of the head's bytes; off for bf16, whose head's matrix-vector product costs
        about what the int8 one does on CPU, and on other backends (not measured; docs/benchmarks.md "Greedy
        screening (CPU)")."""
        return self.is_cpu and np.dtype(dtype) == np.float32


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The CPU's feature flags in the text of /proc/cpuinfo (x86 "flags", Arm "Features"; empty if neither)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(cpuinfo: str) -> bool:
    """Whether the CPU described by /proc/cpuinfo text has bf16 dot-product instructions (NATIVE_BF16_CPU_FLAGS)."""
    return bool(cpu_flags(cpuinfo) & NATIVE_BF16_CPU_FLAGS)


@functools.cache
def current() -> Platform:
    """The platform of JAX's default backend (read once per process)."""
    name = jax.default_backend()
    if name != "cpu":
        return Platform(name)
    try:
        cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: unknown, taken as without
        cpuinfo = ""
    return Platform(name, native_bf16=native_bf16(cpuinfo))
