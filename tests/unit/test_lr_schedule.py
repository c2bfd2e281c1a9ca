"""A workload's learning-rate schedule (``Workload.lr_schedule``): the update that applies
minibatch ``t`` uses ``lr x schedule(t)`` under every schedule, as a plain loop's
``LambdaLR`` stepped once per minibatch; a stage of ``r`` replicas applies minibatches ``t ..
t + r - 1`` in one update, at ``schedule(t)``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pipedream.data import MicrobatchStream
from pipedream.errors import WorkloadError
from pipedream.formats.plan import Plan, StagePlan, save_plan
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.runtime.lr_schedule import scheduled_lr
from pipedream.runtime.stage_layout import build_stage_module
from pipedream.runtime.stage_worker import StageWorker, WorkerConfig
from pipedream.schedules import Op, PipelineSpec, build_tables
from pipedream.workload import load_workload
from pipedream.workloads.common import warmup_decay

from launching import run_main
from oracles import replicated_oracle, stale_oracle
from plain_loop import plain_loop
from reference_run import reference_layout_weights
from rules import rule
from runs import even_groups, max_rel_diff

B = 8
ARGS = {"layers": "4", "width": "16", "optimizer": "adam", "lr": "0.01", "warmup": "3",
        "decay": "4"}  # fmt: skip
NAMES = ["0", "1", "2", "3", "4"]

Factory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def test_warmup_then_cosine_decay_to_a_tenth() -> None:
    factor = warmup_decay("mlp", warmup=4, decay=10)
    assert factor is not None
    assert [factor(t) for t in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert factor(9) == pytest.approx(0.55) and factor(14) == pytest.approx(0.1)
    assert factor(1000) == pytest.approx(0.1)
    warm = warmup_decay("mlp", warmup=2)
    assert warm is not None and [warm(t) for t in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert warmup_decay("mlp") is None
    with pytest.raises(WorkloadError, match="mlp: decay must be >= 0 minibatches, got -1"):
        warmup_decay("mlp", decay=-1)


def test_the_factor_holds_for_the_step_only_and_a_bad_one_is_refused() -> None:
    param = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.5)
    param.grad = torch.ones(1)
    with scheduled_lr(optimizer, lambda t: 0.1 * t, 3):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.15)
        optimizer.step()
    assert optimizer.param_groups[0]["lr"] == 0.5  # a checkpoint saves the workload's lr
    assert float(param.detach()) == pytest.approx(1 - 0.15)
    with scheduled_lr(optimizer, lambda t: np.float32(0.25), 0):  # as LambdaLR takes it
        assert optimizer.param_groups[0]["lr"] == 0.125
    for bad, said in (
        (float("nan"), "returned nan"),
        (-1.0, "returned -1.0"),
        ("x", "returned 'x'"),
    ):
        with pytest.raises(WorkloadError, match=f"lr_schedule\\(3\\) {said}"):
            with scheduled_lr(optimizer, lambda t, bad=bad: bad, 3):
                pass


def _scheduled(factory: Factory, schedule: Callable[[int], float], stride: int = 1) -> Factory:
    """``factory``'s optimizers with their ``k``-th step at ``lr x schedule(k x stride)`` (an
    update of ``stride`` replicas' minibatches)."""

    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = factory(params)
        base = [group["lr"] for group in optimizer.param_groups]
        steps = itertools.count()
        plain_step = optimizer.step

        def step(closure=None):  # type: ignore[no-untyped-def]
            factor = schedule(next(steps) * stride)
            for group, lr in zip(optimizer.param_groups, base):
                group["lr"] = lr * factor
            return plain_step(closure)

        optimizer.step = step  # type: ignore[method-assign]
        return optimizer

    return make


def test_one_stage_follows_a_plain_loops_lambdalr() -> None:
    got = reference_layout_weights(
        "mlp", ARGS, [NAMES], schedule="1f1b", microbatches=2, steps=8, microbatch_size=B
    )
    want, _ = plain_loop("mlp", ARGS, steps=8, microbatches=2, microbatch_size=B)
    unscheduled, _ = plain_loop(
        "mlp", {**ARGS, "warmup": "0", "decay": "0"}, steps=8, microbatches=2, microbatch_size=B
    )
    assert max_rel_diff(got, want) < 1e-6
    assert max_rel_diff(got, unscheduled) > 1e-2  # the schedule moved the weights


@pytest.mark.parametrize(("schedule", "stages", "m"), [("pipedream", 3, 1), ("2bw", 2, 2),
                                                       ("zb-h1", 2, 3)])  # fmt: skip
def test_pipelines_follow_their_rule_with_the_schedule(schedule: str, stages: int, m: int) -> None:
    """Weight stashing (pipedream), double buffering (2bw), split backwards (zb-h1): stage s's
    update k applies minibatch k at factor schedule(k), whatever weights it was computed on."""
    steps = 8
    groups = even_groups(NAMES, stages)
    got = reference_layout_weights(
        "mlp", ARGS, groups, schedule=schedule, microbatches=m, steps=steps, microbatch_size=B
    )
    workload = load_workload("mlp", ARGS)
    assert workload.lr_schedule is not None
    data = MicrobatchStream(workload.dataset, B, 0)
    want = stale_oracle(
        workload.model, groups, num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
        loss_fn=workload.loss_fn, staleness=rule(schedule, stages),
        optimizer=_scheduled(workload.optimizer, workload.lr_schedule),
    )  # fmt: skip
    assert max_rel_diff(got, want) < 1e-5


def test_replicas_update_at_the_factor_of_their_first_minibatch() -> None:
    """Two stages of 2 replicas each: update k applies minibatches 2k and 2k + 1 at
    schedule(2k)."""
    steps, m = 8, 2
    groups = even_groups(NAMES, 2)
    got = reference_layout_weights(
        "mlp", ARGS, groups, schedule="1f1b", microbatches=m, steps=steps, microbatch_size=B,
        replicas=[2, 2],
    )  # fmt: skip
    workload = load_workload("mlp", ARGS)
    assert workload.lr_schedule is not None
    data = MicrobatchStream(workload.dataset, B, 0)
    want = replicated_oracle(
        workload.model, groups, [2, 2], num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
        loss_fn=workload.loss_fn,
        optimizer=_scheduled(workload.optimizer, workload.lr_schedule, stride=2),
    )  # fmt: skip
    assert max_rel_diff(got, want) < 1e-5


def test_a_resumed_run_goes_on_with_the_schedule(tmp_path: Path) -> None:
    """Resumed at step 3, the run takes the schedule at minibatch 3 on and ends on the weights
    of an uninterrupted run; the checkpoint keeps the workload's lr (no "settings differ")."""
    plan = Plan("mlp", "1f1b", B, 2, 1, (StagePlan("0", "4", 1, (0,)),), workload_args=ARGS)
    save_plan(plan, tmp_path / "plan.yaml")

    def train(run: str, steps: int, *extra: str) -> str:
        result = run_main(
            "train", str(tmp_path / "plan.yaml"), "--steps", str(steps), "--no-progress",
            "--run-dir", str(tmp_path / run), *extra,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stderr

    train("whole", 6, "--checkpoint-every", "3")
    train("halves", 3)
    said = train("halves", 6, "--resume", "auto")
    assert "resum" in said and "settings differ" not in said
    final = Path("checkpoints") / "step-000006"
    want = load_full_state_dict(tmp_path / "whole" / final)
    got = load_full_state_dict(tmp_path / "halves" / final)
    assert all(torch.equal(want[name], got[name]) for name in want)


def test_a_resume_at_a_step_not_a_multiple_of_the_replicas_keeps_the_schedules_index() -> None:
    """A checkpoint of another plan at step 3, resumed with 2 replicas: the updates apply
    minibatches 3-4 and 5-6, at schedule(3) and schedule(5) (the index was 2 and 4: version x
    replicas, one behind)."""
    called: list[int] = []
    workload = load_workload("mlp", {"layers": "1", "width": "4"}, microbatch_size=B)
    table = build_tables(PipelineSpec("1f1b", ((0, 1),), 1, 4), only_ranks={0})[0]
    worker = StageWorker(
        WorkerConfig(0, 1, 1, replicas=2, replica_phase=3 % 2),
        build_stage_module(workload.model, ["0", "1"]),
        table,
        optimizer_factory=workload.optimizer,
        loss_fn=workload.loss_fn,
        data=MicrobatchStream(workload.dataset, B, 0),
        initial_version=3 // 2,
        lr_schedule=lambda t: called.append(t) or 1.0,
    )
    for position in (i for i, action in enumerate(table) if action.op is Op.UPDATE):
        worker.update(position)
    assert called == [3, 5]
