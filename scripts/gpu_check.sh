#!/usr/bin/env bash
# The one prepared device run (the Pallas kernels first, then the engine on the GPU):
#   1. native tests of the measured kernels (pipelined FP8 GEMMs with their tilings, MLA decode "recompute_scores");
#   2. native tests of the variants never run on a GPU yet (FP8 kernel="warp_specialized", MLA
#      kernel="shared_scores" and "pingpong"), in a step of their own so a hang costs only that step;
#   3. both FP8 variants (and the warp-specialized one with multicast=2) side by side on the goal shapes
#      (m = 4096 x DeepGEMM's six (n, k)) + decode/grouped ones, each kernel's probes on the headline shape (its
#      promotion taken out, its compute taken out: which bounds it), then the ceilings: XLA/cuBLAS, and JAX's own
#      Pallas Hopper matmul in bf16;
#   4. every MLA variant side by side on a short FlashMLA subset, and on FlashMLA's varlen batch under the balanced
#      schedule and one split per sequence, each with its stages timed alone (schedule, kernel, combine), and the
#      default kernel's probes (its page ring alone, its compute alone: which of them bounds it);
#   5. what this machine's ptxas made of the headline kernel configurations (registers, spills, its warnings, the
#      SASS mix: benchmarks/kernels_ptxas.py; the full report runs offline on CPU), then Nsight Compute's
#      speed-of-light, warp-stall and occupancy sections for the headline FP8 GEMM and one MLA decode (every variant
#      of each), where ncu runs (it cannot read counters on gVisor);
#   6. a tiling sweep of both FP8 kernels on two goal shapes (kernels_fp8.py --cases tuning --tilings ...);
#   7. the engine (embedded model through LLM(): Pallas MLA decode over the paged cache, FP8 compute), then MTP
#      speculative decoding against plain decoding at batch 1 and 32, 4 rounds (or iterations) per step: a round's
#      cost in plain token-steps says whether verification columns are nearly free here (issue 31's speed-up),
#      4 rounds per step on device against one, and async speculative steps against applied ones (one round per
#      step, the GPU's default);
#   8. with what is left of the budget, the full FlashMLA and DeepGEMM sweeps with the default kernels.
# Steps 3-6 skip the new variants when step 2 hung (rc 124).
# Usage on the GPU machine (offline, preinstalled jax 0.11): OUT=<dir> bash scripts/gpu_check.sh
# Each step has its own time limit, cut to what is left of the whole run's budget (BUDGET_S, default 470 s: under 8
# minutes, with room for the machine's start inside one 600 s device call); a step with under 15 s left is skipped
# and says so. Failures do not stop the rest; everything lands in $OUT, in 8 files at most (what the device tool
# brings back): the benchmarks' own logs share bench.log.
set -u
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONPATH=.
deadline=$((SECONDS + ${BUDGET_S:-470}))

# step LOG CAP_S CMD...: runs CMD with stdout+stderr in $OUT/LOG under min(CAP_S, budget left); appends its rc
# (124: cut by its limit) and the seconds it took.
step() {
  local log=$1 cap=$2 left=$((deadline - SECONDS)) start=$SECONDS
  shift 2
  if [ "$left" -lt 15 ]; then
    echo "skipped: ${left} s of the run's budget left" >> "$OUT/$log"
    return 125
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  timeout "$cap" "$@" >> "$OUT/$log" 2>&1
  local rc=$?
  echo "rc=$rc after $((SECONDS - start)) s (limit $cap s)" >> "$OUT/$log"
  return $rc
}

NEW="warp_specialized or shared_scores or pingpong"
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1;
  python -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1; } > "$OUT/env.txt"
# tests/conftest.py defaults JAX_PLATFORMS to cpu (8 simulated devices): the native tests need the GPU.
JAX_PLATFORMS=cuda,cpu step kernel_tests.txt 150 python -m pytest -q -x --durations=10 -k "not ($NEW)" \
  tests/kernels/test_kernels_gpu.py
JAX_PLATFORMS=cuda,cpu step kernel_tests.txt 90 python -m pytest -q --durations=5 -k "$NEW" \
  tests/kernels/test_kernels_gpu.py
new_rc=$?
fp8_kernels=both; mla_kernels=all
if [ "$new_rc" -eq 124 ]; then fp8_kernels=pipelined; mla_kernels=recompute_scores; fi
step bench.log 180 python benchmarks/kernels_fp8.py --kernel "$fp8_kernels" --cases compare --multicast \
  --breakdown --out "$OUT/bench_compare.txt"
step bench.log 150 python benchmarks/kernels_mla.py --kernel "$mla_kernels" --cases compare --breakdown \
  --out "$OUT/bench_compare.txt"
# The full report runs offline on CPU (docs/benchmarks.md); here the headline configurations, to see what this
# machine's jax and ptxas make of them.
# (Only the measured variants if the new ones hung in step 2: the report and ncu run each kernel once.)
picks=(--only "(4096, 7168, 16384) [pipelined]" --only "h_q=16 s_q=1 kernel=recompute_scores")
if [ "$new_rc" -ne 124 ]; then
  picks+=(--only "(4096, 7168, 16384) [warp_specialized]" --only "h_q=16 s_q=1 kernel=shared_scores"
          --only "h_q=16 s_q=1 kernel=pingpong")
fi
step bench.log 45 python benchmarks/kernels_ptxas.py --out "$OUT/ptxas.txt" "${picks[@]}"
# Kernel names for ncu's filter: the entry functions ptxas reported (Mosaic GPU outlines each kernel as one).
knames=$(sed -n 's/^[^:]*: \([A-Za-z_][A-Za-z0-9_]*\): [0-9]* registers.*/\1/p' "$OUT/ptxas.txt" 2>/dev/null \
  | sort -u | paste -sd'|')
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ -n "$ncu_bin" ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu.txt 90 "$ncu_bin" --clock-control none \
    --kernel-name "regex:^(${knames:-main_kernel})\$" --launch-count 5 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    python benchmarks/kernels_ptxas.py --no-dump "${picks[@]}"
else
  echo "no ncu on this machine" >> "$OUT/ncu.txt"
fi
# Tilings beside the defaults on two goal shapes (kernels_fp8.py --cases tuning; a tiling a kernel rejects prints
# its ValueError at once): pipelined with 2 stages (three CTAs per SM), 64-column tiles, 128 rows; warp-specialized
# with a shallower ring, 64 columns, 256 rows, and DeepGEMM's 160 columns (fewer waves, B padded per call); each
# warp-specialized one also with multicast=2 (where the column tiles pair up).
step bench.log 90 python benchmarks/kernels_fp8.py --kernel "$fp8_kernels" --cases tuning --multicast \
  --tilings 64x128x2,64x128x3,64x64x6,128x64x8,128x128x5,128x128x4,128x160x4,256x64x4 --out "$OUT/bench_compare.txt"
step engine.txt 60 python -c "
import time, jaxinfer
p = jaxinfer.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm = jaxinfer.LLM()
for b in (1, 32):
    llm.generate(['def f(x):'] * b, p, use_tqdm=False)
    t0 = time.perf_counter(); outs = llm.generate(['def f(x):'] * b, p, use_tqdm=False)
    dt = time.perf_counter() - t0
    print(f'embedded model bf16, batch {b}: {b * 64 / dt:.1f} tok/s, text {outs[0].outputs[0].text[:60]!r}', flush=True)
"
step engine.txt 90 python benchmarks/speculative.py --batch-sizes 1,32 --verify all,confidence --rounds 3 \
  --max-tokens 64 --scheduler-steps 4
step engine.txt 60 python benchmarks/speculative.py --rounds-ab --batch-sizes 1,32 --rounds 3 --max-tokens 64 \
  --scheduler-steps 4
step engine.txt 45 python benchmarks/speculative.py --async-ab --batch-sizes 1,32 --rounds 3 --max-tokens 64 \
  --scheduler-steps 1
step bench.log 60 python benchmarks/kernels_mla.py --out "$OUT/bench_sweep.txt"
step bench.log 120 python benchmarks/kernels_fp8.py --out "$OUT/bench_sweep.txt"
echo "total $SECONDS s" >> "$OUT/env.txt"
tail -n 3 "$OUT"/*.txt "$OUT"/*.log
