#!/usr/bin/env bash
# The test suite against the oldest releases pipedream supports: the floors of pyproject.toml's
# dependencies and of its hf extra (tests/unit/test_packaging.py keeps the pins below equal to
# them), on the oldest Python it supports. One exception: transformers 4.x needs torch 2.9
# (hf_lm.MIN_TORCH_FOR_TRANSFORMERS_4), so next to torch 2.8 the oldest is transformers 5.0.
# Not part of .ci/run: it downloads several GB (torch from PyPI) into a virtual environment of
# its own.
#
#   PYTHON=python3.10 scripts/oldest_deps.sh [PYTEST ARGS...]     (default: -n 2)
# VENV sets the environment's folder (default: .venv-oldest, reused when it exists).
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin="${PYTHON:-python3.10}"
venv="${VENV:-.venv-oldest}"
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
"$venv/bin/python" -m pip install -q \
    torch==2.8.0 \
    pyyaml==6.0.1 \
    psutil==5.9.0 \
    tqdm==4.60.0 \
    numpy==1.24.4 \
    scikit-learn==1.3.0 \
    transformers==5.0.0
# the project and its test tools; the pins above already satisfy its own dependencies
"$venv/bin/python" -m pip install -q -e '.[test,hf]'
"$venv/bin/python" -c 'import sys, torch, numpy, transformers; print("Python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__, "transformers", transformers.__version__)'
if [ "$#" -eq 0 ]; then set -- -n 2; fi
exec "$venv/bin/python" -m pytest "$@"
