"""``profile --precision bf16`` -> ``plan`` -> ``train`` -> ``simulate --trace``: the plan
records the profile's precision, the run trains in it unless ``--precision`` says otherwise,
and what the prediction or the simulation leaves out is said."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipedream.formats.plan import load_plan
from pipedream.formats.trace import RunSettings, load_traces

from launching import run_main

WORKLOAD = ("dtype_model:build", "--workload-arg", "dtype=float32")


def _profile_and_plan(tmp_path: Path, precision: str) -> tuple[Path, Path]:
    """A profile measured in ``precision`` and its plan on one worker, which records it."""
    profile, plan = tmp_path / "profile.yaml", tmp_path / "plan.yaml"
    quick = ("--warmup", "0", "--repeats", "1")
    made = run_main("profile", *WORKLOAD, "--precision", precision, *quick, "-o", str(profile))
    assert made.returncode == 0, made.stderr
    assert f"measured on cpu in {precision} (autocast)" in made.stdout
    planned = run_main("plan", str(profile), "--workers", "1", "-o", str(plan))
    assert planned.returncode == 0, planned.stderr
    assert f"{precision} (autocast, as profiled)" in planned.stdout
    assert load_plan(plan).precision == precision
    return profile, plan


def test_a_bf16_profile_makes_a_bf16_plan_which_trains_in_bf16(tmp_path: Path) -> None:
    _, plan = _profile_and_plan(tmp_path, "bf16")

    def train(name: str, *extra: str) -> str:
        result = run_main(
            "train", str(plan), "--steps", "2", "--trace", "--run-dir", str(tmp_path / name),
            "--no-progress", *extra,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stderr

    said = train("as-planned")
    assert "schedule pipedream, bf16 (autocast), 2 minibatches" in said
    assert "made from a profile in" not in said
    assert load_traces(tmp_path / "as-planned")[0].run == RunSettings("bf16", False)

    said = train("fp32", "--precision", "fp32", "--recompute")
    assert "bf16 (autocast)" not in said and "recomputing activations, 2 minibatches" in said
    assert (
        "(made without recomputation: plan --recompute predicts this run) (made from a profile "
        "in bf16, and the run trained in fp32: a plan from profile --precision fp32 predicts it)"
    ) in said
    assert load_traces(tmp_path / "fp32")[0].run == RunSettings("fp32", True)
    simulated = run_main("simulate", str(plan), "--trace", str(tmp_path / "fp32"))
    assert simulated.returncode == 0, simulated.stderr
    assert (
        f"note: the run in {tmp_path / 'fp32'} trained in fp32, and the profile was measured in "
        "bf16: profile with --precision fp32 to simulate that run"
    ) in simulated.stdout
    assert "recomputed activations in backward (--recompute), and the plan does not" in (
        simulated.stdout
    )
    simulated = run_main("simulate", str(plan), "--trace", str(tmp_path / "as-planned"))
    assert simulated.returncode == 0 and "note: the run in" not in simulated.stdout


def test_an_fp16_profile_plans_1f1b_and_trains_with_its_loss_scale_across_a_resume(
    tmp_path: Path,
) -> None:
    """The plan of an fp16 profile flushes (its loss scale skips an update everywhere or
    nowhere); the run skips what ``GradScaler`` skips, and a run resumed from its checkpoint
    goes on with the scale it had (from 65536 again, it skipped update 4 as well)."""
    from pipedream.runtime.checkpoint import load_full_state_dict

    from plain_loop import plain_loop
    from runs import max_rel_diff

    profile, plan = _profile_and_plan(tmp_path, "fp16")
    written = load_plan(plan)
    assert written.schedule == "1f1b"
    refused = run_main(
        "plan", str(profile), "--workers", "2", "--straight", "--schedule", "2bw",
        "-o", str(tmp_path / "no.yaml"),
    )  # fmt: skip
    assert refused.returncode == 2
    assert "the profile was measured in fp16" in refused.stderr

    def train(name: str, steps: int, *extra: str) -> str:
        result = run_main(
            "train", str(plan), "--steps", str(steps), "--run-dir", str(tmp_path / name),
            "--checkpoint-every", "4", "--no-progress", *extra,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stderr

    said = train("whole", 8)
    assert "schedule 1f1b, fp16 (autocast, loss scaling), 8 minibatches" in said
    assert "fp16 loss scaling: skipped 1 of 8 updates for an overflow; loss scale 32768" in said
    lines = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    skipped = [json.loads(line).get("skipped", False) for line in lines]
    assert skipped == [True] + [False] * 7  # and its norm is null (not finite)
    assert json.loads(lines[0])["grad_norm"] is None and json.loads(lines[1])["grad_norm"] > 0
    train("halves", 4)
    said = train("halves", 8, "--resume", "auto")
    assert "skipped 0 of 4 updates for an overflow; loss scale 32768 at the end" in said
    whole = load_full_state_dict(tmp_path / "whole" / "checkpoints" / "step-000008")
    resumed = load_full_state_dict(tmp_path / "halves" / "checkpoints" / "step-000008")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    want, _ = plain_loop(
        "dtype_model:build", {"dtype": "float32"}, steps=8, microbatches=written.microbatches,
        microbatch_size=written.microbatch_size, precision="fp16",
    )  # fmt: skip
    assert max_rel_diff(whole, want) < 1e-6


def test_a_run_resumed_in_another_precision_or_clipping_says_so(tmp_path: Path) -> None:
    from launching import straight_plan, write_plan

    plan = write_plan(straight_plan("mlp", [[str(i) for i in range(9)]]), tmp_path / "p.yaml")

    def train(steps: int, *extra: str) -> str:
        result = run_main(
            "train", str(plan), "--steps", str(steps), "--run-dir", str(tmp_path / "run"),
            "--no-progress", "--resume", "auto", *extra,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stderr

    train(1, "--precision", "fp16", "--clip-grad-norm", "1")
    said = train(2, "--precision", "fp16", "--clip-grad-norm", "1")
    assert "pipedream: note:" not in said
    said = train(3, "--precision", "bf16")
    step = tmp_path / "run" / "checkpoints" / "step-000002"
    assert (
        f"pipedream: note: {step} was trained in fp16, clipping gradients to norm 1; this run "
        "trains in bf16, no clipping (its fp16 loss scale is dropped)"
    ) in said


def test_fp16_refuses_a_model_with_float16_weights_as_grad_scaler_does(tmp_path: Path) -> None:
    from launching import straight_plan, write_plan

    plan = straight_plan(
        "dtype_model:build", [["0", "1", "2", "3", "4"]], workload_args={"dtype": "float16"}
    )
    path = write_plan(plan, tmp_path / "plan.yaml")
    said = run_main(
        "train", str(path), "--steps", "1", "--precision", "fp16", "--run-dir",
        str(tmp_path / "run"), "--no-progress",
    )  # fmt: skip
    assert said.returncode == 2
    assert said.stderr.strip() == (
        "pipedream train: error: --precision fp16 needs weights wider than float16 (autocast "
        "computes in float16, the loss scale carries the gradients into the weights' dtype), "
        "but the model's 0.weight is float16; build the model in float32, or train it in its "
        "own dtype with --precision fp32"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()
    plan["precision"] = "fp16"  # a plan of an fp16 profile: its precision, not the flag
    said = run_main("train", str(write_plan(plan, path)), "--steps", "1", "--no-progress")
    assert said.returncode == 2
    assert said.stderr.startswith("pipedream train: error: the plan's precision fp16 needs ")
    said = run_main(
        "profile", "dtype_model:build", "--workload-arg", "dtype=float16", "--precision", "fp16",
        "-o", str(tmp_path / "profile.yaml"),
    )  # fmt: skip
    assert said.returncode == 2 and not (tmp_path / "profile.yaml").exists()
    assert said.stderr.startswith("pipedream profile: error: profile --precision fp16 needs ")
