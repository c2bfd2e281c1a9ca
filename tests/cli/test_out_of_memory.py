"""A stage that runs out of device memory ends the run with one line: the rank, the action,
PyTorch's first sentences, the plan's estimate and how to fit (not a traceback per rank)."""

from __future__ import annotations

from pathlib import Path

from pipedream.formats.plan import Plan, Prediction, StagePlan, save_plan
from pipedream.runtime.out_of_memory import torch_summary

from launching import run_main
from oom_model import MESSAGE

SAID = (
    "pipedream train: failed: rank 0 ran out of memory on cpu in the forward of microbatch 2 at "
    "stage 0 (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.10 GiB of which 1.02 GiB is free); the plan estimated 1.5 GiB per worker of stage 0; "
    "plan for the device's memory (pipedream plan ... --memory SIZE), recompute activations "
    "(--recompute, or plan --recompute) or use smaller or fewer microbatches in flight; the "
    "last good checkpoint: none yet"
)


def test_a_stage_out_of_device_memory_ends_in_one_line(tmp_path: Path) -> None:
    prediction = Prediction(1.0, 1000.0, 0, (1.0,), (1.5 * 2**30,), 1.0)
    plan = Plan(
        "oom_model:build", "1f1b", 4, 1, 1, (StagePlan("0", "1", 1, (0,)),), prediction=prediction
    )
    save_plan(plan, tmp_path / "plan.yaml")
    # the model's third call: the forward of microbatch 2, after two good steps
    result = run_main(
        "train", str(tmp_path / "plan.yaml"), "--steps", "4", "--run-dir", str(tmp_path / "run"),
        "--no-progress",
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == SAID
    assert "Traceback" not in result.stderr


def test_the_summary_keeps_pytorchs_first_sentences() -> None:
    assert torch_summary(MESSAGE) == (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB "
        "of which 1.02 GiB is free"
    )
    assert torch_summary("") == "out of memory"


def test_a_model_that_does_not_fit_for_profiling_is_said_in_one_line(tmp_path: Path) -> None:
    result = run_main(
        "profile", "oom_model:build", "--workload-arg", "fail_at=1", "-o", str(tmp_path / "p.yaml")
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "pipedream profile: error: the model ran out of memory on cpu (CUDA out of memory. Tried "
        "to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.02 GiB is "
        "free): the profile runs the whole model, its optimizer state and one microbatch's "
        "activations on one device; profile on one with more memory, or with a smaller "
        "--microbatch-size (the plan's microbatches are then that size)"
    )
    assert not (tmp_path / "p.yaml").exists()


def test_a_stage_too_big_to_place_on_its_device_ends_in_one_line(tmp_path: Path) -> None:
    plan = Plan(
        "oom_model:build", "1f1b", 4, 1, 1, (StagePlan("0", "1", 1, (0,)),),
        workload_args={"placing": "true"},
    )  # fmt: skip
    save_plan(plan, tmp_path / "plan.yaml")
    result = run_main("train", str(tmp_path / "plan.yaml"), "--steps", "2", "--no-progress",
                      "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "pipedream train: failed: rank 0 ran out of memory on cpu placing stage 0 (its weights "
        "and buffers) (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        "capacity of 79.10 GiB of which 1.02 GiB is free); plan for the device's memory "
        "(pipedream plan ... --memory SIZE), recompute activations (--recompute, or plan "
        "--recompute) or use smaller or fewer microbatches in flight"
    )
    assert "Traceback" not in result.stderr
