"""MLA decode benchmark on FlashMLA's sweep, in FlashMLA's units (tests/test_flash_mla.py, README).

    PYTHONPATH=. python benchmarks/kernels_mla.py [--out results.txt] [--implementation pallas|xla] [--iters 20]
        [--kernel recompute_scores|shared_scores|pingpong|all] [--cases all|compare] [--breakdown]

Sweep (--cases all): b=128; s_k 4096, 8192; h_q 16, 32, 64, 128; s_q 1, 2 (causal for s_q=2); h_kv 1; d 576;
dv 512; page 64; every sequence at full length s_k. --cases compare: b=128, s_k=8192, (h_q, s_q) in (16, 1), (64, 1),
(128, 2), a short subset to compare the kernel variants, then FlashMLA's varlen batch (tests/test_flash_mla.py
--varlen: lengths drawn from normal(s_k, s_k / 2), at least s_q) at s_k=4096, h_q=64 under the balanced schedule
and under one split per sequence (num_splits=1). --kernel (pallas only): mla_decode's kernel= variant;
"all" prints every variant's line of each case next to each other. --breakdown: each stage of the Pallas path
jitted and timed on its own (the work-item schedule, the kernel, the split combine), and for kernel=recompute_scores
the kernel's two probes (``PROBES``: the kernel's hooks replaced): "stream" (its page ring alone: the producer
streams every page, the compute warpgroups only release them; GB/s of the pages) and "compute" (every step on the
ring's first fill, no wait for memory). The kernel's time against the larger of the two shows how well it overlaps
them. Calls are timed back to back.
Metrics (FlashMLA's formulas, docs/architecture.md "FlashMLA decode contract"):
  bytes = (sum(seqlen) * h_kv * 576 + b * s_q * h_q * 576 + b * s_q * h_q * 512) * 2  -> GB/s
  FLOPs = 2 * s_q * sum(seqlen) * h_q * (576 + 512)                                  -> TFLOPS
Published (FlashMLA README, H800 SXM5, CUDA 12.8): up to 3000 GB/s memory-bound, 580-660 TFLOPS compute-bound.
Runs only where a CUDA GPU exists; each case is guarded so one failure does not stop the rest.
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.mla import KERNELS
from kernels_pallas.mla.pallas_common import Ring

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


D, DV, H_KV, PAGE = 576, 512, 1, 64


def make_inputs(b, s_k, h_q, s_q, varlen):
    """(q [b, s_q, h_q, 576] bf16, kv cache of shuffled pages, block table, seqlens [b]) and the lengths (numpy)."""
    import jax
    import numpy as np

    lens = seqlens_of(b, s_k, s_q, varlen)
    pages_per_seq = -(-int(lens.max()) // PAGE)
    kq, kk = jax.random.split(jax.random.PRNGKey(0))
    q = jax.random.normal(kq, (b, s_q, h_q, D), jnp.bfloat16)
    kv = jax.random.normal(kk, (b * pages_per_seq, PAGE, H_KV, D), jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(0).permutation(b * pages_per_seq).reshape(b, pages_per_seq),
                        jnp.int32)
    return (q, kv, table, jnp.asarray(lens)), lens


def median_time(f, args, iters):
    """Seconds per call of f(*args): kernels_fp8.py's timing (median over 5 repeats of ``iters`` back-to-back calls
    after a warm-up), so the dispatch of one call overlaps the previous call's kernels, as in a decode loop."""
    from kernels_fp8 import time_per_call  # benchmarks/ is on sys.path when this script runs

    return time_per_call(f, *args, iters=iters)


def run_case(b, s_k, h_q, s_q, varlen, num_splits, implementation, kernel, iters):
    import jax

    from kernels_pallas import mla_decode

    args, lens = make_inputs(b, s_k, h_q, s_q, varlen)
    causal = s_q > 1
    knobs = dict(kernel=kernel, num_splits=num_splits) if implementation == "pallas" else {}
    f = jax.jit(lambda q, kv, t, s: mla_decode(q, kv, t, s, head_dim_v=DV, causal=causal,
                                               implementation=implementation, **knobs))
    t = median_time(f, args, iters)
    total = int(lens.sum())
    nbytes = (total * H_KV * 576 + b * s_q * h_q * 576 + b * s_q * h_q * 512) * 2
    flops = 2 * s_q * total * h_q * (576 + 512)
    return t, nbytes / t / 1e9, flops / t / 1e12


# The recompute_scores kernel's probes: the kernel with half of its work taken out through its static hooks
# (recompute_scores.decode_kernel's ring= and attend=), to show which half bounds its time on a GPU.
# - "stream": the producer streams every page as usual and the compute warpgroups only wait for each and release it
#   (the page ring's own rate; out 0, lse -inf).
# - "compute": the producer fills each ring slot once and the compute warpgroups run every step on those pages (step t
#   reads the item's page t % num_stages) without waiting for memory.
def _skip_page(c, carry, page_start, k_page):
    return carry


def _wait_first_fill(k_bars, slot, t, num_stages):
    pl.when(t < num_stages)(lambda: plgpu.barrier_wait(k_bars.at[slot]))


FIRST_FILL = Ring(fetches=lambda n_steps, num_stages: jnp.minimum(n_steps, num_stages), wait=_wait_first_fill,
                  release=lambda consumed_bars, slot: None, drain=lambda consumed_bars, n_steps, num_stages: None)
PROBES = {"stream": dict(attend=_skip_page), "compute": dict(ring=FIRST_FILL)}


def probe_hooks(name: str) -> dict:
    """The keyword arguments (hooks) that turn recompute_scores_pallas into probe ``name`` (``PROBES``)."""
    if name not in PROBES:
        raise ValueError(f"probe must be one of {tuple(PROBES)}, got {name!r}")
    return PROBES[name]


def breakdown_case(b, s_k, h_q, s_q, varlen, num_splits, kernel, iters, interpret=None):
    """Median seconds of the Pallas path's stages, each jitted on its own (kernels_pallas/mla/pallas.py
    ``decode_pallas``): the schedule, the kernel alone (on that schedule), the combine (on its outputs); for
    recompute_scores also its probes "stream" and "compute" (``PROBES``), and "page_bytes", the bytes of the pages the
    items stream. interpret: for a CPU check."""
    import functools

    import jax

    from kernels_pallas import _mosaic
    from kernels_pallas.mla import MLATuning
    from kernels_pallas.mla.pallas import pack_rows, run_items, schedule_items
    from kernels_pallas.mla.recompute_scores import recompute_scores_pallas
    from kernels_pallas.mla.schedule import combine

    (q, kv, table, seqlens), _ = make_inputs(b, s_k, h_q, s_q, varlen)
    q_rows = pack_rows(q, H_KV, kv.dtype)
    tuning = MLATuning(num_splits=num_splits, num_sms=_mosaic.device_sm_count(), block_dv=256, num_stages=2,
                       kernel=kernel)
    sched_f = jax.jit(functools.partial(schedule_items, page_size=PAGE, max_pages=table.shape[1], tuning=tuning))
    sched = sched_f(seqlens, q_rows)
    kw = dict(s_q=s_q, m=h_q // H_KV, head_dim_v=DV, scale=D ** -0.5, causal=s_q > 1,
              interpret=_mosaic.interpret_params() if interpret else None)
    run = jax.jit(functools.partial(run_items, tuning=tuning, **kw))
    kernel_args = (q_rows, kv, seqlens, sched.items, table)
    o_part, lse_part = run(*kernel_args)
    comb = jax.jit(functools.partial(combine, batch=b, rows=s_q * (h_q // H_KV)))
    stages = {"schedule": median_time(sched_f, (seqlens, q_rows), iters),
              "kernel": median_time(run, kernel_args, iters),
              "combine": median_time(comb, (o_part, lse_part, sched.row_seq), iters),
              "items": int(sched.items.shape[1]), "nonempty": int(jnp.sum(sched.items[2] > 0)),
              # every program streams its item's pages: row blocks * pages * page bytes
              "page_bytes": int(q_rows.shape[1] * (q_rows.shape[2] // 64) * jnp.sum(sched.items[2]))
              * PAGE * D * kv.dtype.itemsize}
    if kernel == "recompute_scores":
        for probe in PROBES:
            f = jax.jit(functools.partial(recompute_scores_pallas, block_dv=tuning.block_dv,
                                          num_stages=tuning.num_stages, **probe_hooks(probe), **kw))
            stages[probe] = median_time(f, kernel_args, iters)
    return stages


def breakdown_lines(st: dict) -> list[str]:
    """The --breakdown lines of one case from ``breakdown_case``'s result (seconds, counts, page bytes)."""
    lines = [f"  stages: schedule {st['schedule'] * 1e6:.1f} us, kernel {st['kernel'] * 1e6:.1f} us, "
             f"combine {st['combine'] * 1e6:.1f} us ({st['nonempty']} of {st['items']} items hold pages)"]
    if "stream" in st:
        gbs = {k: st["page_bytes"] / st[k] / 1e9 for k in ("stream", "kernel")}
        lines.append(f"  probes: stream {st['stream'] * 1e6:.1f} us ({gbs['stream']:.0f} GB/s of pages), "
                     f"compute {st['compute'] * 1e6:.1f} us, kernel {st['kernel'] * 1e6:.1f} us "
                     f"({gbs['kernel']:.0f} GB/s of pages)")
    return lines


def copy_ceiling(gib: float = 2.0, iters: int = 20) -> str:
    """The device's read+write bandwidth on a bf16 array of ``gib`` GiB (x * 2: one read, one write per element),
    the memory ceiling the MLA GB/s compare with."""
    import jax

    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x * 2)
    jax.block_until_ready(f(x))
    t0 = time.perf_counter()
    for _ in range(iters):
        y = f(x)
    jax.block_until_ready(y)
    t = (time.perf_counter() - t0) / iters
    return f"copy ceiling: x * 2 on {gib:g} GiB bf16: {2 * x.nbytes / t / 1e9:.0f} GB/s (read + write)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="append result lines to this file")
    p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kernel", default="recompute_scores", choices=KERNELS + ("all",),
                   help="mla_decode kernel= variant (pallas only); all: every variant, adjacent lines per case")
    p.add_argument("--cases", default="all", choices=("all", "compare"),
                   help="all: FlashMLA's sweep; compare: b=128 s_k=8192 (h_q, s_q) (16,1) (64,1) (128,2) + varlen")
    p.add_argument("--breakdown", action="store_true",
                   help="pallas only: after each case's line, the stages timed on their own (schedule, kernel, "
                        "combine), to show where the time goes")
    args = p.parse_args(argv)
    kernels = KERNELS if args.kernel == "all" else (args.kernel,)
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
            if args.breakdown and kernel is not None:
                try:
                    for line in breakdown_lines(breakdown_case(b, s_k, h_q, s_q, varlen, num_splits, kernel,
                                                               args.iters)):
                        emit(line)
                except Exception as e:  # noqa: BLE001 - the breakdown is context, not a case
                    emit(f"  stages: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    if out is not None:
        out.close()

if __name__ == "__main__":
    main()
