"""What every kernel package shares: integer tile arithmetic, Hopper's shared-memory limit, and the choice between a
kernel's Pallas and XLA paths (docs/architecture.md "Kernels")."""

from __future__ import annotations

# Dynamic shared memory one CTA may opt into on sm_90 (CUDA C Programming Guide, "Technical Specifications per
# Compute Capability": 227 KB); Mosaic GPU refuses kernels above it (jax/experimental/mosaic/gpu/core.py), and
# DeepGEMM sizes its pipeline stages to it.
SMEM_BYTES = 227 * 1024


def cdiv(a, b):
    """ceil(a / b) for integers (Python ints or integer arrays), b > 0."""
    return (a + b - 1) // b


def round_up(a, b):
    """The least multiple of b that is >= a (b > 0)."""
    return cdiv(a, b) * b


def choose_implementation(implementation, *, gpu: bool, unsupported: str | None = None) -> str:
    """implementation None: "pallas" on a CUDA GPU where the kernel supports the operands, else "xla" (so, e.g., a
    float32 model still decodes on a GPU); an explicit "pallas" the kernel cannot run raises ValueError with the
    reason ``unsupported`` (None: it can)."""
    if implementation is None:
        return "pallas" if gpu and unsupported is None else "xla"
    if implementation not in ("pallas", "xla"):
        raise ValueError(f"implementation must be None, 'pallas' or 'xla', got {implementation!r}")
    if implementation == "pallas" and unsupported is not None:
        raise ValueError(unsupported)
    return implementation
