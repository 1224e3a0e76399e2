"""The one place that touches private JAX APIs for Mosaic GPU kernels (STYLE.md: private imports in one helper).

API (small on purpose; the MLA decode and FP8 GEMM kernels share it):
- ``interpret_params()``: the GPU interpret-mode parameters to pass as ``interpret=`` to ``plgpu.kernel`` /
  ``pl.pallas_call`` so a Mosaic GPU kernel runs on CPU (simulated SMEM, barriers, TMA, wgmma).
- ``default_interpret() -> bool``: True when the default backend is not a CUDA GPU (the kernel must be interpreted).
- ``interpreter_runs_native() -> bool``: whether this jax's GPU interpret mode runs the kernels' own SMEM-operand
  wgmmas, layout-pinned loads and cluster barriers (jax >= 0.11.2); ``substitute_wgmma(interpret) -> bool``: whether
  an interpreted kernel must take value-level stand-ins for those wgmmas and loads instead (older releases).
- ``device_sm_count() -> int``: the default GPU's multiprocessors, ``HOPPER_SMS`` (132) where there is no GPU.
- ``lower_for_cuda(fn, *args, **kwargs) -> str``: the text of ``fn`` lowered for the ``cuda`` platform
  (cross-lowering works without a GPU); ``args`` may be arrays or ``jax.ShapeDtypeStruct``.
- ``has_mosaic_gpu_call(text) -> bool``: whether lowered module text contains the Mosaic GPU kernel call
  (so an XLA fallback cannot pass for a kernel).
- ``kernel_launches(fn, *args, **kwargs) -> list[Launch]``: the CUDA launch of every Mosaic GPU kernel that
  lowering ``fn`` for cuda builds (grid and block as CUDA's (x, y, z), dynamic shared memory bytes), read from the
  kernel modules before Mosaic GPU serializes them, so tests can check grid order and SMEM accounting.
- ``load(ref, layout)``: ``plgpu.load`` of a whole SMEM ref into a register layout, in the form each jax release
  wants (0.10 takes the index positionally; 0.11 deprecates passing it).
- ``kernel_modules(fn, *args, **kwargs) -> list[KernelModule]``: each of those kernel modules as text and as the
  bytecode the custom call carries (what Mosaic GPU compiles at run time; benchmarks/mosaic_offline.py compiles it
  to PTX and runs ptxas on it without a GPU).
- ``loop_bodies(text) -> list[list[str]]``: the lines of each ``scf.for`` loop's body in a kernel module's text,
  so tests can check what a kernel does per iteration (its barriers, the order of its loads and waits).

Checked on jax 0.10.2 and 0.11.2 (CPU); the GPU machines run jax 0.11.2.
"""

from __future__ import annotations

import functools
import inspect
import io
import re
from typing import NamedTuple

import jax

# The custom-call target Mosaic GPU kernels lower to (jax/_src/pallas/mosaic_gpu/pallas_call_registration.py ->
# jax.experimental.mosaic.gpu: "mosaic_gpu_v2"; older releases used "mosaic_gpu").
_MOSAIC_GPU_TARGETS = ("mosaic_gpu_v2", "mosaic_gpu")


@functools.cache
def interpret_params():
    """GPU interpret-mode parameters (``InterpretGPUParams()``, a frozen, hashable dataclass; public as
    ``plgpu.InterpretGPUParams`` from jax 0.11 on).

    Where the interpreter cannot run layout-pinned code itself (before ``INTERPRETER_RUNS_NATIVE``), also registers
    an identity CPU lowering for ``plgpu.layout_cast`` (a register-layout hint), so kernels that pin layouts
    (``layout_cast``, ``broadcasted_iota(..., layout=)``) run unchanged in interpret mode.
    """
    if interpreter_runs_native():
        import jax.experimental.pallas.mosaic_gpu as plgpu

        return plgpu.InterpretGPUParams()
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


# GPU interpret mode runs a kernel's own wgmma with both operands in SMEM (B transposed too: the FP8 GEMMs' K-major
# B, MLA's K^T), ``plgpu.load`` into a register layout (layouts are no-ops there) and cluster barriers from jax 0.11.2
# on (jax/_src/pallas/mosaic_gpu/interpret/jaxpr_interpret.py: wgmma_ref_p, layout_cast_p; gpu_callbacks.py: cluster
# barriers; checked on 0.11.2, the GPU machine's release). 0.10.2's interpreter rejects all three, so there the
# kernels take the same products from the same SMEM tiles with dot_general, and TMA multicast cannot be
# interpreted. Neither release runs a wgmma whose A operand is a register value, nor ``pl.run_state`` (MLA's P V
# products stay value-level in interpret mode).
INTERPRETER_RUNS_NATIVE = (0, 11, 2)


def interpreter_runs_native() -> bool:
    """Whether this jax's GPU interpret mode runs the kernels' SMEM-operand wgmmas, layout-pinned loads and cluster
    barriers themselves (from ``INTERPRETER_RUNS_NATIVE`` on)."""
    return jax.__version_info__ >= INTERPRETER_RUNS_NATIVE


def substitute_wgmma(interpret: bool) -> bool:
    """True when the kernel is interpreted by a jax whose GPU interpret mode cannot run its SMEM-operand wgmmas and
    layout-pinned loads: the kernel then takes value-level stand-ins for them."""
    return bool(interpret) and not interpreter_runs_native()


def load(ref, layout):
    """The whole of ``ref`` in register ``layout`` (``plgpu.load``; jax 0.11 deprecates the positional index that
    jax 0.10 requires, so it is passed only where the signature has no default for it)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if _load_needs_index(plgpu.load):
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


@functools.cache
def _load_needs_index(load_fn) -> bool:
    return inspect.signature(load_fn).parameters["idx"].default is inspect.Parameter.empty


HOPPER_SMS = 132  # multiprocessors of an H800/H100/H200 SXM: the grids' size when lowering without a GPU


def device_sm_count() -> int:
    """The default GPU's multiprocessors (``Device.core_count``; JAX's Hopper matmul ``get_num_sms`` and FlashMLA's
    get_mla_metadata read the same), HOPPER_SMS on a backend that is not a GPU or does not say."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return HOPPER_SMS
    return int(getattr(device, "core_count", 0) or HOPPER_SMS) if device.platform == "gpu" else HOPPER_SMS


def lower_for_cuda(fn, *args, **kwargs) -> str:
    """Lower ``fn(*args, **kwargs)`` for CUDA (no GPU needed) and return the lowered module's text."""
    lowered = jax.jit(functools.partial(fn, **kwargs)).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def has_mosaic_gpu_call(text: str) -> bool:
    """Whether lowered module text holds a Mosaic GPU kernel custom call."""
    return any(f'custom_call_target = "{t}"' in text or f"@{t}" in text for t in _MOSAIC_GPU_TARGETS)


class Launch(NamedTuple):
    """One kernel launch: grid and block in CUDA's (x, y, z) order (x is launched fastest), dynamic SMEM bytes."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int


# ``gpu.launch ... blocks(..) in (%a = %c4, %b = %c12, %c = %c1) threads(..) in (..) dynamic_shared_memory_size
# %c223280_i32``: index constants print as %c<value> (a suffix _<n> tells equal constants apart).
_DIM = r"%\w+ = %c(\d+)(?:_\d+)?"
_LAUNCH = re.compile(rf"gpu\.launch[^\n]*?blocks\([^)]*\) in \({_DIM}, {_DIM}, {_DIM}\) "
                     rf"threads\([^)]*\) in \({_DIM}, {_DIM}, {_DIM}\)"
                     rf"(?: dynamic_shared_memory_size %c(\d+)(?:_i32)?(?:_\d+)?)?")


class KernelModule(NamedTuple):
    """One Mosaic GPU kernel module: its text before serialization, and the serialized bytecode (format version 0,
    as ``jax.experimental.mosaic.gpu.core`` embeds it in the ``mosaic_gpu_v2`` custom call's ``module`` attribute)."""

    text: str
    bytecode: bytes


def kernel_modules(fn, *args, **kwargs) -> list[KernelModule]:
    """The Mosaic GPU kernel modules that lowering ``fn(*args, **kwargs)`` for cuda builds.

    Mosaic GPU builds each kernel's MLIR module in Python and serializes it in ``_run_serde_pass``
    (jax/experimental/mosaic/gpu/core.py, private): both forms are captured there."""
    from jax.experimental.mosaic.gpu import core as mgpu_core  # private: kept here only

    modules = []
    original = mgpu_core._run_serde_pass

    def capture(module, *, serialize, **kw):
        out = original(module, serialize=serialize, **kw)
        if serialize:
            buf = io.BytesIO()
            out.operation.write_bytecode(buf, desired_version=0)
            modules.append(KernelModule(str(module), buf.getvalue()))
        return out

    mgpu_core._run_serde_pass = capture
    try:
        lower_for_cuda(fn, *args, **kwargs)
    finally:
        mgpu_core._run_serde_pass = original
    return modules


def kernel_launches(fn, *args, **kwargs) -> list[Launch]:
    """The launches of the Mosaic GPU kernels that lowering ``fn(*args, **kwargs)`` for cuda builds: the
    ``gpu.launch`` op's constant grid, block and shared memory size, parsed from each ``kernel_modules`` text."""
    launches = []
    for text, _ in kernel_modules(fn, *args, **kwargs):
        for m in _LAUNCH.finditer(text):
            v = [int(x) if x is not None else 0 for x in m.groups()]
            launches.append(Launch(tuple(v[0:3]), tuple(v[3:6]), v[6]))
    return launches


def loop_bodies(text: str) -> list[list[str]]:
    """The lines of each ``scf.for`` loop's body in a kernel module's text (outer loops include their inner ones),
    found by the indentation of the loop's closing brace."""
    lines, bodies = text.splitlines(), []
    for i, line in enumerate(lines):
        if "scf.for" in line:
            indent = len(line) - len(line.lstrip())
            end = next(j for j in range(i + 1, len(lines))
                       if lines[j].strip().startswith("}") and len(lines[j]) - len(lines[j].lstrip()) == indent)
            bodies.append(lines[i + 1:end])
    return bodies
