"""A checkpoint taken under one plan resumes under another (a resumed run ending on an
uninterrupted one's bits, per schedule: test_schedules.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.formats.plan import load_plan
from pipedream.formats.trace import load_traces
from pipedream.optimizer.measured import measure_run, tables_of_run
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.workload import load_workload

from launching import straight_plan, write_plan
from oracles import plain_training
from runs import max_rel_diff
from workers import run_plan

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

ARGS = {"layers": "5", "width": "16", "lr": "0.1", "optimizer": "sgd", "momentum": "0.9"}
FOUR = [["0", "1"], ["2"], ["3"], ["4", "5"]]
TWO = [["0", "1", "2"], ["3", "4", "5"]]


def _train(tmp: Path, name: str, stages, schedule: str, m: int, *args: str) -> Path:
    plan = write_plan(
        straight_plan("mlp", stages, schedule=schedule, microbatches=m, workload_args=ARGS),
        tmp / f"{name}.yaml",
    )
    run_dir = tmp / name
    result = run_plan(plan, "--run-dir", str(run_dir), "--timeout", "60", "--no-progress", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_full_state_dict(run_dir / "checkpoints" / f"step-{step:06d}")


def test_reshard_four_stages_to_two(tmp_path: Path) -> None:
    """1f1b is exact synchronous SGD, so resharding mid-run changes nothing: four stages for 4
    minibatches, then two stages to 8, end where plain training on the whole minibatches ends."""
    four = _train(tmp_path, "four", FOUR, "1f1b", 2, "--steps", "4")
    checkpoint = four / "checkpoints" / "step-000004"
    resumed = _train(tmp_path, "two", TWO, "1f1b", 2, "--steps", "8", "--resume", str(checkpoint))

    workload = load_workload("mlp", ARGS)
    data = MicrobatchStream(workload.dataset, 8, 0)  # the plans' microbatch size, default seed

    def minibatch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [data.microbatch(2 * k + j) for j in range(2)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    want = plain_training(
        workload.model,
        num_updates=8,
        batch=minibatch,
        loss_fn=workload.loss_fn,
        optimizer=workload.optimizer,
    )
    assert max_rel_diff(_weights(resumed, 8), want) < 1e-5


def _rewrite_as(checkpoint: Path, stages: list[list[str]], out: Path) -> Path:
    """The same merged weights (and optimizer state), re-split into ``stages`` stage files."""
    from pipedream.runtime.checkpoint import (
        load_manifest,
        load_stage_file,
        save_stage_file,
        write_manifest,
    )

    manifest = load_manifest(checkpoint)
    payloads = [load_stage_file(checkpoint, entry) for entry in manifest["stages"]]
    model = {k: v for p in payloads for k, v in p["model"].items()}
    state = {k: v for p in payloads for k, v in p["optimizer"]["state"].items()}
    groups = payloads[0]["optimizer"]["param_groups"]
    files = []
    for index, layers in enumerate(stages):
        mine = [k for k in model if k.split(".")[0] in layers]
        payload = {
            **payloads[0],
            "stage": index,
            "layers": layers,
            "model": {k: model[k] for k in mine},
            "optimizer": {
                "state": {k: state[k] for k in mine if k in state},
                "param_groups": [{**groups[0], "params": mine}],
            },
        }
        files.append(save_stage_file(out, index, payload))
    extra = {k: v for k, v in manifest.items() if k not in ("format", "step", "stages")}
    write_manifest(out, step=manifest["step"], files=files, extra=extra)
    return out


def test_reshard_async_run_equals_resume_from_merged_weights(tmp_path: Path) -> None:
    four = _train(tmp_path, "four", FOUR, "pipedream", 1, "--steps", "4")
    checkpoint = four / "checkpoints" / "step-000004"
    merged = _rewrite_as(checkpoint, TWO, tmp_path / "merged" / "step-000004")
    a = _train(tmp_path, "a", TWO, "pipedream", 1, "--steps", "8", "--resume", str(checkpoint))
    b = _train(tmp_path, "b", TWO, "pipedream", 1, "--steps", "8", "--resume", str(merged))
    got, want = _weights(a, 8), _weights(b, 8)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the momentum buffers travelled too (resuming from the weights alone would end elsewhere)
    payloads = [torch.load(f, weights_only=True) for f in sorted(merged.glob("stage-*.pt"))]
    momentum = {k: v for p in payloads for k, v in p["optimizer"]["state"].items()}
    assert set(momentum) == {n for n, _ in load_workload("mlp", ARGS).model.named_parameters()}
    assert all(state["momentum_buffer"].abs().sum() > 0 for state in momentum.values())


GPT = {"dim": "16", "heads": "2", "seq": "8", "vocab": "16", "samples": "64"}


def test_a_checkpoint_the_plans_model_does_not_fit_is_refused_in_one_line(tmp_path: Path) -> None:
    """A 2-block checkpoint resumed silently into a 1-block model (the second block dropped);
    one of another width failed with a line from every rank."""

    def plan(name: str, **args: str) -> Path:
        second = "h1" if args["layers"] == "2" else "norm"  # the first layer of stage 1
        stages = [["embed", "h0"], [second, "head"]]
        data = straight_plan("gpt", stages, microbatch_size=4, workload_args={**GPT, **args})
        return write_plan(data, tmp_path / f"{name}.yaml")

    written = tmp_path / "two"
    trained = run_plan(
        plan("two", layers="2"), "--steps", "2", "--run-dir", str(written), "--no-progress"
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    checkpoint = written / "checkpoints" / "step-000002"
    # what every rank would say is said once per node (it was said by each)
    done = run_plan(
        plan("two", layers="2"), "--steps", "2", "--resume", "auto", "--run-dir", str(written)
    )
    assert done.returncode == 0 and done.stderr.count("nothing to do") == 1, done.stderr
    for name, args, says in [
        (
            "smaller",
            {"layers": "1"},
            f"{checkpoint}: 12 of its tensors are not in the plan's model (h1.attn.proj.bias, "
            "h1.attn.proj.weight, h1.attn.qkv.bias, ...): it was written for gpt {",
        ),
        (
            "wider",
            {"layers": "2", "dim": "32"},
            f"rank 0: {checkpoint}: embed.tok.weight has shape (16, 16), the model has (16, 32); "
            "resume with the same workload arguments (rank 1 failed too, with other messages)",
        ),
    ]:
        resumed = run_plan(
            plan(name, **args), "--steps", "4", "--resume", str(checkpoint),
            "--run-dir", str(tmp_path / name), "--no-progress",
        )  # fmt: skip
        assert resumed.returncode == 2, resumed.stderr[-3000:]
        errors = [line for line in resumed.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and errors[0].startswith("pipedream train: error: "), errors
        assert says in errors[0]


def test_the_traces_of_a_checkpointed_and_a_resumed_run_follow_the_plans_tables(
    tmp_path: Path,
) -> None:
    """The reader rebuilds one table per stretch between checkpoints, from where the run
    began: a run with --checkpoint-every ("the traces do not follow the plan's action
    tables") and a resumed one ("lack the updates of minibatches [0, 1, 2, 3]") were refused.
    Stage 1 has 2 replicas, whose update rounds start anew at each stretch."""
    plan_path = write_plan(
        straight_plan("mlp", [["0", "1", "2"], ["3", "4", "5"]], replicas=[1, 2],
                      workload_args=ARGS),
        tmp_path / "plan.yaml",
    )  # fmt: skip
    plan = load_plan(plan_path)
    run_dir = tmp_path / "run"
    for steps, resume in (("8", ()), ("12", ("--resume", "auto"))):
        result = run_plan(
            plan_path, "--steps", steps, "--checkpoint-every", "4", "--trace",
            "--run-dir", str(run_dir), "--no-progress", *resume,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        traces = load_traces(run_dir)
        first = 8 if resume else 0
        assert traces[0].stretches == tuple((s, 4) for s in range(first, int(steps), 4))
        assert tables_of_run(traces, plan) is not None
        run = measure_run(traces, plan, skip=0)  # updates of 2 minibatches each
        assert (run.run_start, run.across_checkpoints) == (first // 2, 0 if resume else 1)
