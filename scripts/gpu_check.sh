#!/usr/bin/env bash
# The one prepared device run: native kernel tests, the kernel benchmarks (issue 4), then the engine on the GPU
# (the embedded model through LLM(): Pallas MLA decode over the paged cache, FP8 compute; issue 5), and last the
# warp-specialized FP8 GEMM variant (kernel="warp_specialized", not yet measured): its native tests, then, unless
# they hung, a few shapes benchmarked side by side with the pipelined kernel. Last so a hang cannot cost the rest.
# Usage on the GPU machine (offline, preinstalled jax 0.11): OUT=<dir> bash scripts/gpu_check.sh
# Each step has its own time limit, cut to what is left of the whole run's budget (BUDGET_S, default 470 s: the
# issue's "under 8 minutes", with room for the machine's start inside one 600 s device call); a step with under
# 15 s left is skipped and says so. Failures do not stop the rest; everything lands in $OUT, in 8 files at most
# (what the device tool brings back): the benchmarks' own logs share bench.log.
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

{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1;
  python -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1; } > "$OUT/env.txt"
# tests/conftest.py defaults JAX_PLATFORMS to cpu (8 simulated devices): the native tests need the GPU.
JAX_PLATFORMS=cuda,cpu step kernel_tests.txt 180 python -m pytest -q -x --durations=10 -k "not warp_specialized" \
  tests/test_kernels_gpu.py
step bench.log 90 python benchmarks/kernels_mla.py --out "$OUT/bench_mla.txt"
step bench.log 90 python benchmarks/kernels_fp8.py --out "$OUT/bench_fp8.txt"
# num_scheduler_steps: 1 is the GPU default; 8 (multi-step decode, the CPU default) is not measured on GPUs yet.
step engine.txt 120 python -c "
import time, jaxinfer
p = jaxinfer.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
for k in (1, 8):
    llm = jaxinfer.LLM(num_scheduler_steps=k)
    for b in (1, 32):
        llm.generate(['def f(x):'] * b, p, use_tqdm=False)
        t0 = time.perf_counter(); outs = llm.generate(['def f(x):'] * b, p, use_tqdm=False)
        dt = time.perf_counter() - t0
        print(f'embedded model bf16, num_scheduler_steps {k}, batch {b}: {b * 64 / dt:.1f} tok/s, '
              f'text {outs[0].outputs[0].text[:60]!r}', flush=True)
"
JAX_PLATFORMS=cuda,cpu step kernel_tests_ws.txt 75 python -m pytest -q --durations=5 -k warp_specialized \
  tests/test_kernels_gpu.py
ws_rc=$?
if [ "$ws_rc" -ne 124 ]; then
  step bench.log 75 python benchmarks/kernels_fp8.py --kernel both --cases compare --out "$OUT/bench_fp8_ws.txt"
fi
echo "total $SECONDS s" >> "$OUT/env.txt"
tail -n 3 "$OUT"/*.txt "$OUT"/*.log
