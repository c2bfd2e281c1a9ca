"""``scripts/gpu_check.sh`` on a machine that cannot run it: it says so in one line, before
installing anything, and writes where the caller asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
        f"gpu_check: {bare} lacks: torch yaml numpy pytest setuptools (the check needs torch, yaml "
        "(PyYAML), numpy, pytest and setuptools; install what is missing, from wheels where there "
        "is no internet)"
    )
    assert (result.returncode, result.stdout.strip()) == (2, line), result.stderr
    assert (tmp_path / "out" / "gpu-check.txt").read_text().strip() == line
    assert not (tmp_path / "out" / "pip-install.log").exists()  # nothing was installed
