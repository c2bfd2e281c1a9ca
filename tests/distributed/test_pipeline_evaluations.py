"""``train --eval-every N`` on two ranks: the rank that logs the loss evaluates the whole model
at every N-th checkpoint while the other waits, longer than ``--timeout`` if it must, and the
training goes on as it would have with those checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launching import launch, run_main, straight_plan, write_plan
from plain_loop import plain_loop
from runs import max_rel_diff, train_and_load

pytestmark = pytest.mark.slow

GPT = {"layers": "2", "dim": "16", "heads": "2", "seq": "8", "vocab": "16", "samples": "64"}


def test_evaluations_during_a_pipeline_run_are_its_checkpoints_evaluations(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    support = str(Path(__file__).resolve().parents[1] / "support")  # eval_workload
    got = train_and_load(
        tmp_path, [["embed", "h0"], ["h1", "norm", "head"]], steps=8,
        workload="eval_workload:build", workload_args={"pause": "3.5"}, schedule="1f1b",
        microbatches=2, extra=("--eval-every", "4", "--timeout", "2"), said=said,
        env={"PYTHONPATH": support},
    )  # fmt: skip
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "evaluations.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [4, 8]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-000004",
        "step-000008",
    ]  # --eval-every without --checkpoint-every checkpoints where it evaluates
    summary = json.loads((run / "summary.json").read_text())
    assert records[1] == {"step": 8, **summary["evaluation"]}
    middle = run_main(
        "evaluate", str(run / "checkpoints" / "step-000004"), "--json", "--workload-arg", "pause=0"
    )
    assert middle.returncode == 0, middle.stderr
    assert {"step": 4, **records[0]} == {
        key: value for key, value in json.loads(middle.stdout).items() if key != "checkpoint"
    }
    assert records[0]["test_loss"] != records[1]["test_loss"]
    line = next(line for line in said if "evaluation:" in line and "step" in line)
    assert line == (
        f"step      4/8  evaluation: test_loss {records[0]['test_loss']:.4f}, best_loss "
        f"{records[0]['best_loss']:.4f}"
    )
    # the evaluation left the training as it was: a plain loop's weights
    want, _ = plain_loop("gpt", GPT, steps=8, microbatches=2, microbatch_size=8)  # its model
    assert max_rel_diff(got, want) < 1e-5


def test_a_failed_evaluation_stops_every_rank_in_one_line(tmp_path: Path) -> None:
    """The evaluating rank says why; the rank that waited stops without a word of its own,
    and ``launch.sh`` without torchrun's report."""
    support = str(Path(__file__).resolve().parents[1] / "support")  # eval_workload
    plan = straight_plan(
        "eval_workload:build", [["embed", "h0"], ["h1", "norm", "head"]], schedule="1f1b",
        microbatches=2, workload_args={"fail": "true"},
    )  # fmt: skip
    path = write_plan(plan, tmp_path / "plan.yaml")
    run = tmp_path / "run"
    said = launch(
        path, "--steps", "8", "--eval-every", "4", "--run-dir", str(run), "--no-progress",
        env={"PYTHONPATH": support},
    )  # fmt: skip
    assert said.returncode == 2, said.stderr[-3000:]
    lines = [line for line in said.stderr.splitlines() if "error" in line.lower()]
    assert lines == [
        "pipedream train: error: the workload's evaluation at step 4 failed (ValueError: the "
        "held-out set is missing); pipedream evaluate "
        f"{run / 'checkpoints' / 'step-000004'} shows where; fix it, then --resume auto "
        "continues from "
        f"{run / 'checkpoints' / 'step-000004'}, evaluating it first"
    ]
    assert "Traceback" not in said.stderr
