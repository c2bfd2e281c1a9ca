"""``--eval-every``'s parts in one process: its options, the detached copy an evaluation
runs on, and the evaluation of a checkpoint that leaves the trained model alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipedream.runtime.evaluation import detached_copy, evaluate_during_run
from pipedream.runtime.summary import evaluate_checkpoint
from pipedream.workload import load_workload

from launching import run_main, straight_plan, write_plan

GPT = {"layers": "1", "dim": "16", "heads": "2", "seq": "8", "vocab": "16", "samples": "64"}


def test_the_detached_copy_shares_nothing_and_keeps_what_a_state_dict_leaves_out() -> None:
    pytest.importorskip("transformers")
    args = {"config": "llama", "layers": "1", "dim": "16", "heads": "2", "vocab": "32"}
    model = load_workload("hf-lm", {**args, "seq": "8", "samples": "32"}).model
    copy = detached_copy(model)
    assert {p.device.type for p in copy.parameters()} == {"meta"}
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # the tie, copied
    rotary = dict(copy.named_buffers())  # not in the state dict: a real copy
    assert rotary and all(b.device.type == "cpu" for b in rotary.values())
    copy.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    tokens = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        assert torch.equal(copy(tokens).logits, model(tokens).logits)
    with torch.no_grad():
        copy.lm_head.weight.zero_()
    assert model.lm_head.weight.abs().sum() > 0


def test_an_evaluation_during_the_run_leaves_the_trained_model_alone(tmp_path: Path) -> None:
    plan = straight_plan("gpt", [["embed", "h0", "norm", "head"]], workload_args=GPT)
    path = write_plan(plan, tmp_path / "plan.yaml")
    trained = run_main(
        "train", str(path), "--steps", "2", "--run-dir", str(tmp_path / "run"), "--no-progress"
    )
    assert trained.returncode == 0, trained.stderr
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    workload = load_workload("gpt", GPT, microbatch_size=8)
    with torch.no_grad():  # the live weights, trained on past the checkpoint
        for parameter in workload.model.parameters():
            parameter.fill_(0.5)
    metrics = evaluate_during_run(workload, checkpoint, torch.device("cpu"))
    assert all(bool((p == 0.5).all()) for p in workload.model.parameters())
    assert metrics == evaluate_checkpoint(workload, checkpoint, torch.device("cpu"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert metrics == summary["evaluation"]


def test_eval_every_says_what_cannot_work(tmp_path: Path) -> None:
    gpt = write_plan(
        straight_plan("gpt", [["embed", "h0", "norm", "head"]], workload_args=GPT),
        tmp_path / "gpt.yaml",
    )
    mlp = write_plan(straight_plan("mlp", [[str(i) for i in range(9)]]), tmp_path / "mlp.yaml")
    cases = [
        (gpt, ("--eval-every", "-1"), "--eval-every must be >= 0, got -1; 0 evaluates only at "
         "the end"),
        (gpt, ("--eval-every", "6", "--checkpoint-every", "4"), "--eval-every 6 is not a "
         "multiple of --checkpoint-every 4: each evaluation is of a checkpoint; use e.g. "
         "--eval-every 4"),
        (mlp, ("--eval-every", "2"), "--eval-every 2: the workload mlp defines no evaluation "
         "(Workload.evaluate); give it one, or leave --eval-every out"),
    ]  # fmt: skip
    for plan, options, message in cases:
        said = run_main(
            "train", str(plan), "--steps", "4", "--run-dir", str(tmp_path / "run"),
            "--no-progress", *options,
        )  # fmt: skip
        assert said.returncode == 2, said.stderr
        assert said.stderr.strip() == f"pipedream train: error: {message}"
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_failed_evaluation_ends_the_run_in_one_line_and_a_resumed_run_makes_it(
    tmp_path: Path,
) -> None:
    stages = [["embed", "h0", "h1", "norm", "head"]]
    failing = straight_plan("eval_workload:build", stages, workload_args={"fail": "true"})
    run = tmp_path / "run"

    def train(plan: dict[str, object], *options: str) -> str:
        path = write_plan(plan, tmp_path / "plan.yaml")
        said = run_main(
            "train", str(path), "--run-dir", str(run), "--no-progress", "--eval-every", "4",
            *options,
        )  # fmt: skip
        return f"{said.returncode} {said.stderr.strip()}"

    said = train(failing, "--steps", "8")
    checkpoint = run / "checkpoints" / "step-000004"
    assert said.splitlines()[-1] == (
        "pipedream train: error: the workload's evaluation at step 4 failed (ValueError: the "
        "held-out set is missing); pipedream evaluate "
        f"{run / 'checkpoints' / 'step-000004'} shows where; fix it, then --resume auto "
        "continues from "
        f"{checkpoint}, evaluating it first"
    )
    assert said.startswith("2 ") and "Traceback" not in said
    fixed = straight_plan("eval_workload:build", stages, workload_args={"fail": "false"})
    said = train(fixed, "--steps", "8", "--resume", "auto")
    assert said.startswith("0 ") and "step      4/8  evaluation: test_loss " in said
    said = train(fixed, "--steps", "12", "--resume", "auto")  # from step 8, evaluated
    assert said.startswith("0 ") and "step      8/12  evaluation" not in said
    lines = (run / "evaluations.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 8, 12]

    # the final checkpoint's evaluation fails after the summary is written, in one line too
    said = train(failing, "--steps", "16", "--resume", "auto")
    final = run / "checkpoints" / "step-000016"
    assert said.startswith("2 ") and "Traceback" not in said
    assert said.splitlines()[-1] == (
        "pipedream train: error: the workload's evaluation of the final checkpoint failed "
        "(ValueError: the held-out set is missing); the run is complete: pipedream evaluate "
        f"{final} shows where it fails, and evaluates it once fixed"
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["minibatches"] == 4 and "evaluation" not in summary
    assert summary["evaluation_error"] == said.splitlines()[-1].removeprefix(
        "pipedream train: error: "
    )


def test_the_options_that_set_the_checkpoints_are_named(tmp_path: Path) -> None:
    plan = straight_plan("mlp", [["0", "1", "2", "3"], ["4", "5", "6", "7", "8"]], replicas=[1, 2])
    path = write_plan(plan, tmp_path / "plan.yaml")
    said = run_main("train", str(path), "--steps", "8", "--eval-every", "3", "--no-progress")
    assert said.returncode == 2
    assert said.stderr.strip() == (
        "pipedream train: error: stage 1 has 2 replicas, so --steps and --eval-every must be "
        "multiples of 2 (a segment of 3 minibatches starts at 0)"
    )
