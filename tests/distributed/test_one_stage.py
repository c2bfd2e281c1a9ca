"""One stage of the runtime is a plain PyTorch training loop: the same weights and losses as
the loop over the same microbatches (the GPU tier runs the same check on CUDA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipedream.runtime.checkpoint import load_full_state_dict

from launching import straight_plan, write_plan
from plain_loop import plain_loop
from runs import max_rel_diff
from workers import run_plan

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

ARGS = {"layers": "2", "dim": "32", "heads": "2", "seq": "16", "samples": "256"}  # Adam


@pytest.mark.parametrize(("schedule", "m"), [("pipedream", 1), ("1f1b", 3)])
def test_one_stage_equals_the_plain_loop(tmp_path: Path, schedule: str, m: int) -> None:
    steps, size = 8, 4
    layers = ["embed", "h0", "h1", "norm", "head"]
    plan = straight_plan(
        "gpt", [layers], schedule=schedule, microbatch_size=size, microbatches=m, workload_args=ARGS
    )
    run = tmp_path / "run"
    result = run_plan(
        write_plan(plan, tmp_path / "plan.yaml"),
        "--steps",
        str(steps),
        "--run-dir",
        str(run),
        "--timeout",
        "60",
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = load_full_state_dict(run / "checkpoints" / f"step-{steps:06d}")
    want, losses = plain_loop("gpt", ARGS, steps=steps, microbatches=m, microbatch_size=size)
    assert max_rel_diff(got, want) < 1e-5
    logged = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == pytest.approx(losses, rel=1e-6)


def test_a_lone_stage_is_busy_between_its_checkpoints(tmp_path: Path) -> None:
    """A stage that never waits for a peer reports itself busy, however long its checkpoints
    take: the busy fraction counts the time the segments ran, not the writes between them (a
    GPU run reported a lone stage 40% busy, the rest being the checkpoint and the start)."""
    layers = ["embed", "h0", "h1", "norm", "head"]
    plan = straight_plan("gpt", [layers], microbatch_size=4, microbatches=1, workload_args=ARGS)
    run = tmp_path / "run"
    result = run_plan(
        write_plan(plan, tmp_path / "plan.yaml"),
        *("--steps", "12", "--checkpoint-every", "1", "--keep", "1"),
        *("--run-dir", str(run), "--timeout", "60", "--no-progress"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (rank,) = json.loads((run / "summary.json").read_text())["ranks"]
    assert rank["busy_fraction"] > 0.5, rank
