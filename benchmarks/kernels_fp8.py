"""FP8 GEMM benchmarks on DeepGEMM's shapes, with DeepGEMM's published H800 figures printed beside ours.

Metric (DeepGEMM README / tests): TFLOPS = 2 * m * n * k / t (grouped: m = valid rows over all groups).
Dense shapes: m in (64, 128, 4096) x (n, k) in DeepGEMM's six pairs; published H800 TFLOPS at m = 4096 from
DESIGN.md ("DeepGEMM FP8 contract", README early 2025). Grouped: contiguous (groups x m_per_group) and masked
(groups x expected rows) on DeepGEMM's test shapes; DESIGN.md gives only the published range ~1200-1350.
Needs a CUDA GPU; elsewhere it says so and measures nothing. Each case is guarded so one failure does not stop
the rest; results (with date and device) are appended to --out.

  PYTHONPATH=. python benchmarks/kernels_fp8.py --out bench_fp8.txt [--implementation pallas|xla]
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


def run(implementation: str, emit) -> None:
    for m in DENSE_M:
        for n, k in NK:
            name = f"dense m={m} n={n} k={k}"
            try:
                a, a_s, b, b_s = _operands((m,), (), n, k)
                f = jax.jit(lambda *x: fp8_gemm(*x, implementation=implementation))
                t = _time(f, a, a_s, b, b_s)
                pub = PUBLISHED_M4096.get((n, k)) if m == 4096 else None
                emit(f"{name}: {t * 1e6:9.1f} us {2 * m * n * k / t / 1e12:7.1f} TFLOPS"
                     f"   published H800: {pub if pub else '-'}")
            except Exception as e:  # noqa: BLE001 - one failing case must not stop the sweep
                emit(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}")
    for g, mg, n, k in CONTIGUOUS:
        name = f"contiguous groups={g} m_per_group={mg} n={n} k={k}"
        try:
            m = g * mg
            a, a_s, b, b_s = _operands((m,), (g,), n, k)
            gid = jnp.repeat(jnp.arange(g, dtype=jnp.int32), mg)
            f = jax.jit(lambda *x: fp8_grouped_gemm_contiguous(*x, implementation=implementation))
            t = _time(f, a, a_s, b, b_s, gid)
            emit(f"{name}: {t * 1e6:9.1f} us {2 * m * n * k / t / 1e12:7.1f} TFLOPS   published H800: "
                 f"{GROUPED_PUBLISHED}")
        except Exception as e:  # noqa: BLE001
            emit(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}")
    for g, mg, n, k in MASKED:
        name = f"masked groups={g} m={mg} n={n} k={k}"
        try:
            a, a_s, b, b_s = _operands((g, mg), (g,), n, k)
            masked_m = jnp.full((g,), mg, jnp.int32)
            f = jax.jit(lambda *x: fp8_grouped_gemm_masked(*x, implementation=implementation))
            t = _time(f, a, a_s, b, b_s, masked_m)
            emit(f"{name}: {t * 1e6:9.1f} us {2 * g * mg * n * k / t / 1e12:7.1f} TFLOPS   published H800: "
                 f"{GROUPED_PUBLISHED}")
        except Exception as e:  # noqa: BLE001
            emit(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_fp8.txt", help="results are appended to this file")
    p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"))
    args = p.parse_args()
    dev = jax.devices()[0]
    with open(args.out, "a") as fh:
        def emit(line: str) -> None:
            print(line, flush=True)
            fh.write(line + "\n")
            fh.flush()

        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        emit(f"# fp8 GEMM benchmark {stamp} device={dev.device_kind} jax={jax.__version__} "
             f"implementation={args.implementation}")
        if dev.platform != "gpu":
            emit("no GPU: the FP8 kernel benchmarks need a CUDA (Hopper) GPU; nothing was measured")
            return
        run(args.implementation, emit)


if __name__ == "__main__":
    main()
