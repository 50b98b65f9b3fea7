#!/usr/bin/env bash
# One GPU check in one command (under 8 minutes on one H200 is the aim; each step's seconds are
# printed; a step past GPU_CHECK_STEP_S (150) or the total GPU_CHECK_TOTAL_S (450) is stopped): the triton backend's tests
# on CUDA, the GPU's bits against the CPU's (every rule x format), step times against torch fused
# AdamW, the compiled backend, torchao, bitsandbytes and FlashOptim (when their wheels are there),
# and first-step times. Results go to a folder ($1, else $OUT, else ./gpu_check_results). On a
# machine without CUDA the CUDA steps skip cleanly.
#   benchmarks/gpu_check.sh [--dry-run] [--wheels DIR] [RESULTS_DIR]
# --wheels DIR: first install, offline (pip --no-index), what the image lacks from the folder
# benchmarks/gpu_wheels.sh made beforehand on a machine with a network (this project, optree,
# numpy, pytest, the anchors' wheels). --dry-run lists every step, what it measures and its
# command, and runs none (CUDA ones are marked as skipped where there is no CUDA device).
set -u
cd "$(dirname "$0")/.."
DRY=0
WHEELS="${GPU_CHECK_WHEELS:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --wheels) WHEELS="${2:?--wheels needs a folder (benchmarks/gpu_wheels.sh makes it)}"; shift 2 ;;
    *) break ;;
  esac
done
RES="${1:-${OUT:-gpu_check_results}}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
STEP_S="${GPU_CHECK_STEP_S:-150}"
TOTAL_S="${GPU_CHECK_TOTAL_S:-450}"
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
  echo "--wheels $WHEELS: no such folder (make it with benchmarks/gpu_wheels.sh DIR where there is a network)" >&2
  exit 2
fi
HAS_CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
HAS_TRITON=$($PY -c "import importlib.util as u; print(int(u.find_spec('triton') is not None))" 2>/dev/null || echo 0)

# step NEEDS WHAT COMMAND: NEEDS is "any", "cuda" or "triton" (each skips cleanly without it). Steps
# run in order of what matters most; each gets at most STEP_S seconds and what is left of TOTAL_S.
START=$SECONDS
step() {
  local needs=$1 what=$2 cmd=$3 skip=""
  [ "$needs" = cuda ] && [ "$HAS_CUDA" != 1 ] && skip="no CUDA device"
  [ "$needs" = triton ] && [ "$HAS_TRITON" != 1 ] && skip="no triton (pip install -e \".[triton]\")"
  echo "-- $what"
  echo "   \$ $cmd"
  if [ -n "$skip" ]; then echo "   skipped: $skip"; return 0; fi
  [ "$DRY" = 1 ] && return 0
  local left=$((TOTAL_S - (SECONDS - START)))
  if [ "$left" -lt 30 ]; then echo "   skipped: out of time (GPU_CHECK_TOTAL_S=$TOTAL_S)" | tee -a "$RES/steps.txt"; return 0; fi
  local limit=$((left < STEP_S ? left : STEP_S)) t0=$SECONDS
  timeout "$limit" bash -c "set -o pipefail; $cmd"
  local rc=$?
  echo "   ($((SECONDS - t0)) s, rc $rc) $what" | tee -a "$RES/steps.txt"
  [ "$rc" = 124 ] && echo "   stopped after $limit s (GPU_CHECK_STEP_S / GPU_CHECK_TOTAL_S)" | tee -a "$RES/steps.txt"
  return 0
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
if [ -n "$WHEELS" ]; then  # what the image lacks; what it has (torch, triton, numpy) is kept, not upgraded; --no-deps: the
  # folder holds the dependencies the image lacks, and torch / triton are the image's
  PKGS=$(ls "$WHEELS" | sed -n 's/^\([A-Za-z0-9_.]*\)-[0-9].*\.whl$/\1/p' | tr _ - | sort -u | tr '\n' ' ')
  step any "install offline from the wheels folder: $PKGS" \
    "\$PY -m pip install -q --no-index --no-deps --find-links '$WHEELS' $PKGS 2>&1 | tee \"\$RES/install.txt\""
fi
IMPLS="torch-fused torch-foreach bridge-8bit bridge-4bit bridge-fp8 bridge-8bit-amsgrad bridge-lion-8bit bridge-sgd-8bit torchao-8bit torchao-4bit bnb-8bit"
ST="\$PY benchmarks/step_time.py --device cuda --steps 20"
step cuda "triton backend on the GPU (the automatic backend on CUDA): every rule x format, param dtypes, non-finite gradients, param correction, the GPU's bits against native's on the CPU; the automatic choice launching it" \
  "TRITON_INTERPRET=0 \$PY -m pytest -q -p no:cacheprovider -m triton tests/test_triton.py tests/test_backend_choice.py -k 'matches_native or param_dtypes or nonfinite or param_correction or launches_triton' 2>&1 | tail -n 20 | tee \"\$RES/tests_triton_cuda.txt\""
for CASE in a b c; do
  step cuda "step time and first step, case $CASE, automatic backend (triton): torch fused / foreach AdamW, the bridge's formats and rules, torchao, bitsandbytes" \
    "$ST --case $CASE --impl $IMPLS --json \"\$RES/step_time_cuda_$CASE.json\" 2>&1 | grep -v 'Failed to load' | tee -a \"\$RES/step_time_cuda.txt\""
done
for CASE in a b c; do
  step cuda "step time and first step, case $CASE, the compiled backend against torch fused AdamW" \
    "LOWBIT_TREE_BACKEND=compiled $ST --case $CASE --impl torch-fused bridge-8bit bridge-4bit bridge-fp8 --json \"\$RES/step_time_cuda_compiled_$CASE.json\" 2>&1 | grep -v 'Failed to load' | tee -a \"\$RES/step_time_cuda.txt\""
done
for CASE in a b; do
  step cuda "step time, case $CASE, bfloat16 params: plain, stochastic rounding, int8 correction, FlashOptim (its wheel in --wheels)" \
    "$ST --case $CASE --impl torch-fused torch-fused-bf16 bridge-8bit-bf16 bridge-8bit-bf16sr bridge-8bit-bf16c bridge-4bit-bf16c flashoptim-bf16c --json \"\$RES/step_time_cuda_bf16_$CASE.json\" 2>&1 | grep -v 'Failed to load' | tee -a \"\$RES/step_time_cuda.txt\""
done
step cuda "first step (compilations) and host work per param on Llama-7B's shapes / 4: triton and compiled backends" \
  "\$PY benchmarks/step_overhead.py --device cuda --shapes llama7b/4 --variants triton-8bit triton-fp32 compiled-8bit compiled-fp32 --runs 3 --steps 10 --json \"\$RES/step_overhead_cuda_llama.json\" 2>&1 | tee \"\$RES/step_overhead_cuda.txt\""
step cuda "first step and host work per param on 200 small params: triton and compiled backends" \
  "\$PY benchmarks/step_overhead.py --device cuda --shapes small --sizes 200 --variants triton-8bit compiled-8bit --runs 3 --steps 20 --json \"\$RES/step_overhead_cuda_small.json\" 2>&1 | tee -a \"\$RES/step_overhead_cuda.txt\""
step cuda "CUDA tests of the torch backends: every rule x state format against the CPU reference, the fast quantizers" \
  "\$PY -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels_step.py tests/test_kernels_codes.py tests/test_muon.py ${GPU_CHECK_ALL_TESTS:+tests} 2>&1 | tail -n 40 | tee \"\$RES/tests_cuda.txt\""
step cuda "step time, Muon: torch's against the bridge's fp32 / 8-bit / 4-bit momentum" \
  "$ST --case a --impl torch-fused torch-muon bridge-muon-fp32 bridge-muon-8bit bridge-muon-4bit functional-muon-8bit --json \"\$RES/step_time_cuda_muon.json\" 2>&1 | grep -v 'Failed to load' | tee -a \"\$RES/step_time_cuda.txt\""
step triton "triton kernel variants compiled for sm_80 / sm_90 with this triton: PTX scan, registers, spills, bytes per param" \
  "\$PY benchmarks/triton_compile.py --arch 80,90 --jobs \$(nproc) --cache \"\$RES/triton_cache\" | tee \"\$RES/triton_compile.txt\""
[ "$DRY" = 1 ] || echo "results in $RES ($((SECONDS - START)) s)"
