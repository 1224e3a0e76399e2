"""The one place that touches private JAX APIs for Mosaic GPU kernels (STYLE.md: private imports in one helper).

API (small on purpose; the MLA decode and FP8 GEMM kernels share it):
- ``interpret_params()``: the GPU interpret-mode parameters to pass as ``interpret=`` to ``plgpu.kernel`` /
  ``pl.pallas_call`` so a Mosaic GPU kernel runs on CPU (simulated SMEM, barriers, TMA, wgmma).
- ``default_interpret() -> bool``: True when the default backend is not a CUDA GPU (the kernel must be interpreted).
- ``lower_for_cuda(fn, *args, **kwargs) -> str``: the text of ``fn`` lowered for the ``cuda`` platform
  (cross-lowering works without a GPU); ``args`` may be arrays or ``jax.ShapeDtypeStruct``.
- ``has_mosaic_gpu_call(text) -> bool``: whether lowered module text contains the Mosaic GPU kernel call
  (so an XLA fallback cannot pass for a kernel).

Checked on jax 0.10.2 (CPU); the GPU machines run jax 0.11.
"""

from __future__ import annotations

import functools

import jax

# The custom-call target Mosaic GPU kernels lower to (jax/_src/pallas/mosaic_gpu/pallas_call_registration.py ->
# jax.experimental.mosaic.gpu: "mosaic_gpu_v2"; older releases used "mosaic_gpu").
_MOSAIC_GPU_TARGETS = ("mosaic_gpu_v2", "mosaic_gpu")


@functools.cache
def interpret_params():
    """GPU interpret-mode parameters (``InterpretGPUParams()``, a frozen, hashable dataclass).

    Also registers an identity CPU lowering for ``plgpu.layout_cast`` (a register-layout hint that GPU interpret
    mode on jax 0.10.2 cannot execute), so kernels that pin layouts (``layout_cast``, ``broadcasted_iota(...,
    layout=)``) run unchanged in interpret mode.
    """
    from jax._src.interpreters import mlir  # private: kept here only
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    return InterpretGPUParams()


def default_interpret() -> bool:
    """True when the default backend is not a CUDA GPU, i.e. a Mosaic GPU kernel cannot run natively."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return True
    return not (device.platform == "gpu" and "cuda" in getattr(device.client, "platform_version", "cuda").lower())


def lower_for_cuda(fn, *args, **kwargs) -> str:
    """Lower ``fn(*args, **kwargs)`` for CUDA (no GPU needed) and return the lowered module's text."""
    lowered = jax.jit(functools.partial(fn, **kwargs)).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def has_mosaic_gpu_call(text: str) -> bool:
    """Whether lowered module text holds a Mosaic GPU kernel custom call."""
    return any(f'custom_call_target = "{t}"' in text or f"@{t}" in text for t in _MOSAIC_GPU_TARGETS)
