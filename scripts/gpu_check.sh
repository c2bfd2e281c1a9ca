#!/usr/bin/env bash
# The GPU check, for a machine with PyTorch and a CUDA GPU (no internet needed):
#   1. installs pipedream into that Python without touching its packages (--no-deps);
#   2. runs the GPU test tier (tests/gpu: one stage against a plain loop and without a host
#      synchronisation between its updates, the schedules' oracles, bf16, fp16, clipping,
#      recomputation, checkpoint and resume, evaluations during a run, a tied Hugging Face
#      model, with 2-4 ranks sharing one GPU; NCCL pipelines where the machine has a GPU per
#      rank, skipped where it has fewer);
#   3. times one stage against a plain PyTorch loop on the same GPU (benchmarks/gpu_speed.py)
#      and prints the table.
# Both parts run even when the first fails; the last line gives each one's time and outcome, and
# the script exits non-zero when either failed.
#
#   scripts/gpu_check.sh [OUT_DIR]      (OUT_DIR: where the log and the table go; default .)
# Set PYTHON to choose the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin="${PYTHON:-python3}"
out="${1:-.}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
"$python_bin" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -n 3
"$python_bin" -m pipedream.torch_support  # one line and status 2 where torch is too old
"$python_bin" -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU"; print("GPU:", torch.cuda.get_device_name(), "torch", torch.__version__)'
start=$(date +%s)
# the speed comparison runs even when a test fails; the script fails if either did
tests_rc=0
"$python_bin" -m pytest tests/gpu -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log" || tests_rc=$?
tests_s=$(( $(date +%s) - start ))
start=$(date +%s)
speed_rc=0
"$python_bin" benchmarks/gpu_speed.py --out "$out/gpu-speed.md" || speed_rc=$?
outcome() { [ "$1" = 0 ] && echo passed || echo "FAILED, status $1"; }
echo "GPU tier: ${tests_s} s ($(outcome "$tests_rc")); speed comparison: $(( $(date +%s) - start )) s ($(outcome "$speed_rc"))"
[ "$tests_rc" = 0 ] && [ "$speed_rc" = 0 ]
