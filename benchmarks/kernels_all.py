"""The kernel benchmarks in one command: FlashMLA's sweep (kernels_mla.py), then DeepGEMM's shapes
(kernels_fp8.py), each line with the published H800 figures beside ours, appended to two files in --out-dir.

    PYTHONPATH=. python benchmarks/kernels_all.py [--out-dir DIR] [--cases all|compare] [--kernel default|both]

Files: DIR/bench_mla.txt and DIR/bench_fp8.txt. --cases compare: the short subsets (the goal shapes, FlashMLA's
varlen batch; then XLA's ceilings). --kernel both: every kernel variant side by side. The two scripts take more
options (tilings, multicast, stage breakdown); run them directly for those. They need a CUDA GPU and say so
elsewhere, measuring nothing; a failure in one does not stop the other. scripts/gpu_check.sh runs them step by
step instead, each under its own time limit.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts, however this one is run

import kernels_fp8  # noqa: E402
import kernels_mla  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=".", help="where bench_mla.txt and bench_fp8.txt are appended")
    p.add_argument("--cases", default="all", choices=("all", "compare"))
    p.add_argument("--kernel", default="default", choices=("default", "both"),
                   help="default: each entry's default kernel; both: every variant side by side")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    both = ["--kernel", "both"] if args.kernel == "both" else []
    runs = [(kernels_mla.main, ["--out", os.path.join(args.out_dir, "bench_mla.txt"), "--cases", args.cases]),
            (kernels_fp8.main, ["--out", os.path.join(args.out_dir, "bench_fp8.txt"), "--cases", args.cases])]
    failed = 0
    for run, run_args in runs:
        try:
            run(run_args + both)
        except Exception:  # noqa: BLE001 - one benchmark's failure must not stop the other
            traceback.print_exc()
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
