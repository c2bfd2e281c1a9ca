"""``benchmarks/gpu_speed.py`` on the CPU with a small model: the comparison a GPU session runs
once, in the few minutes it has, is whole here (the plan it launches, the CLI options it
passes, the metrics and summary fields it reads), and its two sides train the same thing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_speed  # noqa: E402

SMALL = {"layers": "2", "dim": "32", "heads": "2", "seq": "16", "vocab": "64", "samples": "128"}


@pytest.mark.slow
def test_one_stage_and_the_plain_loop_train_the_same_model(tmp_path: Path) -> None:
    row, curves = gpu_speed.compare(
        "fp32", device="cpu", args=SMALL, warmup=2, steps=3, folder=tmp_path
    )
    assert len(curves["plain"]) == len(curves["stage"]) == 5
    assert curves["stage"] == pytest.approx(curves["plain"], rel=1e-5)
    assert curves["plain"][-1] < curves["plain"][0]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells) == 10 and cells[0] == "fp32"
    plain_ms, stage_ms, ratio = (float(c) for c in cells[1:4])
    assert plain_ms > 0 and stage_ms > 0
    assert ratio == pytest.approx(stage_ms / plain_ms, abs=0.01)
    assert float(cells[4]) > 0 and float(cells[5]) > 0
    assert cells[9].endswith("%")


def test_without_a_gpu_it_says_so() -> None:
    if gpu_speed.torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="no CUDA GPU here"):
        gpu_speed.main(["--steps", "1"])
