"""What ptxas makes of each Mosaic GPU kernel: registers, spills, its warnings, the SASS mix and the loop's spills.

    PYTHONPATH=. python benchmarks/kernels_ptxas.py [--out ptxas.txt] [--cases all|fp8|mla] [--keep DIR]
        [--only LABEL_PART]... [--no-dump] [--offline PJRT_WHEEL [--cuda-root DIR]]

Why: registers and spills decide much of a Hopper kernel's speed, and arithmetic alone only infers them (a 128 x 128
tile in one warpgroup spills); this report shows such things directly. For every kernel configuration the entries
ship at the benchmarks' goal shapes: one line per kernel with its registers per thread, spill stores and loads,
stack frame, ptxas's warnings (a "wgmma ... serialized" warning means the tensor core waits for every wgmma); counts
of the SASS instructions that matter here: HGMMA / QGMMA (bf16 / fp8 wgmma, with their shapes), local memory
(LDL/STL: spills), shared memory (LDS/STS), TMA (UTMALDG/UTMASTG), barriers (SYNCS, BAR), FFMA/FMUL/FADD (the
promotion and softmax arithmetic); and for each innermost loop that holds a wgmma (the k-step or page loop) its size
and the spill reloads (LDL) and stores (STL) it pays per iteration.

How: Mosaic GPU runs ``ptxas -v`` and ``nvdisasm`` on each kernel it compiles when MOSAIC_GPU_DUMP_PTXAS and
MOSAIC_GPU_DUMP_SASS are set, and prints both (and the PTX, MOSAIC_GPU_DUMP_PTX) to the process's stdout
(jaxlib/mosaic/gpu/custom_call.cc, ``DumpCompilationOutput``).
- On a CUDA GPU this script sets them, compiles and runs each configuration once with file descriptors 1 and 2
  redirected to a file, and parses what was written. Where Mosaic GPU's own ptxas call failed (it looks under the
  CUDA root it found), the dumped PTX is fed to the ptxas on PATH or in /usr/local/cuda/bin instead.
- --offline needs no GPU: each configuration is lowered for cuda on CPU and its kernel module compiled by the CUDA
  PJRT plugin of the same jaxlib version with a local CUDA toolkit's ptxas (mosaic_offline.py).
Elsewhere, without --offline, it says so and reports nothing. Each configuration is guarded, so one failure does
not stop the rest. --keep DIR saves each configuration's raw dump there; --only picks configurations by label;
--no-dump runs each picked one once with nothing dumped, for a profiler (scripts/gpu_check.sh runs ncu on it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import functools
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmark scripts

DUMP_ENV = ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS")
# SASS opcode families reported (first dot-separated part of the opcode), in this order.
FAMILIES = ("HGMMA", "QGMMA", "WARPGROUP", "LDL", "STL", "LDS", "STS", "LDSM", "STSM", "LDG", "STG", "UTMALDG",
            "UTMASTG", "SYNCS", "BAR", "FFMA", "FMUL", "FADD", "MUFU", "F2FP", "SHFL")


# ----------------------------------------------------------------------------------------------- parsing
@dataclasses.dataclass
class Entry:
    """One kernel function as ptxas -v reports it."""

    name: str
    registers: int | None = None
    stack: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    barriers: int | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)


_COMPILING = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")
_WARNING = re.compile(r"ptxas.*?warning\s*:\s*(.*)")


def parse_ptxas(text: str) -> list[Entry]:
    """The entries of ``ptxas -v`` output (format of CUDA 12/13's ptxas: "Compiling entry function 'f' for
    'sm_90a'", "N bytes stack frame, N bytes spill stores, N bytes spill loads", "Used N registers, used N
    barriers, ..."). Warnings are attached to the entry compiled last before them (to the first one if earlier)."""
    entries: list[Entry] = []
    pending: list[str] = []
    for line in text.splitlines():
        if m := _COMPILING.search(line):
            entries.append(Entry(m.group(1), warnings=pending))
            pending = []
        elif m := _PROPS.search(line):
            if entries:
                e = entries[-1]
                e.stack, e.spill_stores, e.spill_loads = map(int, m.groups())
        elif m := _USED.search(line):
            if entries:
                entries[-1].registers = int(m.group(1))
                entries[-1].barriers = int(m.group(2)) if m.group(2) else None
        elif m := _WARNING.search(line):
            (entries[-1].warnings if entries else pending).append(m.group(1).strip())
    if pending and entries:
        entries[0].warnings.extend(pending)
    return entries


# nvdisasm lines: "        /*0a30*/  @!P0 HGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0 ;  /* 0x... */"
_SASS = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def sass_counts(text: str) -> tuple[collections.Counter, collections.Counter, int]:
    """(count per opcode family, count per full wgmma opcode (HGMMA, QGMMA, IGMMA), total instructions) of
    nvdisasm output."""
    families: collections.Counter = collections.Counter()
    hgmma: collections.Counter = collections.Counter()
    total = 0
    for m in _SASS.finditer(text):
        op = m.group(1)
        total += 1
        families[op.split(".")[0]] += 1
        if op[1:].startswith("GMMA"):   # HGMMA (16-bit inputs), QGMMA (fp8), IGMMA (int8)
            hgmma[op] += 1
    return families, hgmma, total


_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_BRANCH = re.compile(r"@!?U?P[T0-9]+\s+BRA `\(\.(L_x_\d+)\)")   # conditional: a loop's back edge
_WGMMA = re.compile(r"\s[HQI]GMMA\.")
_LOCAL = re.compile(r"\s(LDL|STL)[\s.]")


def wgmma_loops(text: str) -> list[tuple[int, int, int, int, int]]:
    """The innermost loops of nvdisasm output that hold a wgmma (the kernels' k-step / page loops): (first address,
    last address, instructions, LDL, STL) per loop, from each conditional backward branch whose body holds an
    HGMMA/QGMMA/IGMMA and no other such loop. (ptxas places mbarrier retry loops out of line and jumps back from
    them unconditionally; those jumps are not loops.) Local loads and stores inside such a loop are spills paid
    every iteration."""
    instrs, labels, pending = [], {}, []
    for line in text.splitlines():
        if m := _LABEL.match(line):
            pending.append(m.group(1))
        elif (m := _ADDR.search(line)) and not line.strip().startswith("/* 0x"):
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append((addr, line))
    loops = []
    for addr, line in instrs:
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), addr + 1) <= addr:
            lo = labels[m.group(1)]
            body = [ln for a, ln in instrs if lo <= a <= addr]
            if any(_WGMMA.search(ln) for ln in body):
                kinds = [k.group(1) for ln in body if (k := _LOCAL.search(ln))]
                loops.append((lo, addr, len(body), kinds.count("LDL"), kinds.count("STL")))
    return [x for x in loops if not any(y != x and x[0] <= y[0] and y[1] <= x[1] for y in loops)]


_PTX_START = "// Generated by LLVM NVPTX Back-End"
_PTX_END = re.compile(r"^(ptxas|nvdisasm|\s*\.headerflags|\s*//-+ \.|\s*\.section)", re.M)


def extract_ptx(text: str) -> list[str]:
    """The PTX modules printed in ``text`` (MOSAIC_GPU_DUMP_PTX): from each "// Generated by LLVM NVPTX Back-End"
    banner to the next ptxas / nvdisasm output or the next module."""
    out = []
    starts = [m.start() for m in re.finditer(re.escape(_PTX_START), text)]
    for i, s in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else len(text)
        chunk = text[s:stop]
        if m := _PTX_END.search(chunk):
            chunk = chunk[:m.start()]
        out.append("//\n" + chunk.rstrip() + "\n")
    return out


def system_ptxas() -> str | None:
    """A ptxas to run ourselves: on PATH, else under /usr/local/cuda."""
    fallback = "/usr/local/cuda/bin/ptxas"
    return shutil.which("ptxas") or (fallback if os.path.exists(fallback) else None)


def run_ptxas(ptx: str, ptxas: str, arch: str = "sm_90a") -> str:
    """``ptxas -v`` on one PTX module (output discarded), its report as text."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-v", "--opt-level", "3", "--gpu-name", arch, "--output-file",
                               os.path.join(d, "kernel.o"), src], capture_output=True, text=True, timeout=120)
        return proc.stdout + proc.stderr


def summarize(label: str, dump: str, ptxas: str | None = None) -> list[str]:
    """Report lines of one configuration from its captured dump (module docstring)."""
    entries = parse_ptxas(dump)
    source = "Mosaic GPU's ptxas -v"
    if not any(e.registers is not None for e in entries) and ptxas:
        reports = [run_ptxas(ptx, ptxas) for ptx in extract_ptx(dump)]
        entries = [e for r in reports for e in parse_ptxas(r)]
        source = f"{ptxas} -v on the dumped PTX"
    lines = []
    if not entries:
        failures = [ln.strip() for ln in dump.splitlines() if "fail" in ln.lower() or "error" in ln.lower()]
        lines.append(f"{label}: no ptxas report ({len(extract_ptx(dump))} PTX modules dumped)"
                     + (f"; {' | '.join(failures[:3])[:400]}" if failures else ""))
    for e in entries:
        lines.append(f"{label}: {e.name}: {e.registers} registers, spill stores {e.spill_stores} B, spill loads "
                     f"{e.spill_loads} B, stack {e.stack} B, barriers {e.barriers} ({source})")
        lines.extend(f"    warning: {w}" for w in e.warnings if not w.startswith("Registers are spilled"))
    families, hgmma, total = sass_counts(dump)
    if total:
        mix = ", ".join(f"{f} {families[f]}" for f in FAMILIES if families[f])
        shapes = ", ".join(f"{op} x{c}" for op, c in sorted(hgmma.items()))
        lines.append(f"    SASS: {total} instructions: {mix}" + (f"; {shapes}" if shapes else ""))
        lines.extend(f"    wgmma loop {lo:#x}-{hi:#x}: {n} instructions, {ldl} LDL + {stl} STL per iteration"
                     for lo, hi, n, ldl, stl in wgmma_loops(dump))
    else:
        lines.append("    SASS: none dumped")
    return lines


@contextlib.contextmanager
def captured_fds(path: str):
    """Redirect file descriptors 1 and 2 (Python's and C++'s stdout/stderr alike) into ``path`` for the block."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    sys.stderr.flush()
    libc.fflush(None)
    saved = os.dup(1), os.dup(2)
    try:
        with open(path, "wb") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                libc.fflush(None)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


# ----------------------------------------------------------------------------------------------- cases
def fp8_cases():
    """(label, jitted fn, make_ops) per distinct (entry, kernel, tiling) the FP8 benchmark's compare cases run by
    default (kernels_fp8.COMPARE: m = 4096 x DeepGEMM's six (n, k), a decode shape, one of each grouped layout),
    plus multicast=2 on the headline shape. make_ops() builds the operands."""
    import kernels_fp8

    seen, out = set(), []
    # deepest k first, so the shape kept for a tiling is the one whose main loop runs longest (the headline
    # m=4096 n=7168 k=16384 for the default tilings)
    cases = [(kind, shape, kernel, {}) for kind in ("dense", "contiguous", "masked")
             for shape in sorted(kernels_fp8.COMPARE[kind], key=lambda s: -s[-1]) for kernel in kernels_fp8.KERNELS]
    cases.append(("dense", (4096, 7168, 2048), "warp_specialized", dict(multicast=2)))
    for kind, shape, kernel, knobs in cases:
        tiling = kernels_fp8._tiling_label(kind, shape, kernel, knobs)
        key = (kind if kind == "dense" else "grouped", kernel, tiling)
        if key in seen:
            continue
        seen.add(key)
        # interpret=False: the native kernel also where this runs on CPU (--offline lowers it for cuda)
        _, f, make_ops, _, _ = kernels_fp8._case(kind, shape, "pallas", kernel, dict(knobs, interpret=False))
        out.append((f"fp8 {kind} {shape} [{kernel}]{tiling}", f, make_ops))
    return out


def mla_cases():
    """(label, jitted fn, make_ops) for both MLA decode kernels at b=128 s_k=4096: h_q 16 s_q 1 and h_q 128 s_q 2
    causal."""
    import jax

    import kernels_mla
    from kernels_pallas import mla_decode
    from kernels_pallas.mla import KERNELS

    out = []
    for h_q, s_q in ((16, 1), (128, 2)):
        for kernel in KERNELS:
            f = jax.jit(functools.partial(mla_decode, head_dim_v=kernels_mla.DV, causal=s_q > 1,
                                          implementation="pallas", interpret=False, kernel=kernel))
            out.append((f"mla b=128 s_k=4096 h_q={h_q} s_q={s_q} kernel={kernel}", f,
                        functools.partial(lambda h, s: kernels_mla.make_inputs(128, 4096, h, s, False)[0], h_q, s_q)))
    return out


def dump_on_gpu(f, make_ops) -> str:
    """Compile (with the dumps) and run f once on this GPU, fds 1 and 2 captured into a file; returns the dump."""
    import jax

    ops = make_ops()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.dump")
        with captured_fds(path):
            jax.block_until_ready(f(*ops))
        with open(path, errors="replace") as fh:
            return fh.read()


def dump_offline(f, make_ops, plugin: str, cuda_root: str | None) -> str:
    """Lower f for cuda on its operands' shapes (traced with eval_shape, never built) and compile each Mosaic GPU
    module with the plugin, no GPU needed (mosaic_offline.py); returns the dumps."""
    import jax

    import mosaic_offline
    from kernels_pallas import _mosaic

    specs = jax.eval_shape(make_ops)
    modules = _mosaic.kernel_modules(f, *specs)
    if not modules:
        raise RuntimeError("lowering built no Mosaic GPU kernel (an XLA or interpret-mode path?)")
    return "".join(mosaic_offline.compile_module(m.bytecode, plugin, cuda_root) for m in modules)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="append the report to this file")
    p.add_argument("--cases", default="all", choices=("all", "fp8", "mla"))
    p.add_argument("--keep", default=None, help="save each configuration's raw dump (PTX, ptxas, SASS) here")
    p.add_argument("--only", action="append", default=None,
                   help="a label substring (repeatable): run only the configurations whose label holds one")
    p.add_argument("--no-dump", action="store_true",
                   help="run each configuration once without the dumps or the report, e.g. under a profiler (ncu)")
    p.add_argument("--offline", metavar="PJRT_WHEEL_OR_SO", default=None,
                   help="no GPU: compile with this jax-cuda12/13-pjrt wheel's plugin (same version as jaxlib) and "
                        "a local CUDA toolkit's ptxas (mosaic_offline.py)")
    p.add_argument("--cuda-root", default=None,
                   help="--offline: the CUDA toolkit (default $CUDA_HOME, /usr/local/cuda)")
    args = p.parse_args(argv)
    if not args.no_dump and not args.offline:
        for name in DUMP_ENV:   # read by Mosaic GPU at each kernel compile (getenv), so setting them here suffices
            os.environ[name] = "1"

    import jax

    import mosaic_offline

    jax.config.update("jax_enable_compilation_cache", False)   # a cached executable would skip the compile
    out = open(args.out, "a") if args.out else None

    def emit(line: str) -> None:
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    dev = jax.devices()[0]
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.offline:
        cuda_root = args.cuda_root or mosaic_offline.default_cuda_root()
        ptxas = os.path.join(cuda_root or "?", "bin", "ptxas")
        version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines() \
            if os.path.exists(ptxas) else ["missing"]
        emit(f"# ptxas report {stamp} offline (no GPU; sm_90a): plugin {os.path.basename(args.offline)}, "
             f"jax={jax.__version__}, ptxas {ptxas}: {version[-1]}")
    else:
        emit(f"# ptxas report {stamp} device={dev.device_kind} jax={jax.__version__}; ptxas for the fallback: "
             f"{system_ptxas()}")
        if dev.platform != "gpu":
            emit("no GPU: Mosaic GPU compiles kernels for the device it runs on; nothing was reported "
                 "(--offline compiles without one)")
            return 0
    cases = (fp8_cases() if args.cases in ("all", "fp8") else []) + (mla_cases() if args.cases in ("all", "mla")
                                                                       else [])
    if args.only:
        cases = [case for case in cases if any(w in case[0] for w in args.only)]
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    failed = 0
    for i, (label, f, make_ops) in enumerate(cases):
        try:
            if args.no_dump:
                jax.block_until_ready(f(*make_ops()))
                emit(f"{label}: ran once")
                continue
            if args.offline:
                dump = dump_offline(f, make_ops, args.offline, args.cuda_root)
            else:
                dump = dump_on_gpu(f, make_ops)
            if args.keep:
                with open(os.path.join(args.keep, f"case{i:02d}.dump"), "w") as fh:
                    fh.write(dump)
            for line in summarize(label, dump, None if args.offline else system_ptxas()):
                emit(line)
        except Exception as e:  # noqa: BLE001 - one failing configuration must not stop the rest
            failed += 1
            emit(f"{label}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    if out is not None:
        out.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
