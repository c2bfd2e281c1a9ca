"""Checkpoint and resume: a resumed run equals an uninterrupted one, bit for bit; a checkpoint
taken under one plan resumes under another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launching import launch, straight_plan, write_plan

from pipedream.runtime.checkpoint import load_full_state_dict

ARGS = {"layers": "5", "width": "16", "lr": "0.1", "optimizer": "sgd", "momentum": "0.9"}
FOUR = [["0", "1"], ["2"], ["3"], ["4", "5"]]
TWO = [["0", "1", "2"], ["3", "4", "5"]]


def _train(tmp: Path, name: str, stages, schedule: str, m: int, *args: str) -> Path:
    plan = write_plan(
        straight_plan("mlp", stages, schedule=schedule, microbatches=m, workload_args=ARGS),
        tmp / f"{name}.yaml",
    )
    run_dir = tmp / name
    result = launch(plan, "--run-dir", str(run_dir), "--timeout", "60", "--no-progress", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_full_state_dict(run_dir / "checkpoints" / f"step-{step:06d}")


@pytest.mark.parametrize(("schedule", "m"), [("pipedream", 1), ("2bw", 3), ("1f1b", 2)])
def test_resume_equals_uninterrupted(tmp_path: Path, schedule: str, m: int) -> None:
    whole = _train(tmp_path, "whole", TWO, schedule, m, "--steps", "8", "--checkpoint-every", "4")
    part = _train(tmp_path, "part", TWO, schedule, m, "--steps", "4", "--checkpoint-every", "4")
    _train(
        tmp_path,
        "part",
        TWO,
        schedule,
        m,
        "--steps",
        "8",
        "--checkpoint-every",
        "4",
        "--resume",
        "auto",
    )
    expected, got = _weights(whole, 8), _weights(part, 8)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # momentum state was restored too: without it the weights would differ
    assert not all(torch.equal(_weights(whole, 4)[k], got[k]) for k in got)


def test_reshard_four_stages_to_two(tmp_path: Path) -> None:
    """1f1b is exact synchronous SGD, so resharding mid-run changes nothing."""
    four = _train(tmp_path, "four", FOUR, "1f1b", 2, "--steps", "4")
    checkpoint = four / "checkpoints" / "step-000004"
    resumed = _train(tmp_path, "two", TWO, "1f1b", 2, "--steps", "8", "--resume", str(checkpoint))
    straight_two = _train(
        tmp_path, "ref", TWO, "1f1b", 2, "--steps", "8", "--checkpoint-every", "4"
    )
    expected, got = _weights(straight_two, 8), _weights(resumed, 8)
    assert max(float((expected[k] - got[k]).abs().max()) for k in expected) < 1e-6
