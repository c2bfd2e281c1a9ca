"""``pipedream evaluate CHECKPOINT``: the workload's evaluation of any checkpoint of a run, the
same numbers the run's summary gives for its last one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipedream.runtime import summary as summary_module

from launching import run_main, straight_plan, write_plan

GPT = {"layers": "1", "dim": "16", "heads": "2", "seq": "8", "vocab": "16", "samples": "64"}


def test_evaluate_gives_the_summarys_numbers_for_any_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = straight_plan("gpt", [["embed", "h0", "norm", "head"]], workload_args=GPT)
    path = write_plan(plan, tmp_path / "plan.yaml")
    run = tmp_path / "run"
    trained = run_main(
        "train", str(path), "--steps", "4", "--checkpoint-every", "2", "--run-dir", str(run),
        "--no-progress",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    summary = json.loads((run / "summary.json").read_text())
    last, middle = run / "checkpoints" / "step-000004", run / "checkpoints" / "step-000002"

    said = run_main("evaluate", str(last), "--json", "--device", "cpu")
    assert said.returncode == 0, said.stderr
    record = json.loads(said.stdout)
    assert record == {"checkpoint": str(last), "step": 4, **summary["evaluation"]}
    said = run_main("evaluate", str(middle))
    assert said.returncode == 0, said.stderr
    assert said.stdout.startswith(f"{middle} (step 2, gpt): test_loss ")
    earlier = float(said.stdout.split("test_loss ")[1].split(",")[0])
    assert earlier != summary["evaluation"]["test_loss"]  # another checkpoint, other weights

    # other held-out data: --workload-arg replaces the manifest's option
    said = run_main("evaluate", str(last), "--json", "--workload-arg", "test_samples=32")
    assert said.returncode == 0, said.stderr
    other = json.loads(said.stdout)
    assert other["test_loss"] != summary["evaluation"]["test_loss"]  # on 32 other sequences

    # a model the checkpoint does not fit (other options, changed code): one line, not a
    # traceback from load_state_dict
    manifest = middle / "manifest.yaml"
    manifest.write_text(manifest.read_text().replace("dim: '16'", "dim: '32'"))
    said = run_main("evaluate", str(middle))
    assert said.returncode == 2
    (line,) = said.stderr.strip().splitlines()
    assert line.startswith(f"pipedream evaluate: error: {middle}: ") and "has shape" in line

    # a diverged model's NaN is null in --json, as in summary.json (strict JSON readers)
    monkeypatch.setattr(
        summary_module, "evaluate_checkpoint", lambda *args: {"test_loss": float("nan")}
    )
    said = run_main("evaluate", str(last), "--json")
    assert json.loads(said.stdout)["test_loss"] is None and "NaN" not in said.stdout


def test_evaluate_says_what_it_cannot_do(tmp_path: Path) -> None:
    missing = run_main("evaluate", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        f"pipedream evaluate: error: {tmp_path / 'nowhere'}: no such checkpoint directory; "
        "pass runs/<run>/checkpoints/step-NNNNNN"
    )
    plan = write_plan(straight_plan("mlp", [[str(i) for i in range(9)]]), tmp_path / "plan.yaml")
    run = tmp_path / "run"
    trained = run_main("train", str(plan), "--steps", "1", "--run-dir", str(run), "--no-progress")
    assert trained.returncode == 0, trained.stderr
    said = run_main("evaluate", str(run / "checkpoints" / "step-000001"))
    assert said.returncode == 2
    assert said.stderr.strip() == (
        "pipedream evaluate: error: mlp: the workload defines no evaluation (Workload.evaluate); "
        "give it one to evaluate its checkpoints"
    )
