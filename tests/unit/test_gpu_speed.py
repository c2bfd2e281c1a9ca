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
    result = gpu_speed.compare(
        "fp32", device="cpu", args=SMALL, warmup=2, steps=3, folder=tmp_path, round_=2
    )
    curves = result.curves
    assert len(curves["plain"]) == len(curves["stage"]) == 5
    assert curves["stage"] == pytest.approx(curves["plain"], rel=1e-5)
    assert curves["plain"][-1] < curves["plain"][0]
    cells = [cell.strip() for cell in result.row.strip("|").split("|")]
    header = [cell.strip() for cell in gpu_speed.HEADER.splitlines()[0].strip("|").split("|")]
    assert len(cells) == len(header) == 11 and cells[:2] == ["fp32", "2"]
    plain_ms, stage_ms, ratio = (float(c) for c in cells[2:5])
    assert plain_ms > 0 and stage_ms > 0
    assert result.ratio == pytest.approx(stage_ms / plain_ms, rel=0.01)  # the cells are rounded
    assert ratio == pytest.approx(result.ratio, abs=0.001)
    assert float(cells[5]) > 0 and float(cells[6]) > 0
    assert cells[10].endswith("%")


def test_without_a_gpu_it_says_so() -> None:
    if gpu_speed.torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="no CUDA GPU here"):
        gpu_speed.main(["--steps", "1"])


def test_it_needs_a_round() -> None:
    with pytest.raises(SystemExit, match="--rounds 0: give 1 or more"):
        gpu_speed.main(["--rounds", "0"])


def test_the_report_gives_every_round_and_each_precisions_ratios() -> None:
    def made(precision: str, round_: int, ratio: float) -> gpu_speed.Comparison:
        return gpu_speed.Comparison(f"| {precision} | {round_} |", ratio, {})

    comparisons = {
        "fp32": [made("fp32", 1, 0.9984), made("fp32", 2, 1.0021)],
        "bf16": [made("bf16", 1, 1.2481), made("bf16", 2, 1.0117)],
    }
    lines = gpu_speed.report("title", comparisons).splitlines()
    assert lines[:2] == ["title", ""]
    assert lines[2:4] == gpu_speed.HEADER.splitlines()
    assert lines[4:8] == ["| fp32 | 1 |", "| fp32 | 2 |", "| bf16 | 1 |", "| bf16 | 2 |"]
    assert lines[-1] == "stage / plain by round: fp32 0.998, 1.002; bf16 1.248, 1.012"


def test_a_failed_comparison_costs_only_its_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The GPU session runs the script once: a launch that fails must not take the table of
    the others with it."""

    def compare(precision: str, *, round_: int, **_: object) -> gpu_speed.Comparison:
        if (precision, round_) == ("bf16", 1):
            raise gpu_speed.LaunchFailed("pipedream train failed:\nCUDA out of memory")
        return gpu_speed.Comparison(f"| {precision} | {round_} |", 1.0 + round_ / 100, {})

    monkeypatch.setattr(gpu_speed, "compare", compare)
    monkeypatch.setattr(gpu_speed, "pin_to", lambda count: "0")
    monkeypatch.setattr(gpu_speed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_speed.torch.cuda, "get_device_name", lambda: "a GPU")
    assert gpu_speed.main([]) == 1
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[4:7] == ["| fp32 | 1 |", "| fp32 | 2 |", "| bf16 | 2 |"]
    assert lines[-2:] == [
        "stage / plain by round: fp32 1.010, 1.020; bf16 1.020",
        "FAILED: bf16 round 1: LaunchFailed: pipedream train failed:",
    ]
    assert "CUDA out of memory" in out.err
