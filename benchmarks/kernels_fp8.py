"""FP8 GEMM benchmarks on DeepGEMM's shapes, with DeepGEMM's published H800 figures printed beside ours.

Metric (DeepGEMM README / tests): TFLOPS = 2 * m * n * k / t (grouped: m = valid rows over all groups).
Dense shapes: m in (64, 128, 4096) x (n, k) in DeepGEMM's six pairs; published H800 TFLOPS at m = 4096 from
docs/architecture.md ("DeepGEMM FP8 contract", README early 2025). Grouped: contiguous (groups x m_per_group) and
masked (groups x expected rows) on DeepGEMM's test shapes; the contract gives only the published range ~1200-1350.
Needs a CUDA GPU; elsewhere it says so and measures nothing. Each case (shape x kernel variant) is guarded so one
failure does not stop the rest; results (with date and device) are appended to --out, one line per case, tagged
with the kernel variant (fp8_gemm ``kernel=``: "pipelined" | "warp_specialized") when it is the Pallas path.

--kernel both runs the two variants side by side (adjacent lines per shape); --cases compare restricts the sweep to
the goal shapes (m = 4096 x DeepGEMM's six (n, k), whose published figures are the target) plus a decode-sized and
one of each grouped layout (scripts/gpu_check.sh uses it to keep the device run short); --cases tuning to two dense
shapes (m=4096 n=7168 k=16384, n=2112 k=7168) for a --tilings sweep. --tilings BMxBNxST[,...] times each of these
explicit tilings (block_m x block_n x stages) per kernel instead of the defaults, for tuning on a GPU; a tiling a
kernel rejects prints its ValueError. --multicast adds a line with multicast=2 (DeepGEMM's TMA multicast of A over
CTA pairs) per warp_specialized case. Every line names the tiling that ran (kernels_pallas/fp8/tiling.py picks the
defaults). Timing: the median over 5 repeats of (20 back-to-back calls, one sync) / 20, so the host's dispatch
overlaps the device's work.
--breakdown (after the cases) times each kernel's two probes beside it on the headline shape (``breakdown_case``;
``PROBES``: the kernels' accumulation hook replaced): "mma" (DeepGEMM's promotion taken out: a plain FP8 GEMM with
the same producer, ring and tiles) and "stream" (all compute taken out: the TMA feed alone). Kernel near mma: the
promotion is hidden; mma near stream: the feed bounds it; both far above the kernel: their overlap does not happen.
--cases compare then times XLA's own GEMMs (cuBLAS: bf16, and e4m3 without block scales) on the goal shapes, as the
ceiling this GPU gives, and JAX's own Pallas Hopper matmul in bf16, as the ceiling a Pallas kernel reaches here
(``ceilings``).

  PYTHONPATH=. python benchmarks/kernels_fp8.py --out bench_fp8.txt [--implementation pallas|xla]
      [--kernel pipelined|warp_specialized|both] [--cases all|compare] [--tilings 64x128x3,128x128x5] [--multicast]
      [--breakdown]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kernels_pallas import fp8_gemm, fp8_grouped_gemm_contiguous, fp8_grouped_gemm_masked
from kernels_pallas.common import cdiv
from kernels_pallas.fp8 import tiling as fp8_tiling
from kernels_pallas.fp8.pallas_common import PROMOTED, Accumulation, num_sms, zero_acc
from kernels_pallas.fp8.warp_specialized import TILE_BAND

NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
PUBLISHED_M4096 = dict(zip(NK, [1058, 990, 590, 1358, 1304, 1025]))  # H800 TFLOPS, DeepGEMM's README
DENSE_M = (64, 128, 4096)
CONTIGUOUS = [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168), (8, 4096, 7168, 2048)]
MASKED = [(g, m, n, k) for g, m in ((1, 1024), (2, 512), (4, 256)) for n, k in ((4096, 7168), (7168, 2048))]
GROUPED_PUBLISHED = "~1200-1350 (DeepGEMM's README, grouped)"
# --cases compare: the headline dense shape, a wide-n and a decode-sized one, one of each grouped layout.
COMPARE = dict(dense=[(4096, n, k) for n, k in NK] + [(64, 7168, 16384)],
               contiguous=[(4, 8192, 4096, 7168)], masked=[(4, 256, 4096, 7168)])
# --cases tuning: the shapes a tiling sweep (--tilings) runs on: the largest published figure and the odd n.
TUNING = [(4096, 7168, 16384), (4096, 2112, 7168)]
# --breakdown: the shape whose kernels and probes it times (the largest published figure, 1358 TFLOPS).
BREAKDOWN_SHAPE = (4096, 7168, 16384)
KERNELS = ("pipelined", "warp_specialized")


def _fp8(key, shape):
    return (jax.random.normal(key, shape, jnp.float32) * 8).astype(jnp.float8_e4m3fn)


def _scales(key, shape):
    return jax.random.uniform(key, shape, jnp.float32, 0.5, 2.0) / 448.0


def time_per_call(fn, *args, iters: int = 20, repeats: int = 5) -> float:
    """Seconds per call of a jitted fn (after compile + warmup): median over repeats of iters back-to-back calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def _operands(m_shape, g, n, k):
    ks = jax.random.split(jax.random.key(0), 4)
    kb, nb = -(-k // 128), -(-n // 128)
    a = _fp8(ks[0], (*m_shape, k))
    a_s = _scales(ks[1], (*m_shape, kb))
    b = _fp8(ks[2], (*g, n, k))
    b_s = _scales(ks[3], (*g, nb, kb))
    return a, a_s, b, b_s


def _cases(which: str):
    """(kind, shape) per benchmark case: dense (m, n, k); contiguous / masked (groups, m per group, n, k)."""
    if which == "compare":
        return [(kind, shape) for kind in ("dense", "contiguous", "masked") for shape in COMPARE[kind]]
    if which == "tuning":
        return [("dense", shape) for shape in TUNING]
    dense = [(m, n, k) for m in DENSE_M for n, k in NK]
    return ([("dense", x) for x in dense] + [("contiguous", x) for x in CONTIGUOUS]
            + [("masked", x) for x in MASKED])


def _tiling_label(kind: str, shape, kernel: str | None, knobs: dict) -> str:
    """The tiling the entry runs for this case (its defaults filled as the entry fills them)."""
    if kernel is None:
        return ""
    rows, n = (shape[0], shape[1]) if kind == "dense" else (shape[0] * shape[1], shape[2])
    k_steps = cdiv(shape[-1], fp8_tiling.BLOCK_K)
    t = fp8_tiling.resolve(kernel, knobs.get("block_m"), knobs.get("block_n"), 128, knobs.get("stages"), rows=rows,
                           n=n, num_sms=num_sms(False), out_itemsize=2, multicast=knobs.get("multicast", 1),
                           k_steps=k_steps)
    chained = kernel == "warp_specialized" and fp8_tiling.chains_tiles(k_steps, t.stages)
    return (f" tiling {t.block_m}x{t.block_n}x{t.stages}" + (" multicast 2" if t.multicast == 2 else "")
            + (" chained" if chained else ""))


def _case(kind: str, shape, implementation: str, kernel: str | None, tiling: dict):
    """-> (name, jitted fn, make_ops, flops, published figure) of one benchmark case; make_ops() builds the operands
    (kernels_ptxas.py --offline only traces it, with jax.eval_shape)."""
    knobs = dict(implementation=implementation) | ({} if kernel is None else dict(kernel=kernel, **tiling))
    if kind == "dense":
        m, n, k = shape
        pub = PUBLISHED_M4096.get((n, k)) if m == 4096 else None
        f = jax.jit(lambda *x: fp8_gemm(*x, **knobs))
        return f"dense m={m} n={n} k={k}", f, lambda: _operands((m,), (), n, k), 2 * m * n * k, pub or "-"
    g, mg, n, k = shape
    if kind == "contiguous":
        def make_ops():
            return (*_operands((g * mg,), (g,), n, k), jnp.repeat(jnp.arange(g, dtype=jnp.int32), mg))
        f = jax.jit(lambda *x: fp8_grouped_gemm_contiguous(*x, **knobs))
        name = f"contiguous groups={g} m_per_group={mg} n={n} k={k}"
    else:
        def make_ops():
            return (*_operands((g, mg), (g,), n, k), jnp.full((g,), mg, jnp.int32))
        f = jax.jit(lambda *x: fp8_grouped_gemm_masked(*x, **knobs))
        name = f"masked groups={g} m={mg} n={n} k={k}"
    return name, f, make_ops, 2 * g * mg * n * k, GROUPED_PUBLISHED


def parse_tilings(text: str | None) -> list[dict]:
    """"64x128x3,128x128x5" -> [dict(block_m=64, block_n=128, stages=3), ...]; None -> [{}] (the defaults)."""
    if not text:
        return [{}]
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--tilings: {item!r} is not BLOCK_MxBLOCK_NxSTAGES (e.g. 64x128x3)")
        out.append(dict(zip(("block_m", "block_n", "stages"), map(int, parts))))
    return out


def ceilings(emit) -> None:
    """The device's XLA (cuBLAS) GEMMs on the goal shapes, as context for the kernels' figures: bf16 x bf16 and
  e4m3 x e4m3 with no block scales (both -> bf16), then JAX's Pallas Hopper matmul in bf16
  (``pallas_matmul_ceiling``). Not the contract, only what the library gives on this GPU."""
    for n, k in NK:
        m = 4096
        for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
            name = f"ceiling dense m={m} n={n} k={k} XLA dot {jnp.dtype(dtype).name}"
            try:
                a, _, b, _ = _operands((m,), (), n, k)
                a, b = a.astype(dtype), b.astype(dtype)
                f = jax.jit(lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                         preferred_element_type=jnp.bfloat16))
                t = time_per_call(f, a, b)
                emit(f"{name}: {t * 1e6:9.1f} us {2 * m * n * k / t / 1e12:7.1f} TFLOPS")
            except Exception as e:  # noqa: BLE001 - one failing case must not stop the sweep
                emit(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}")
        name = f"ceiling dense m={m} n={n} k={k} JAX Pallas Hopper matmul bfloat16"
        try:
            f, label = pallas_matmul_ceiling(m, n, k)
            a, _, b, _ = _operands((m,), (), n, k)
            t = time_per_call(f, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16).T)          # a (m, k), b (k, n)
            emit(f"{name} ({label}): {t * 1e6:9.1f} us {2 * m * n * k / t / 1e12:7.1f} TFLOPS")
        except Exception as e:  # noqa: BLE001 - one failing case must not stop the sweep
            emit(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}")


def pallas_matmul_ceiling(m: int, n: int, k: int):
    """-> (jitted bf16 a [m, k] @ b [k, n], its tiling in words): JAX's own warp-specialized Pallas Mosaic GPU matmul
  (jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py, by JAX's authors), in the tiling its module's tuning loop
  tries first (two consumer warpgroups of 128 x 128, k-steps of 64, 4 stages, 229440 bytes of SMEM when lowered for
  cuda), a CTA of 128 x 256 where n allows (else 256 x 128 or 256 x 64). What a Pallas kernel reaches on this GPU
  and jax, without FP8 or block scales: if ours stay far below it, the gap is in our kernels; if it is low too, in
  what Pallas makes of a Hopper GEMM. Its module imports absl (jax's test_util); the GPU machine has it with optax."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    wg, tile_n = hm.MatmulDimension.N, 128
    if n % 256:
        wg, tile_n = hm.MatmulDimension.M, (128 if n % 128 == 0 else 64)
    cfg = hm.TuningConfig(tile_m=128, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                          grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=TILE_BAND, wg_dimension=wg)
    cta = f"{128 * (1 + (wg == hm.MatmulDimension.M))}x{tile_n * (1 + (wg == hm.MatmulDimension.N))}"
    return jax.jit(lambda a, b: hm.matmul(a, b, None, cfg)), f"CTA {cta}, k-step 64, 4 stages"


# Benchmark probes (--breakdown): both FP8 kernels with part of their work taken out through their accumulation hook
# (kernels_pallas/fp8/pallas_common.py ``Accumulation``), so that a GPU run can tell what bounds a kernel without a
# profiler's counters (which gVisor does not give: kernels_mla.py's probes do the same for MLA decode).
# - "mma": DeepGEMM's promotion taken out. The wgmma accumulates the unscaled product into one accumulator over all
#   k-steps (D = A @ B^T, no scales read, no per-step wait for a fresh accumulator or register FMA): the kernel as
#   a plain FP8 GEMM with the same producer, ring and tiles. Kernel near it: the promotion is hidden.
# - "stream": every k-step's compute taken out. The consumers release each stage as soon as it lands (D = 0): the
#   producer and the ring alone, i.e. how fast TMA fills SMEM with this tiling. mma near it: the feed bounds it.
def _zero_tile(run, shape, *, sim):
    return run(zero_acc(shape, sim=sim, chunked=False))


def _mma_tile(run, shape, *, sim):   # the wgmma's own ACC ref, carried through the k-steps (a value where sim)
    if sim:
        return _zero_tile(run, shape, sim=sim)
    return pl.run_scoped(lambda acc_ref: run(acc_ref)[...], plgpu.ACC(shape, jnp.float32))


def _mma_step(acc, a_smem, b_smem, a_scales, b_scales, col0, *, sim, release):
    if sim:
        acc = acc + lax.dot_general(a_smem[...], b_smem[...], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)                          # (rows, bn)
    else:
        plgpu.wgmma(acc, a_smem, b_smem.transpose((1, 0)))
        plgpu.wgmma_wait(0)
    release()
    return acc


def _stream_step(acc, a_smem, b_smem, a_scales, b_scales, col0, *, sim, release):
    release()
    return acc


PROBES = {"mma": Accumulation(tile=_mma_tile, step=_mma_step), "stream": Accumulation(tile=_zero_tile,
                                                                                     step=_stream_step)}


def probe_accumulation(probe: str | None) -> Accumulation:
    """The kernels' accumulation hook for probe ``probe`` (``PROBES``; None: the kernels' own, ``PROMOTED``)."""
    if probe is None:
        return PROMOTED
    if probe not in PROBES:
        raise ValueError(f"probe must be None or one of {tuple(PROBES)}, got {probe!r}")
    return PROBES[probe]


def breakdown_case(m: int, n: int, k: int, kernel: str, *, interpret: bool = False, iters: int = 20,
                   repeats: int = 5) -> dict:
    """Seconds per call of one dense shape's Pallas kernel (its default tiling, kernels_pallas/fp8/pallas.py
  ``dense_pallas``) and of its two probes (``PROBES``: "mma", the promotion taken out; "stream", all compute taken
  out), with the tiling, the GEMM's flops and "tile_bytes", the bytes the kernel's copies bring into SMEM (per
  output tile and k-step ``Tiling.stage_bytes``: the A and B tiles, bm x 128 + bn x 128 e4m3, and their scales,
  bm + SCALE_WINDOW float32). interpret: for a CPU check."""
    import functools

    from kernels_pallas.fp8.pallas import dense_pallas, resolve_tiling

    tiling = resolve_tiling(kernel, None, None, fp8_tiling.BLOCK_K, None, rows=m, n=n, k=k, out_dtype=jnp.bfloat16,
                            interpret=interpret)
    tiles = cdiv(m, tiling.block_m) * cdiv(n, tiling.block_n)
    k_steps = cdiv(k, fp8_tiling.BLOCK_K)
    out = dict(tiling=tiling, flops=2 * m * n * k, tile_bytes=tiles * k_steps * tiling.stage_bytes())
    ops = _operands((m,), (), n, k)
    for probe in (None, *PROBES):
        f = jax.jit(functools.partial(dense_pallas, tiling=tiling, out_dtype=jnp.bfloat16, interpret=interpret,
                                      accumulation=probe_accumulation(probe)))
        out[probe or "kernel"] = time_per_call(f, *ops, iters=iters, repeats=repeats)
    return out


def breakdown_line(name: str, st: dict) -> str:
    """The --breakdown line of one ``breakdown_case`` result: each probe's time, stream in TB/s of tiles into SMEM,
  mma and the kernel in TFLOPS."""
    t = st["tiling"]
    return (f"  probes {name} [{t.block_m}x{t.block_n}x{t.stages}]: stream {st['stream'] * 1e6:.1f} us "
            f"({st['tile_bytes'] / st['stream'] / 1e12:.2f} TB/s of tiles into SMEM), mma {st['mma'] * 1e6:.1f} us "
            f"({st['flops'] / st['mma'] / 1e12:.1f} TFLOPS), kernel {st['kernel'] * 1e6:.1f} us "
            f"({st['flops'] / st['kernel'] / 1e12:.1f} TFLOPS)")


def run(implementation: str, kernels, cases: str, tilings: list[dict], emit, multicast: bool = False) -> None:
    for kind, shape in _cases(cases):
        for kernel in kernels:
            mine = tilings if kernel is not None else [{}]
            if multicast and kernel == "warp_specialized":
                mine = mine + [t | dict(multicast=2) for t in mine]
            for tiling in mine:
                tag = "" if kernel is None else f" [{kernel}]"
                name = f"{kind} {shape}"
                try:
                    tag += _tiling_label(kind, shape, kernel, tiling)
                    name, f, make_ops, flops, pub = _case(kind, shape, implementation, kernel, tiling)
                    t = time_per_call(f, *make_ops())
                    emit(f"{name}{tag}: {t * 1e6:9.1f} us {flops / t / 1e12:7.1f} TFLOPS   published H800: {pub}")
                except Exception as e:  # noqa: BLE001 - one failing case must not stop the sweep
                    emit(f"{name}{tag}: FAILED {type(e).__name__}: {str(e)[:200]}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_fp8.txt", help="results are appended to this file")
    p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"))
    p.add_argument("--kernel", default="pipelined", choices=(*KERNELS, "both"),
                   help="Pallas kernel variant (fp8_gemm kernel=); both: side by side")
    p.add_argument("--cases", default="all", choices=("all", "compare", "tuning"),
                   help="compare: a few headline shapes; tuning: two dense shapes for a --tilings sweep")
    p.add_argument("--tilings", default=None, help="BMxBNxST[,...]: time these tilings instead of the defaults")
    p.add_argument("--multicast", action="store_true",
                   help="also time each warp_specialized case with multicast=2 (CTA pairs sharing A by TMA multicast)")
    p.add_argument("--breakdown", action="store_true",
                   help=f"also time each kernel's probes on dense m, n, k = {BREAKDOWN_SHAPE} (breakdown_case)")
    args = p.parse_args(argv)
    tilings = parse_tilings(args.tilings)
    if args.implementation == "xla":
        kernels = (None,)
    else:
        kernels = KERNELS if args.kernel == "both" else (args.kernel,)
    dev = jax.devices()[0]
    with open(args.out, "a") as fh:
        def emit(line: str) -> None:
            print(line, flush=True)
            fh.write(line + "\n")
            fh.flush()

        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        emit(f"# fp8 GEMM benchmark {stamp} device={dev.device_kind} jax={jax.__version__} "
             f"implementation={args.implementation} kernel={args.kernel} cases={args.cases} "
             f"tilings={args.tilings or 'default'} multicast={args.multicast}")
        if dev.platform != "gpu":
            emit("no GPU: the FP8 kernel benchmarks need a CUDA (Hopper) GPU; nothing was measured")
            return
        run(args.implementation, kernels, args.cases, tilings, emit, multicast=args.multicast)
        if args.breakdown and args.implementation == "pallas":
            for kernel in kernels:
                name = f"dense m={BREAKDOWN_SHAPE[0]} n={BREAKDOWN_SHAPE[1]} k={BREAKDOWN_SHAPE[2]} [{kernel}]"
                try:
                    emit(breakdown_line(name, breakdown_case(*BREAKDOWN_SHAPE, kernel)))
                except Exception as e:  # noqa: BLE001 - the breakdown is context, not a case
                    emit(f"  probes {name}: FAILED {type(e).__name__}: {str(e)[:200]}")
        if args.cases == "compare":
            ceilings(emit)


if __name__ == "__main__":
    main()
