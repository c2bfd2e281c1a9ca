"""``pipedream train`` in one process: a run resumed with other optimizer settings in its plan's
``workload_args`` (a smaller ``lr`` for a last stretch) trains with them and says which changed,
an unchanged resume says nothing (docs/cli.md); a ``sys.stderr`` without a file descriptor is no
obstacle; counts of one are said in the singular."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pipedream.runtime.checkpoint import load_full_state_dict

from launching import run_main, straight_plan, write_plan


def _train(tmp_path: Path, name: str, lr: str, *args: str) -> str:
    plan = write_plan(
        straight_plan("mlp", [["0", "1", "2"]], workload_args={"layers": "2", "lr": lr}),
        tmp_path / f"{name}.yaml",
    )
    result = run_main("train", str(plan), "--no-progress", *args)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_a_resume_with_another_lr_trains_with_it_and_says_so(tmp_path: Path) -> None:
    run, other = str(tmp_path / "run"), str(tmp_path / "other")
    _train(tmp_path, "first", "0.05", "--steps", "2", "--checkpoint-every", "2", "--run-dir", run)
    step2 = str(tmp_path / "run" / "checkpoints" / "step-000002")
    same = _train(tmp_path, "same", "0.05", "--steps", "4", "--run-dir", run, "--resume", step2)
    assert "optimizer settings" not in same
    said = _train(tmp_path, "slower", "0.01", "--steps", "4", "--run-dir", other, "--resume", step2)
    assert (
        f"pipedream: the workload's optimizer settings differ from those of {step2} and are "
        "used: lr 0.05 -> 0.01 (the optimizer's state is the checkpoint's)\n"
    ) in said
    start = load_full_state_dict(step2)
    at_05 = load_full_state_dict(tmp_path / "run" / "checkpoints" / "step-000004")
    at_01 = load_full_state_dict(tmp_path / "other" / "checkpoints" / "step-000004")
    for name in start:  # from the same weights on the same data, smaller steps
        if start[name].is_floating_point() and not torch.equal(at_05[name], start[name]):
            moved_05 = (at_05[name] - start[name]).abs().sum()
            moved_01 = (at_01[name] - start[name]).abs().sum()
            assert 0 < moved_01 < moved_05


def test_a_stderr_without_a_file_descriptor_is_no_obstacle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``sys.stderr`` that has no file descriptor (a notebook's, or this test's capture): the
    fault handler goes to the process's own stderr, where ``pipedream train`` had failed with
    io.UnsupportedOperation before training."""
    from pipedream.runtime import train

    enabled_on = []

    def enable(file: object = None, all_threads: bool = False) -> None:
        stream = sys.stderr if file is None else file
        stream.fileno()  # type: ignore[attr-defined]  # as faulthandler: its descriptor
        enabled_on.append(stream)

    monkeypatch.setattr(train.faulthandler, "is_enabled", lambda: False)
    monkeypatch.setattr(train.faulthandler, "enable", enable)
    _train(tmp_path, "one", "0.05", "--steps", "1", "--run-dir", str(tmp_path / "run"))
    assert enabled_on == [sys.__stderr__]


def test_a_one_minibatch_run_of_one_rank_speaks_in_the_singular(tmp_path: Path) -> None:
    said = _train(tmp_path, "one", "0.05", "--steps", "1", "--run-dir", str(tmp_path / "run"))
    assert said.startswith(
        "pipedream: mlp on 1 gloo process, 1 stage, schedule pipedream, 1 minibatch of 1 x 8 "
        "samples; run dir "
    )
    assert "\ndone: 1 minibatch in " in said
    assert ", up to 1 microbatch in flight, 1 weight version held (0 copies x " in said
