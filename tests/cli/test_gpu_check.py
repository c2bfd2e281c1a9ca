"""``scripts/gpu_check.sh``: on a machine that cannot run it, it says why in one line; a part
that hangs is stopped at its limit while the other still runs; it writes where the caller
asked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def test_a_python_without_the_packages_is_named_in_one_line(tmp_path: Path) -> None:
    """A Python that sees no site-packages (``-S``) lacks torch, PyYAML, numpy, pytest and
    setuptools; the line lands in ``OUT_DIR/gpu-check.txt``, OUT_DIR taken relative to the
    caller (the script changes to the checkout, where a relative OUT_DIR once landed)."""
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    result = subprocess.run(
        ["bash", str(SCRIPT), "out"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHON=str(bare)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = (
        "gpu_check: not found: torch yaml numpy pytest setuptools (the check needs torch, yaml "
        f"(PyYAML), numpy, pytest and setuptools in {bare}, and coreutils' timeout; install what "
        "is missing, from wheels where there is no internet)"
    )
    assert (result.returncode, result.stdout.strip()) == (2, line), result.stderr
    assert (tmp_path / "out" / "gpu-check.txt").read_text().strip() == line
    assert not (tmp_path / "out" / "pip-install.log").exists()  # nothing was installed


STUB = """#!/usr/bin/env bash
# A Python that has everything and a GPU, whose test tier hangs: the check's time limit stops it.
case "$*" in
  *"find_spec"*) echo ;;  # nothing missing
  *"-m pip install"*) echo installed ;;
  *"-m pipedream.torch_support"*) ;;
  *"torch.cuda.is_available"*) echo "GPU: stub" ;;
  *"-m pytest"*) trap 'echo "tier: interrupted"; exit 2' INT; echo "tier: running"; sleep 30 ;;
  *"gpu_speed.py"*) echo "| the speed table |" ;;
  *) exec "{python}" "$@" ;;
esac
"""


def test_a_part_that_hangs_is_stopped_at_its_limit_and_the_other_still_runs(
    tmp_path: Path,
) -> None:
    stub = tmp_path / "stub-python"
    stub.write_text(STUB.replace("{python}", sys.executable))
    stub.chmod(0o755)
    env = dict(os.environ, PYTHON=str(stub), GPU_CHECK_TIER_S="2")
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        stdin=subprocess.DEVNULL,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    last = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 1, result.stderr
    assert re.fullmatch(
        r"GPU tier: \d+ s \(STOPPED at its limit of 2 s\); speed comparison: \d+ s \(passed\)",
        last,
    ), last
    out = tmp_path / "out"
    assert (out / "gpu-tests.log").read_text() == "tier: running\ntier: interrupted\n"
    assert (out / "gpu-speed.log").read_text() == "| the speed table |\n"
    assert (out / "gpu-check.txt").read_text() == f"GPU: stub\n{last}\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_a_machine_without_a_gpu_is_told_so_in_one_line(tmp_path: Path) -> None:
    """This Python, its install stubbed (the test's own environment stays as it is)."""
    stub = tmp_path / "python"
    stub.write_text(  # the preflight answered too: the test's Python need not have setuptools
        '#!/usr/bin/env bash\ncase "$*" in *"-m pip install"*) ;; *"find_spec"*) echo ;; '
        f'*) exec "{sys.executable}" "$@" ;; esac\n'
    )
    stub.chmod(0o755)
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        env=dict(os.environ, PYTHON=str(stub)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = (
        f"gpu_check: PyTorch sees no CUDA GPU here (torch {torch.__version__} CUDA "
        f"{torch.version.cuda})"
    )
    assert (result.returncode, result.stdout.strip()) == (2, line), result.stderr
    assert (tmp_path / "out" / "gpu-check.txt").read_text() == line + "\n"
