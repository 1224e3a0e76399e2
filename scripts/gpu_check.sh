#!/usr/bin/env bash
# The one prepared device run for the kernels (issue 4): native kernel tests, then the kernel benchmarks.
# Usage on the GPU machine (offline, preinstalled jax 0.11): OUT=<dir> bash scripts/gpu_check.sh
# Each step has its own time limit and failures do not stop the rest; everything lands in $OUT.
set -u
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONPATH=.
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1;
  python -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1; } > "$OUT/env.txt"
timeout 240 python -m pytest -q -x --durations=10 tests/test_kernels_gpu.py > "$OUT/kernel_tests.txt" 2>&1
echo "kernel tests rc=$?" >> "$OUT/kernel_tests.txt"
timeout 120 python benchmarks/kernels_mla.py --out "$OUT/bench_mla.txt" > "$OUT/bench_mla.log" 2>&1
echo "mla bench rc=$?" >> "$OUT/bench_mla.log"
timeout 120 python benchmarks/kernels_fp8.py --out "$OUT/bench_fp8.txt" > "$OUT/bench_fp8.log" 2>&1
echo "fp8 bench rc=$?" >> "$OUT/bench_fp8.log"
tail -n 3 "$OUT"/*.txt "$OUT"/*.log
