"""FP8 GEMM benchmarks on DeepGEMM's shapes, with DeepGEMM's published H800 figures printed beside ours.

Metric (DeepGEMM README / tests): TFLOPS = 2 * m * n * k / t (grouped: m = valid rows over all groups).
Dense shapes: m in (64, 128, 4096) x (n, k) in DeepGEMM's six pairs; published H800 TFLOPS at m = 4096 from
DESIGN.md ("DeepGEMM FP8 contract", README early 2025). Grouped: contiguous (groups x m_per_group) and masked
(groups x expected rows) on DeepGEMM's test shapes; DESIGN.md gives only the published range ~1200-1350.
Needs a CUDA GPU; elsewhere it says so and measures nothing. Each case (shape x kernel variant) is guarded so one
failure does not stop the rest; results (with date and device) are appended to --out, one line per case, tagged
with the kernel variant (fp8_gemm ``kernel=``: "pipelined" | "warp_specialized") when it is the Pallas path.

--kernel both runs the two variants side by side (adjacent lines per shape); --cases compare restricts the sweep
to a few headline shapes (scripts/gpu_check.sh uses it to keep the device run short).

  PYTHONPATH=. python benchmarks/kernels_fp8.py --out bench_fp8.txt [--implementation pallas|xla]
      [--kernel pipelined|warp_specialized|both] [--cases all|compare]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import jax
import jax.numpy as jnp

from kernels_pallas import fp8_gemm, fp8_grouped_gemm_contiguous, fp8_grouped_gemm_masked

NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
PUBLISHED_M4096 = dict(zip(NK, [1058, 990, 590, 1358, 1304, 1025]))  # H800 TFLOPS, DESIGN.md
DENSE_M = (64, 128, 4096)
CONTIGUOUS = [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168), (8, 4096, 7168, 2048)]
MASKED = [(g, m, n, k) for g, m in ((1, 1024), (2, 512), (4, 256)) for n, k in ((4096, 7168), (7168, 2048))]
GROUPED_PUBLISHED = "~1200-1350 (DESIGN.md, grouped)"
# --cases compare: the headline dense shape, a wide-n and a decode-sized one, one of each grouped layout.
COMPARE = dict(dense=[(4096, 4096, 7168), (4096, 24576, 1536), (64, 2112, 7168)],
               contiguous=[(4, 8192, 4096, 7168)], masked=[(4, 256, 4096, 7168)])
KERNELS = ("pipelined", "warp_specialized")


def _fp8(key, shape):
    return (jax.random.normal(key, shape, jnp.float32) * 8).astype(jnp.float8_e4m3fn)


def _scales(key, shape):
    return jax.random.uniform(key, shape, jnp.float32, 0.5, 2.0) / 448.0


def _time(fn, *args, iters: int = 20) -> float:
    """Median seconds per call of a jitted fn (after compile + warmup), synchronised per call."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
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
    dense = [(m, n, k) for m in DENSE_M for n, k in NK]
    return ([("dense", x) for x in dense] + [("contiguous", x) for x in CONTIGUOUS]
            + [("masked", x) for x in MASKED])


def _case(kind: str, shape, implementation: str, kernel: str | None):
    """-> (name, jitted fn, operands, flops, published figure) of one benchmark case."""
    knobs = dict(implementation=implementation) | ({} if kernel is None else dict(kernel=kernel))
    if kind == "dense":
        m, n, k = shape
        pub = PUBLISHED_M4096.get((n, k)) if m == 4096 else None
        f = jax.jit(lambda *x: fp8_gemm(*x, **knobs))
        return f"dense m={m} n={n} k={k}", f, _operands((m,), (), n, k), 2 * m * n * k, pub or "-"
    g, mg, n, k = shape
    if kind == "contiguous":
        ops = (*_operands((g * mg,), (g,), n, k), jnp.repeat(jnp.arange(g, dtype=jnp.int32), mg))
        f = jax.jit(lambda *x: fp8_grouped_gemm_contiguous(*x, **knobs))
        name = f"contiguous groups={g} m_per_group={mg} n={n} k={k}"
    else:
        ops = (*_operands((g, mg), (g,), n, k), jnp.full((g,), mg, jnp.int32))
        f = jax.jit(lambda *x: fp8_grouped_gemm_masked(*x, **knobs))
        name = f"masked groups={g} m={mg} n={n} k={k}"
    return name, f, ops, 2 * g * mg * n * k, GROUPED_PUBLISHED


def run(implementation: str, kernels, cases: str, emit) -> None:
    for kind, shape in _cases(cases):
        for kernel in kernels:
            tag = "" if kernel is None else f" [{kernel}]"
            name = f"{kind} {shape}"
            try:
                name, f, ops, flops, pub = _case(kind, shape, implementation, kernel)
                t = _time(f, *ops)
                emit(f"{name}{tag}: {t * 1e6:9.1f} us {flops / t / 1e12:7.1f} TFLOPS   published H800: {pub}")
            except Exception as e:  # noqa: BLE001 - one failing case must not stop the sweep
                emit(f"{name}{tag}: FAILED {type(e).__name__}: {str(e)[:200]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_fp8.txt", help="results are appended to this file")
    p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"))
    p.add_argument("--kernel", default="pipelined", choices=(*KERNELS, "both"),
                   help="Pallas kernel variant (fp8_gemm kernel=); both: side by side")
    p.add_argument("--cases", default="all", choices=("all", "compare"), help="compare: a few headline shapes")
    args = p.parse_args()
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
             f"implementation={args.implementation} kernel={args.kernel} cases={args.cases}")
        if dev.platform != "gpu":
            emit("no GPU: the FP8 kernel benchmarks need a CUDA (Hopper) GPU; nothing was measured")
            return
        run(args.implementation, kernels, args.cases, emit)


if __name__ == "__main__":
    main()
