#!/usr/bin/env bash
# One short GPU check: installs nothing; runs the CUDA tests and the step-time
# benchmark on cuda; writes everything to a results folder ($1, else $OUT, else
# ./gpu_check_results). On a machine without CUDA the CUDA parts skip cleanly.
set -u
cd "$(dirname "$0")/.."
RES="${1:-${OUT:-gpu_check_results}}"
mkdir -p "$RES"
PY="${PYTHON:-python}"
{
  echo "date: $(date -u +%FT%TZ)"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} > "$RES/env.txt" 2>&1
cat "$RES/env.txt"
HAS_CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))")

# CUDA tests (the suite's cuda-marked tests: every rule x state format x backend against the
# CPU reference, and the fast quantizers; without CUDA they are all skipped)
$PY -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels_step.py tests/test_kernels_codes.py tests/test_muon.py \
  ${GPU_CHECK_ALL_TESTS:+tests} \
  2>&1 | tail -n 40 | tee "$RES/tests_cuda.txt"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$RES/tests_cuda.txt"

if [ "$HAS_CUDA" = "1" ]; then
  $PY benchmarks/step_time.py --device cuda --case a --steps 20 --json "$RES/step_time_cuda_a.json" 2>&1 \
    | grep -v "Failed to load" | tee "$RES/step_time_cuda.txt"
  $PY benchmarks/step_time.py --device cuda --case b --steps 20 \
    --impl torch-fused torch-foreach bridge-8bit bridge-4bit bridge-fp8 bridge-8bit-bf16 bridge-8bit-bf16sr \
    bridge-8bit-amsgrad bridge-lion-8bit bridge-sgd-8bit functional-8bit torchao-8bit bnb-8bit \
    --json "$RES/step_time_cuda_b.json" 2>&1 | grep -v "Failed to load" | tee -a "$RES/step_time_cuda.txt"
  $PY benchmarks/step_time.py --device cuda --case a --steps 20 \
    --impl torch-fused torch-muon bridge-muon-fp32 bridge-muon-8bit bridge-muon-4bit functional-muon-8bit \
    --json "$RES/step_time_cuda_muon.json" 2>&1 | grep -v "Failed to load" | tee -a "$RES/step_time_cuda.txt"
  # the compiled backend (CUDA's default): first step (compilations), graphs, host overhead per
  # param, on Llama-7B's 291 param shapes divided by 4, and on 200 / 500 small params
  $PY benchmarks/step_overhead.py --device cuda --shapes llama7b/4 --variants compiled-8bit compiled-fp32 \
    --runs 3 --steps 10 --json "$RES/step_overhead_cuda_llama.json" 2>&1 | tee "$RES/step_overhead_cuda.txt"
  $PY benchmarks/step_overhead.py --device cuda --shapes small tiny --sizes 200 500 --variants compiled-8bit \
    compiled-fp32 --runs 3 --steps 20 --json "$RES/step_overhead_cuda_small.json" 2>&1 \
    | tee -a "$RES/step_overhead_cuda.txt"
else
  echo "no CUDA device: benchmark on cuda skipped" | tee "$RES/step_time_cuda.txt"
fi
echo "results in $RES"
