"""jaxinfer.plan on this machine: the performance model predicting jaxinfer's own CPU sweep (docs/plan.md "The
CPU check").

    python benchmarks/plan_cpu.py [--meshes meshes/cpu-1x1.toml meshes/cpu-2x4.toml meshes/cpu-1x8.toml]
                                  [--batch-sizes 1,8] [--input-len 64] [--output-len 16] [--sweep-csv FILE]

1. Measures the CPU as jaxinfer's programs reach it (generate_vs_transformers.machine_limits: a [2048, 2048]
   matmul and a one-row product streaming 512 MB, in the sweep's dtype).
2. Runs `jaxinfer sweep` over the meshes on the embedded model (or reads a sweep.csv it wrote).
3. Predicts each (mesh, batch) with ``jaxinfer.plan.predict``: one simulated device is a "GPU" with 1 / devices of
   the measured matmul rate and bandwidth (the devices share the cores), devices exchange experts' rows through
   memory at that bandwidth, no calibration (a ``measured`` description: the rates are achieved ones), bf16 weights,
   no dual-microbatch overlap (jaxinfer has none), the expert axis as ep and every device a DP rank (docs/
   architecture.md "Mesh semantics"; a DxE mesh replicates each expert D times, which the model counts as
   ep = E), requests per device = ceil(batch / devices) (an SPMD step pads idle ranks to one row).
Prints a markdown table: measured and predicted decode tok/s, measured / predicted, the model's bound.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import tomllib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # generate_vs_transformers' machine_limits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", nargs="+", default=["meshes/cpu-1x1.toml", "meshes/cpu-2x4.toml",
                                                        "meshes/cpu-1x8.toml"])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--sweep-csv", default=None, help="a sweep.csv of these meshes and batches (skip the run)")
    args = parser.parse_args()

    import jax.numpy as jnp

    from generate_vs_transformers import machine_limits

    peak, bandwidth = machine_limits(jnp.bfloat16)
    print(f"measured: matmul {peak / 1e9:.1f} GFLOP/s (bf16), memory {bandwidth / 1e9:.1f} GB/s", flush=True)
    if args.sweep_csv is None:
        out = tempfile.mkdtemp(prefix="plan_cpu_")
        subprocess.run([sys.executable, "-m", "jaxinfer.cli", "sweep", "--meshes", *args.meshes, "--batch-sizes",
                        args.batch_sizes, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--out", out], check=True, stdout=subprocess.DEVNULL)
        args.sweep_csv = os.path.join(out, "sweep.csv")
    with open(args.sweep_csv) as f:
        measured = list(csv.DictReader(f))
    print(table(measured, peak, bandwidth, args.input_len, args.output_len))


def table(measured: list[dict], peak: float, bandwidth: float, input_len: int, output_len: int) -> str:
    from jaxinfer import default_model
    from jaxinfer.plan import Hardware, predict
    lines = ["| mesh | batch | measured decode tok/s | predicted | measured / predicted | bound | predicted step "
             "(ms): products / between them / attention core / all-to-all |", "|---|---|---|---|---|---|---|"]
    for row in measured:
        devices, expert, batch = int(row["devices"]), int(row["expert"]), int(row["batch"])
        share = Hardware(f"cpu/{devices}", bf16_tflops=peak / devices / 1e12, fp8_tflops=peak / devices / 1e12,
                         hbm_gb=24 / devices, hbm_gb_s=bandwidth / devices / 1e9,
                         nvlink_gb_s=bandwidth / devices / 1e9, net_gb_s=bandwidth / devices / 1e9, sms=2,
                         gpus_per_node=devices, measured=True)
        r = predict(model=default_model.path(), hardware=share, phase="decode", ep=expert, dp=expert,
                    requests_per_gpu=math.ceil(batch / devices), context_len=input_len + output_len / 2,
                    dbo=False, weight_bytes=2)
        predicted = batch / r["tpot_s"]
        got = float(row["decode_tok_s"])
        core, between, comm = r["parts"]["attention_core"], r["parts"]["elementwise"], r["communication_s"]
        lines.append(f"| {row['mesh']} | {batch} | {got:,.0f} | {predicted:,.0f} | {got / predicted:.3f} | "
                     f"{r['bound']} | {(r['compute_s'] - core - between) * 1e3:.3f} / {between * 1e3:.3f} / "
                     f"{core * 1e3:.3f} / {comm * 1e3:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
