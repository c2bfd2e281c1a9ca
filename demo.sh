#!/usr/bin/env bash
# The three-command workflow on the built-in `digits` workload (scikit-learn's 8x8 digits):
# profile every layer, plan a 4-stage pipeline, train it with 4 CPU processes under PipeDream's
# asynchronous 1F1B schedule with weight stashing. Prints a falling loss, the end summary
# (time per minibatch measured vs predicted) and the held-out test accuracy.
#
#   ./demo.sh [WORKLOAD] [STEPS]        default: digits 300; output in demo/
set -euo pipefail
unset CDPATH  # cd goes where it is told, and says nothing
cd "$(dirname "$0")"
workload="${1:-digits}"
steps="${2:-300}"
python_bin="${PYTHON:-.venv/bin/python}"
if ! "$python_bin" -c 'import pipedream.runtime' 2>/dev/null; then
  echo "demo.sh: error: $python_bin: cannot import pipedream; set up first (README:" \
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e .), or name a Python" \
    "that has it (PYTHON=...)" >&2
  exit 2
fi
out="${DEMO_DIR:-demo}"
mkdir -p "$out"

echo "== 1/3 pipedream profile $workload"
"$python_bin" -m pipedream.cli profile "$workload" -o "$out/profile.yaml"
echo
echo "== 2/3 pipedream plan (4 workers, straight pipeline)"
"$python_bin" -m pipedream.cli plan "$out/profile.yaml" --workers 4 --straight -o "$out/plan.yaml"
echo
echo "== 3/3 ./launch.sh $out/plan.yaml --steps $steps"
PYTHON="$python_bin" OMP_NUM_THREADS=1 ./launch.sh "$out/plan.yaml" --steps "$steps" \
  --run-dir "$out/run-$(date +%Y%m%d-%H%M%S)"
