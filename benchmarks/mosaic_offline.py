"""Compile a Mosaic GPU kernel module for sm_90a without a GPU; return what Mosaic GPU's dumps print (PTX, ptxas -v).

Why: registers, spills and ptxas's warnings decide much of a Hopper kernel's speed, and GPU time is scarce here.
Mosaic GPU compiles a kernel at run time, inside the CUDA PJRT plugin (jaxlib/mosaic/gpu/custom_call.cc:
``CompileAndInit`` -> ``Compile`` -> ``DumpCompilationOutput``), and the plugin exports that path as
``MosaicGpuCompile(const char *module, int size)``. It needs a CUDA device only to read the compute capability
(``cuCtxGetDevice``, ``cuDeviceGetAttribute``), and CUDA's toolkit (ptxas) to assemble. So this module:

- builds a stand-in libcuda.so.1 (C source below, compiled with the system's cc) that reports one sm_90 device
  and nothing else; the plugin dlopens libcuda, so LD_LIBRARY_PATH puts the stand-in first;
- loads the plugin's xla_cuda_plugin.so (from a jax-cuda12-pjrt or jax-cuda13-pjrt wheel of the *same* version as
  the installed jaxlib, since the module's serialization format is versioned with it) in a child process;
- registers LLVM's NVPTX target, which the plugin registers elsewhere on its normal path (its non-exported
  ``LLVMInitializeNVPTX*`` functions, located with ``nm``), then calls ``MosaicGpuCompile`` with
  MOSAIC_GPU_DUMP_PTX / MOSAIC_GPU_DUMP_PTXAS set. The dumps come out before the host-side JIT, which then fails
  for want of Mosaic GPU's runtime library; nothing is launched.

Kernel modules come from ``_mosaic.kernel_modules`` (lowering for cuda on CPU). benchmarks/kernels_ptxas.py
--offline uses this for its whole report. Needs: cc, nm, a CUDA toolkit with bin/ptxas (--cuda-root; default
$CUDA_HOME or /usr/local/cuda), and the wheel, e.g.
    pip download --no-deps -d /tmp/wheels "jax-cuda12-pjrt==$(python -c 'import jaxlib; print(jaxlib.__version__)')"
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

FAKE_LIBCUDA_C = r"""
/* A stand-in for the CUDA driver: enough for Mosaic GPU's compile path to take this machine for one sm_90 device
   (benchmarks/mosaic_offline.py). Constants from cuda.h: CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
   _MINOR = 76, MULTIPROCESSOR_COUNT = 16; CUDA_ERROR_NOT_FOUND = 500. */
#include <string.h>
typedef int CUresult;
typedef int CUdevice;
CUresult cuInit(unsigned int flags) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12090; return 0; }
CUresult cuCtxGetDevice(CUdevice *d) { *d = 0; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attrib, CUdevice d) {
  *v = attrib == 75 ? 9 : attrib == 76 ? 0 : attrib == 16 ? 132 : 0;
  return 0;
}
static void *lookup(const char *name) {
  if (!strcmp(name, "cuInit")) return (void *)cuInit;
  if (!strcmp(name, "cuDriverGetVersion")) return (void *)cuDriverGetVersion;
  if (!strcmp(name, "cuCtxGetDevice")) return (void *)cuCtxGetDevice;
  if (!strcmp(name, "cuDeviceGetAttribute")) return (void *)cuDeviceGetAttribute;
  return 0;
}
CUresult cuGetProcAddress(const char *name, void **fn, int ver, unsigned long long flags) {
  *fn = lookup(name);
  return *fn ? 0 : 500;
}
CUresult cuGetProcAddress_v2(const char *name, void **fn, int ver, unsigned long long flags, int *status) {
  *fn = lookup(name);
  if (status) *status = *fn ? 0 : 1;
  return *fn ? 0 : 500;
}
"""

_NVPTX_INIT = ("LLVMInitializeNVPTXTargetInfo", "LLVMInitializeNVPTXTarget", "LLVMInitializeNVPTXTargetMC",
               "LLVMInitializeNVPTXAsmPrinter")
_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxinfer", "mosaic_offline")


class OfflineError(RuntimeError):
    """What is missing for an offline compile (a tool, the wheel, a version match), said plainly."""


def default_cuda_root() -> str | None:
    """$CUDA_HOME / $CUDA_PATH, else /usr/local/cuda: the first that holds bin/ptxas."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", "ptxas")):
            return root
    return None


def plugin_path(path: str) -> str:
    """xla_cuda_plugin.so from a jax-cuda*-pjrt wheel (extracted once into ~/.cache/jaxinfer/mosaic_offline, about
    0.5 GB per wheel) or given directly. A wheel's version must equal the installed jaxlib's (OfflineError
    otherwise)."""
    if not os.path.exists(path):
        raise OfflineError(f"no such plugin or wheel: {path}")
    if not path.endswith(".whl"):
        return path
    import jaxlib

    name = os.path.basename(path)
    m = re.match(r"jax_cuda\d+_pjrt-([^-]+)-", name)
    if not m:
        raise OfflineError(f"{name} is not a jax-cuda12-pjrt / jax-cuda13-pjrt wheel")
    if m.group(1) != jaxlib.__version__:
        raise OfflineError(f"{name} is version {m.group(1)} but jaxlib is {jaxlib.__version__}: Mosaic GPU's module "
                           f"format is versioned with jaxlib, so download jax-cuda12-pjrt=={jaxlib.__version__}")
    out = os.path.join(_CACHE, name[:-4])
    so = glob.glob(os.path.join(out, "jax_plugins", "*", "xla_cuda_plugin.so"))
    if not so:
        with zipfile.ZipFile(path) as z:
            members = [n for n in z.namelist() if n.endswith("/xla_cuda_plugin.so")]
            if not members:
                raise OfflineError(f"{name} holds no xla_cuda_plugin.so")
            z.extract(members[0], out)
        so = glob.glob(os.path.join(out, "jax_plugins", "*", "xla_cuda_plugin.so"))
    return so[0]


@functools.cache
def fake_libcuda_dir() -> str:
    """A directory holding the stand-in libcuda.so.1, built once (per source) with the system's C compiler."""
    d = os.path.join(_CACHE, f"fake_libcuda-{hashlib.sha256(FAKE_LIBCUDA_C.encode()).hexdigest()[:12]}")
    if os.path.exists(os.path.join(d, "libcuda.so.1")):
        return d
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise OfflineError("a C compiler (cc, gcc or clang) is needed to build the stand-in libcuda.so.1")
    os.makedirs(d, exist_ok=True)
    src = os.path.join(d, "fake_libcuda.c")
    with open(src, "w") as f:
        f.write(FAKE_LIBCUDA_C)
    tmp = os.path.join(d, f"libcuda.so.1.{os.getpid()}")
    subprocess.run([cc, "-shared", "-fPIC", "-o", tmp, src], check=True)
    os.replace(tmp, os.path.join(d, "libcuda.so.1"))   # atomic: a concurrent run sees all of it or nothing
    return d


def compile_module(bytecode: bytes, plugin: str, cuda_root: str | None = None, dumps=None,
                   timeout: float = 300) -> str:
    """Compile one serialized Mosaic GPU module (``_mosaic.kernel_modules(...)[i].bytecode``) for sm_90a in a child
    process; returns what the MOSAIC_GPU_DUMP_<dumps> printed (stdout and stderr). dumps None: PTX and PTXAS, and
    SASS where the toolkit has bin/nvdisasm (Mosaic GPU runs <cuda_root>/bin/nvdisasm on ptxas's cubin)."""
    cuda_root = cuda_root or default_cuda_root()
    if cuda_root is None or not os.path.exists(os.path.join(cuda_root, "bin", "ptxas")):
        raise OfflineError(f"no CUDA toolkit with bin/ptxas at {cuda_root!r} (set --cuda-root or $CUDA_HOME)")
    if dumps is None:
        dumps = ("PTX", "PTXAS") + (("SASS",) if os.path.exists(os.path.join(cuda_root, "bin", "nvdisasm")) else ())
    if shutil.which("nm") is None:
        raise OfflineError("nm (binutils) is needed to find the plugin's NVPTX target initializers")
    plugin = plugin_path(plugin)
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        [fake_libcuda_dir()] + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]),
        MOSAIC_GPU_CUDA_ROOT=cuda_root)
    for name in dumps:
        env[f"MOSAIC_GPU_DUMP_{name}"] = "1"
    with tempfile.NamedTemporaryFile(suffix=".mlirbc", delete=False) as f:
        f.write(bytecode)
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), plugin, f.name], env=env,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(f.name)
    return proc.stdout + proc.stderr


def _child(plugin: str, module_path: str) -> None:
    """In the child: load the plugin, register NVPTX, call MosaicGpuCompile (module docstring)."""
    lib = ctypes.CDLL(plugin)
    wanted = {"MosaicGpuCompile", *_NVPTX_INIT}
    offsets = {}
    for line in subprocess.run(["nm", plugin], capture_output=True, text=True, check=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] in wanted:
            offsets[parts[2]] = int(parts[0], 16)
    missing = wanted - offsets.keys()
    if missing:
        raise SystemExit(f"mosaic_offline: {plugin} has no symbols {sorted(missing)}")
    base = ctypes.cast(lib.MosaicGpuCompile, ctypes.c_void_p).value - offsets["MosaicGpuCompile"]
    for name in _NVPTX_INIT:
        ctypes.CFUNCTYPE(None)(base + offsets[name])()
    lib.MosaicGpuCompile.restype = ctypes.c_void_p
    lib.MosaicGpuCompile.argtypes = [ctypes.c_char_p, ctypes.c_int]
    with open(module_path, "rb") as f:
        module = f.read()
    lib.MosaicGpuCompile(module, len(module))   # NULL: the host JIT lacks Mosaic GPU's runtime; dumps are out
    sys.stdout.flush()
    ctypes.CDLL(None).fflush(None)


if __name__ == "__main__":
    _child(*sys.argv[1:3])
