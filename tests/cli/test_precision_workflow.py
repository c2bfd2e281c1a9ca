"""``profile --precision bf16`` -> ``plan`` -> ``train`` -> ``simulate --trace``: the plan
records the profile's precision, the run trains in it unless ``--precision`` says otherwise,
and what the prediction or the simulation leaves out is said."""

from __future__ import annotations

from pathlib import Path

from pipedream.formats.plan import load_plan
from pipedream.formats.trace import RunSettings, load_traces

from launching import run_main

WORKLOAD = ("dtype_model:build", "--workload-arg", "dtype=float32")


def test_a_bf16_profile_makes_a_bf16_plan_which_trains_in_bf16(tmp_path: Path) -> None:
    profile, plan = tmp_path / "profile.yaml", tmp_path / "plan.yaml"
    quick = ("--warmup", "0", "--repeats", "1")
    made = run_main("profile", *WORKLOAD, "--precision", "bf16", *quick, "-o", str(profile))
    assert made.returncode == 0, made.stderr
    assert "measured on cpu in bf16 (autocast)" in made.stdout
    planned = run_main("plan", str(profile), "--workers", "1", "-o", str(plan))
    assert planned.returncode == 0, planned.stderr
    assert "bf16 (autocast, as profiled)" in planned.stdout
    assert load_plan(plan).precision == "bf16"

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
