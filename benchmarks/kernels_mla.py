"""MLA decode benchmark on FlashMLA's sweep, in FlashMLA's units (tests/test_flash_mla.py, README).

    PYTHONPATH=. python benchmarks/kernels_mla.py [--out results.txt] [--implementation pallas|xla] [--iters 20]
        [--kernel recompute_scores|shared_scores|both] [--cases all|compare]

Sweep (--cases all): b=128; s_k 4096, 8192; h_q 16, 32, 64, 128; s_q 1, 2 (causal for s_q=2); h_kv 1; d 576;
dv 512; page 64; every sequence at full length s_k. --cases compare: b=128, s_k=8192, (h_q, s_q) in (16, 1), (64, 1),
(128, 2), a short subset to compare the kernel variants, then FlashMLA's varlen batch (tests/test_flash_mla.py
--varlen: lengths drawn from normal(s_k, s_k / 2), at least s_q) at s_k=4096, h_q=64 under the balanced schedule
and under one split per sequence (num_splits=1). --kernel (pallas only): mla_decode's kernel= variant;
"both" prints the two variants' lines of each case next to each other. Metrics (FlashMLA's formulas, DESIGN.md):
  bytes = (sum(seqlen) * h_kv * 576 + b * s_q * h_q * 576 + b * s_q * h_q * 512) * 2  -> GB/s
  FLOPs = 2 * s_q * sum(seqlen) * h_q * (576 + 512)                                  -> TFLOPS
Published (FlashMLA README, H800 SXM5, CUDA 12.8): up to 3000 GB/s memory-bound, 580-660 TFLOPS compute-bound.
Runs only where a CUDA GPU exists; each case is guarded so one failure does not stop the rest.
"""

from __future__ import annotations

import argparse
import datetime
import time

from kernels_pallas.mla_decode import KERNELS

PUBLISHED_H800 = "FlashMLA H800: up to 3000 GB/s (memory-bound), 580-660 TFLOPS (compute-bound)"


def cases(which):
    """(b, s_k, h_q, s_q, varlen, num_splits) of the full sweep or of the short comparison subset."""
    if which == "compare":
        return ([(128, 8192, h_q, s_q, False, None) for h_q, s_q in ((16, 1), (64, 1), (128, 2))]
                + [(128, 4096, 64, 1, True, splits) for splits in (None, 1)])
    return [(128, s_k, h_q, s_q, False, None) for s_k in (4096, 8192) for h_q in (16, 32, 64, 128) for s_q in (1, 2)]


def seqlens_of(b, s_k, s_q, varlen, seed=0):
    """Every sequence at s_k, or FlashMLA's varlen draw: max(normal(s_k, s_k / 2), s_q) (tests/test_flash_mla.py)."""
    import numpy as np

    if not varlen:
        return np.full((b,), s_k, np.int32)
    return np.maximum(np.random.default_rng(seed).normal(s_k, s_k / 2, b), s_q).astype(np.int32)


def run_case(b, s_k, h_q, s_q, varlen, num_splits, implementation, kernel, iters):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import mla_decode

    d, dv, h_kv, page = 576, 512, 1, 64
    lens = seqlens_of(b, s_k, s_q, varlen)
    pages_per_seq = -(-int(lens.max()) // page)
    key = jax.random.PRNGKey(0)
    kq, kk = jax.random.split(key)
    q = jax.random.normal(kq, (b, s_q, h_q, d), jnp.bfloat16)
    kv = jax.random.normal(kk, (b * pages_per_seq, page, h_kv, d), jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(0).permutation(b * pages_per_seq).reshape(b, pages_per_seq),
                        jnp.int32)
    seqlens = jnp.asarray(lens)
    causal = s_q > 1
    knobs = dict(kernel=kernel, num_splits=num_splits) if implementation == "pallas" else {}
    f = jax.jit(lambda q, kv, t, s: mla_decode(q, kv, t, s, head_dim_v=dv, causal=causal,
                                               implementation=implementation, **knobs))
    jax.block_until_ready(f(q, kv, table, seqlens))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, kv, table, seqlens))
        times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    total = int(lens.sum())
    nbytes = (total * h_kv * 576 + b * s_q * h_q * 576 + b * s_q * h_q * 512) * 2
    flops = 2 * s_q * total * h_q * (576 + 512)
    return t, nbytes / t / 1e9, flops / t / 1e12


def copy_ceiling(gib: float = 2.0, iters: int = 20) -> str:
    """The device's read+write bandwidth on a bf16 array of ``gib`` GiB (x * 2: one read, one write per element),
    the memory ceiling the MLA GB/s compare with (KINDS.md measured about 4.3 TB/s on an H200 through PyTorch)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x * 2)
    jax.block_until_ready(f(x))
    t0 = time.perf_counter()
    for _ in range(iters):
        y = f(x)
    jax.block_until_ready(y)
    t = (time.perf_counter() - t0) / iters
    return f"copy ceiling: x * 2 on {gib:g} GiB bf16: {2 * x.nbytes / t / 1e9:.0f} GB/s (read + write)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="append result lines to this file")
    p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kernel", default="recompute_scores", choices=KERNELS + ("both",),
                   help="mla_decode kernel= variant (pallas only); both: adjacent lines per case")
    p.add_argument("--cases", default="all", choices=("all", "compare"),
                   help="all: FlashMLA's sweep; compare: b=128 s_k=8192 (h_q, s_q) (16,1) (64,1) (128,2)")
    args = p.parse_args()
    kernels = KERNELS if args.kernel == "both" else (args.kernel,)
    if args.implementation == "xla":
        kernels = (None,)

    import jax

    dev = jax.devices()[0]
    if dev.platform != "gpu":
        print(f"kernels_mla.py needs a CUDA GPU (default device here: {dev.platform}); nothing measured.")
        return
    header = (f"# mla_decode {args.implementation} on {dev.device_kind}, jax {jax.__version__}, "
              f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; {PUBLISHED_H800}")
    out = open(args.out, "a") if args.out else None

    def emit(line: str) -> None:  # line by line, so a run cut by its time limit keeps what it measured
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    emit(header)
    try:
        emit(copy_ceiling())
    except Exception as e:  # noqa: BLE001 - the ceiling is context, not a case
        emit(f"copy ceiling: FAILED {type(e).__name__}: {str(e)[:200]}")
    for b, s_k, h_q, s_q, varlen, num_splits in cases(args.cases):
        for kernel in kernels:
            name = f"b={b} s_k={s_k}{' varlen' if varlen else ''} h_q={h_q} s_q={s_q} h_kv=1 d=576 dv=512 " \
                   f"causal={s_q > 1}"
            if kernel is not None:
                name += f" kernel={kernel} schedule={'balanced' if num_splits is None else f'{num_splits=}'}"
            try:
                t, gbs, tflops = run_case(b, s_k, h_q, s_q, varlen, num_splits, args.implementation, kernel,
                                          args.iters)
                line = f"{name}: {t * 1e6:.1f} us  {gbs:.0f} GB/s  {tflops:.1f} TFLOPS"
            except Exception as e:  # one failing case must not stop the sweep
                line = f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            emit(line)
    if out is not None:
        out.close()

if __name__ == "__main__":
    main()
