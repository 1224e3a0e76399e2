#!/usr/bin/env bash
# The one prepared device run: native kernel tests, the kernel benchmarks (issue 4), then the engine on the GPU
# (the embedded model through LLM(): Pallas MLA decode over the paged cache, FP8 compute; issue 5), and last the
# warp-specialized FP8 GEMM variant (kernel="warp_specialized", not yet measured): its native tests, then, unless
# they hung, a few shapes benchmarked side by side with the pipelined kernel. Last so a hang cannot cost the rest.
# Usage on the GPU machine (offline, preinstalled jax 0.11): OUT=<dir> bash scripts/gpu_check.sh
# Each step has its own time limit and failures do not stop the rest; everything lands in $OUT.
set -u
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONPATH=.
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1;
  python -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1; } > "$OUT/env.txt"
# tests/conftest.py defaults JAX_PLATFORMS to cpu (8 simulated devices): the native tests need the GPU.
JAX_PLATFORMS=cuda,cpu timeout 240 python -m pytest -q -x --durations=10 -k "not warp_specialized" \
  tests/test_kernels_gpu.py > "$OUT/kernel_tests.txt" 2>&1
echo "kernel tests rc=$?" >> "$OUT/kernel_tests.txt"
timeout 120 python benchmarks/kernels_mla.py --out "$OUT/bench_mla.txt" > "$OUT/bench_mla.log" 2>&1
echo "mla bench rc=$?" >> "$OUT/bench_mla.log"
timeout 120 python benchmarks/kernels_fp8.py --out "$OUT/bench_fp8.txt" > "$OUT/bench_fp8.log" 2>&1
echo "fp8 bench rc=$?" >> "$OUT/bench_fp8.log"
timeout 150 python -c "
import time, jaxinfer
llm = jaxinfer.LLM()
p = jaxinfer.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
for b in (1, 32):
    llm.generate(['def f(x):'] * b, p, use_tqdm=False)
    t0 = time.perf_counter(); outs = llm.generate(['def f(x):'] * b, p, use_tqdm=False); dt = time.perf_counter() - t0
    print(f'embedded model bf16, batch {b}: {b * 64 / dt:.1f} tok/s, text {outs[0].outputs[0].text[:60]!r}')
" > "$OUT/engine.txt" 2>&1
echo "engine rc=$?" >> "$OUT/engine.txt"
JAX_PLATFORMS=cuda,cpu timeout 90 python -m pytest -q --durations=5 -k warp_specialized tests/test_kernels_gpu.py \
  > "$OUT/kernel_tests_ws.txt" 2>&1
ws_rc=$?
echo "warp-specialized kernel tests rc=$ws_rc" >> "$OUT/kernel_tests_ws.txt"
if [ "$ws_rc" -ne 124 ]; then
  timeout 100 python benchmarks/kernels_fp8.py --kernel both --cases compare --out "$OUT/bench_fp8_ws.txt" \
    > "$OUT/bench_fp8_ws.log" 2>&1
  echo "fp8 ws bench rc=$?" >> "$OUT/bench_fp8_ws.log"
fi
tail -n 3 "$OUT"/*.txt "$OUT"/*.log
