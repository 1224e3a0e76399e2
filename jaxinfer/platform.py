"""The platform policy: every choice that depends on the backend JAX runs on, decided in one place.

``current()`` reads ``jax.default_backend()`` once. The engine, the model's GEMM forms and the MoE path ask it
instead of the backend (docs/architecture.md "Layers").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

# Decode iterations per decode step on CPU (vLLM's multi-step scheduling). A decode step's host CPU time (arrays,
# transfer, dispatch, bookkeeping) comes out of the device's threads on a 2-core machine; k iterations pay it once
# per k tokens. 8: the measured choice (docs/benchmarks.md "Engine steps and host overhead (CPU)").
CPU_SCHEDULER_STEPS = 8


@dataclasses.dataclass(frozen=True)
class Platform:
    """name: jax.default_backend() ("cpu", "gpu", "tpu", ...)."""

    name: str

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


@functools.cache
def current() -> Platform:
    """The platform of JAX's default backend (read once per process)."""
    return Platform(jax.default_backend())
