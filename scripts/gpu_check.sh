#!/usr/bin/env bash
# The GPU check, for a machine with PyTorch and a CUDA GPU (no internet needed):
#   1. checks that the Python has what pipedream needs besides torch (PyYAML, numpy, pytest;
#      setuptools to install it), then installs pipedream into it without touching its
#      packages (--no-deps --no-build-isolation);
#   2. runs the GPU test tier (tests/gpu: one stage against a plain loop and without a host
#      synchronisation between its updates, the schedules' oracles, bf16, fp16, clipping,
#      recomputation, checkpoint and resume, evaluations during a run, a tied Hugging Face
#      model, with 2-4 ranks sharing one GPU; NCCL pipelines where the machine has a GPU per
#      rank, skipped where it has fewer);
#   3. times one stage against a plain PyTorch loop on the same GPU (benchmarks/gpu_speed.py)
#      and prints the table.
# Both parts run even when the first fails, each within a time limit of its own (a hang ends
# at the limit, with what ran so far reported); the last line gives each one's time and
# outcome, and the script exits non-zero when either failed.
#
#   scripts/gpu_check.sh [OUT_DIR]      (OUT_DIR: where the logs and the table go; default .)
# PYTHON chooses the interpreter (default: python3); GPU_CHECK_TIER_S and GPU_CHECK_SPEED_S
# limit the two parts (default 360 and 240 seconds).
set -euo pipefail
unset CDPATH  # cd goes where it is told, and says nothing
out="$(mkdir -p -- "${1:-.}" && cd -- "${1:-.}" && pwd)"  # before the cd below: the caller's
cd "$(dirname "$0")/.."
python_bin="${PYTHON:-python3}"
tier_limit="${GPU_CHECK_TIER_S:-360}"
speed_limit="${GPU_CHECK_SPEED_S:-240}"
export PYTHONUNBUFFERED=1
summary() { echo "$1" | tee -a "$out/gpu-check.txt"; }
: >"$out/gpu-check.txt"

# --- what pipedream needs besides torch: --no-deps installs none of it, and without build
# isolation (which would download setuptools) the install uses the Python's own setuptools ---
missing=$("$python_bin" -c '
import importlib.util
print(" ".join(m for m in ("torch", "yaml", "numpy", "pytest", "setuptools") if importlib.util.find_spec(m) is None))')
command -v timeout >/dev/null || missing="${missing:+$missing }timeout (coreutils)"
if [ -n "$missing" ]; then
  summary "gpu_check: not found: $missing (the check needs torch, yaml (PyYAML), numpy, pytest and setuptools in $python_bin, and coreutils' timeout; install what is missing, from wheels where there is no internet)"
  exit 2
fi
# --- install: pip's whole output goes to a log, and its end is shown if it fails ---
# (PIP_BREAK_SYSTEM_PACKAGES: a distribution's Python marked "externally managed" takes it)
if ! PIP_BREAK_SYSTEM_PACKAGES=1 "$python_bin" -m pip install --no-deps --no-build-isolation \
    -e . >"$out/pip-install.log" 2>&1; then
  tail -n 25 "$out/pip-install.log"
  summary "gpu_check: installing pipedream failed (log: $out/pip-install.log); it needs pip and setuptools >= 70.1, or setuptools 64 to 70.0 with the wheel package"
  exit 2
fi
"$python_bin" -m pipedream.torch_support  # one line and status 2 where torch is too old
gpu=$("$python_bin" -c 'import torch
if torch.cuda.is_available():
    print("GPU:", torch.cuda.get_device_name(), "torch", torch.__version__)')
if [ -z "$gpu" ]; then
  summary "gpu_check: PyTorch sees no CUDA GPU here ($("$python_bin" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'))"
  exit 2
fi
summary "$gpu"

# --- each part within its limit; SIGINT lets pytest stop the runs it started and report.
# At a terminal, timeout stays in the foreground process group, so that Ctrl-C reaches the part
# (in a group of its own the part would miss it); the check then stops once the part has
# reported, and tee -i keeps that report in the log ---
foreground=()
[ -t 0 ] && foreground=(--foreground)
trap 'summary "gpu_check: interrupted"; exit 130' INT
limited() { timeout ${foreground[@]+"${foreground[@]}"} --signal=INT --kill-after=30 "$@"; }
outcome() {  # status, limit, seconds taken
  case "$1" in
    0) echo passed ;;
    124) echo "STOPPED at its limit of $2 s" ;;
    137) if [ "$3" -ge "$2" ]; then echo "KILLED 30 s after its limit of $2 s"
         else echo "KILLED by SIGKILL: out of memory?"; fi ;;
    *) echo "FAILED, status $1" ;;
  esac
}
start=$(date +%s)
tests_rc=0
limited "$tier_limit" "$python_bin" -m pytest tests/gpu -m gpu -q -p no:cacheprovider 2>&1 \
  | tee -i "$out/gpu-tests.log" || tests_rc=$?
tests_s=$(($(date +%s) - start))
start=$(date +%s)
speed_rc=0
limited "$speed_limit" "$python_bin" benchmarks/gpu_speed.py --out "$out/gpu-speed.md" 2>&1 \
  | tee -i "$out/gpu-speed.log" || speed_rc=$?
speed_s=$(($(date +%s) - start))
summary "GPU tier: ${tests_s} s ($(outcome "$tests_rc" "$tier_limit" "$tests_s")); speed comparison: ${speed_s} s ($(outcome "$speed_rc" "$speed_limit" "$speed_s"))"
[ "$tests_rc" = 0 ] && [ "$speed_rc" = 0 ]
