#!/usr/bin/env bash
# One short GPU check: installs nothing; runs the CUDA tests, the triton backend's checks and the
# step-time benchmarks on cuda; writes everything to a results folder ($1, else $OUT, else
# ./gpu_check_results). On a machine without CUDA the CUDA parts skip cleanly.
#   benchmarks/gpu_check.sh [--dry-run] [RESULTS_DIR]
# --dry-run lists every step, what it measures and its command, and runs none (CUDA ones are
# marked as skipped where there is no CUDA device).
set -u
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
RES="${1:-${OUT:-gpu_check_results}}"
PY="${PYTHON:-python}"
HAS_CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
HAS_TRITON=$($PY -c "import importlib.util as u; print(int(u.find_spec('triton') is not None))" 2>/dev/null || echo 0)

# step NEEDS WHAT COMMAND: NEEDS is "any", "cuda" or "triton" (each skips cleanly without it)
step() {
  local needs=$1 what=$2 cmd=$3 skip=""
  [ "$needs" = cuda ] && [ "$HAS_CUDA" != 1 ] && skip="no CUDA device"
  [ "$needs" = triton ] && [ "$HAS_TRITON" != 1 ] && skip="no triton (pip install -e \".[triton]\")"
  echo "-- $what"
  echo "   \$ $cmd"
  if [ -n "$skip" ]; then echo "   skipped: $skip"; return 0; fi
  [ "$DRY" = 1 ] && return 0
  bash -c "$cmd"
}

if [ "$DRY" = 1 ]; then
  echo "gpu_check.sh --dry-run: cuda $HAS_CUDA, triton $HAS_TRITON; results would go to $RES"
else
  mkdir -p "$RES"
  {
    echo "date: $(date -u +%FT%TZ)"
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    $PY -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not installed"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  } > "$RES/env.txt" 2>&1
  cat "$RES/env.txt"
fi

export PY RES
step any "CUDA tests: every rule x state format x backend against the CPU reference, the fast quantizers (skip without CUDA)" \
  "\$PY -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels_step.py tests/test_kernels_codes.py tests/test_muon.py ${GPU_CHECK_ALL_TESTS:+tests} 2>&1 | tail -n 40 | tee \"\$RES/tests_cuda.txt\""
step triton "triton backend: every rule x format x param dtype, bits against native, under the interpreter" \
  "\$PY -m pytest -q -p no:cacheprovider -m triton tests/test_triton.py 2>&1 | tail -n 20 | tee \"\$RES/tests_triton.txt\""
step cuda "triton backend on the GPU: every rule x format x param dtype, the GPU's bits against native's on the CPU" \
  "TRITON_INTERPRET=0 \$PY -m pytest -q -p no:cacheprovider -m triton tests/test_triton.py -k 'matches_native or param_dtypes or nonfinite or param_correction' 2>&1 | tail -n 20 | tee \"\$RES/tests_triton_cuda.txt\""
step triton "triton kernel variants compiled for sm_80 / sm_90: PTX scan, registers, spills, bytes per param" \
  "\$PY benchmarks/triton_compile.py --arch 80,90 --cache \"\$RES/triton_cache\" | tee \"\$RES/triton_compile.txt\""
step cuda "step time, case a: torch fused AdamW against the bridge's 8-bit AdamW" \
  "\$PY benchmarks/step_time.py --device cuda --case a --steps 20 --json \"\$RES/step_time_cuda_a.json\" 2>&1 | grep -v 'Failed to load' | tee \"\$RES/step_time_cuda.txt\""
step cuda "step time, case b: torch fused / foreach, the bridge's formats and rules, torchao, bitsandbytes" \
  "\$PY benchmarks/step_time.py --device cuda --case b --steps 20 --impl torch-fused torch-foreach bridge-8bit bridge-4bit bridge-fp8 bridge-8bit-bf16 bridge-8bit-bf16sr bridge-8bit-amsgrad bridge-lion-8bit bridge-sgd-8bit functional-8bit torchao-8bit bnb-8bit --json \"\$RES/step_time_cuda_b.json\" 2>&1 | grep -v 'Failed to load' | tee -a \"\$RES/step_time_cuda.txt\""
# FlashOptim's wheel (pure Python + Triton): `pip download flashoptim --no-deps -d DIR` where there is a
# network, then GPU_CHECK_WHEELS=DIR; the GPU machine has none
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  step cuda "FlashOptim from its wheel" "\$PY -m pip install --no-deps --no-index -q \"$GPU_CHECK_WHEELS\"/flashoptim-*.whl"
fi
for CASE in a b; do
  step cuda "step time, case $CASE, bfloat16 params: plain, stochastic rounding, int8 correction, FlashOptim" \
    "\$PY benchmarks/step_time.py --device cuda --case $CASE --steps 20 --impl torch-fused torch-fused-bf16 bridge-8bit bridge-8bit-bf16 bridge-8bit-bf16sr bridge-8bit-bf16c bridge-4bit-bf16c flashoptim-bf16c --json \"\$RES/step_time_cuda_bf16_$CASE.json\" 2>&1 | grep -v 'Failed to load' | tee -a \"\$RES/step_time_cuda.txt\""
done
step cuda "step time, Muon: torch's against the bridge's fp32 / 8-bit / 4-bit momentum" \
  "\$PY benchmarks/step_time.py --device cuda --case a --steps 20 --impl torch-fused torch-muon bridge-muon-fp32 bridge-muon-8bit bridge-muon-4bit functional-muon-8bit --json \"\$RES/step_time_cuda_muon.json\" 2>&1 | grep -v 'Failed to load' | tee -a \"\$RES/step_time_cuda.txt\""
step cuda "compiled backend: first step (compilations), graphs, host work per param on Llama-7B's shapes / 4" \
  "\$PY benchmarks/step_overhead.py --device cuda --shapes llama7b/4 --variants compiled-8bit compiled-fp32 --runs 3 --steps 10 --json \"\$RES/step_overhead_cuda_llama.json\" 2>&1 | tee \"\$RES/step_overhead_cuda.txt\""
step cuda "compiled backend on 200 / 500 small params" \
  "\$PY benchmarks/step_overhead.py --device cuda --shapes small tiny --sizes 200 500 --variants compiled-8bit compiled-fp32 --runs 3 --steps 20 --json \"\$RES/step_overhead_cuda_small.json\" 2>&1 | tee -a \"\$RES/step_overhead_cuda.txt\""
[ "$DRY" = 1 ] || echo "results in $RES"
