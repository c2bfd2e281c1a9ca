"""Hybrid pipeline + data parallel plans (1F1B-RR) against the single-process reference executor
running the same action tables; replicas of a stage stay identical. (Replicated flushing
schedules against their rule: tests/unit/test_schedule_rules.py, in one process.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipedream.data import MicrobatchStream
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.workload import load_workload

from launching import straight_plan, write_plan
from oracles import replicated_oracle
from reference_run import reference_layout_weights, reference_weights
from runs import max_rel_diff, train_and_load
from workers import run_plan

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

ARGS = {"layers": "3", "width": "16", "lr": "0.2", "optimizer": "sgd", "momentum": "0.5"}
TWO = [["0", "1"], ["2", "3"]]
THREE = [["0"], ["1"], ["2", "3"]]


@pytest.mark.parametrize(
    ("stages", "replicas", "schedule", "m"),
    [
        # replicated first stages under PipeDream's warm-up rule, a replicated last stage
        (THREE, [2, 1, 1], "pipedream", 1),
        (TWO, [2, 1], "pipedream-vs", 1),
        (THREE, [2, 1, 1], "2bw", 3),
        (TWO, [1, 2], "1f1b", 2),
        # a replicated middle stage drains each of its minibatches (its tables deadlocked)
        (THREE, [1, 2, 1], "2bw", 4),
        (TWO, [1, 2], "zb-h1", 2),  # split backwards on a replicated stage
    ],
    ids=["2-1-1", "2-1-vs", "2-1-1-2bw", "1-2-1f1b", "1-2-1-2bw", "1-2-zb-h1"],
)
def test_hybrid_equals_reference_executor(
    tmp_path: Path, stages: list[list[str]], replicas: list[int], schedule: str, m: int
) -> None:
    steps = 6
    got = train_and_load(
        tmp_path,
        stages,
        steps=steps,
        schedule=schedule,
        microbatches=m,
        replicas=replicas,
        workload_args=ARGS,
    )
    want, workers = reference_weights(
        stages, replicas, schedule=schedule, microbatches=m, steps=steps, workload_args=ARGS
    )
    assert max_rel_diff(got, want) < 1e-5
    # the reference's replicas of a stage hold identical weights after every allreduce
    first_rank = 0
    for count in replicas:
        ref = workers[first_rank].module.state_dict()
        for rank in range(first_rank + 1, first_rank + count):
            assert max_rel_diff(workers[rank].module.state_dict(), ref) == 0.0
        first_rank += count


ADAM = {"layers": "3", "width": "16", "lr": "0.01", "optimizer": "adam"}


def test_replicas_resume_bit_exact_with_their_bucketed_allreduce(tmp_path: Path) -> None:
    """Two replicas of the first stage (1f1b, Adam): checkpointed every 2 minibatches (the
    bucket buffers stay across segments), then stopped at 4 and resumed to 8, against one
    uninterrupted run, and both against the reference executor."""
    steps, common = 8, {"schedule": "1f1b", "microbatches": 2, "workload_args": ADAM}
    whole = train_and_load(
        tmp_path, TWO, steps=steps, replicas=[2, 1], extra=("--checkpoint-every", "2"), **common
    )
    train_and_load(tmp_path, TWO, steps=4, replicas=[2, 1], name="halves", **common)
    resumed = train_and_load(
        tmp_path, TWO, steps=steps, replicas=[2, 1], name="halves", extra=("--resume", "auto"),
        **common,
    )  # fmt: skip
    assert max_rel_diff(resumed, whole) == 0.0
    want, _ = reference_weights(
        TWO, [2, 1], schedule="1f1b", microbatches=2, steps=steps, workload_args=ADAM
    )
    assert max_rel_diff(whole, want) < 1e-5


DROPOUT_WORKLOAD = """
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipedream.workload import Workload


def make(microbatch_size: int = 4) -> Workload:
    torch.manual_seed(0)
    inputs = torch.randn(64, 6)
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 1))
    # every process's generator elsewhere, as in processes torchrun starts (these are forked
    # from one server, with its state) once a model was built under fork_rng (transformers')
    torch.manual_seed(os.getpid())
    return Workload(
        model=model,
        example_input=inputs[:microbatch_size],
        loss_fn=nn.functional.mse_loss,
        dataset=TensorDataset(inputs, inputs.sum(1, keepdim=True)),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
    )
"""


def test_replicas_with_dropout_resume_bit_exact(tmp_path: Path) -> None:
    """Both replicas of a stage with dropout: a run stopped at 2 and resumed to 4 equals one
    run to 4. A checkpoint used to carry replica 0's generator state, which every replica
    restored (and the ranks were never seeded, so no two runs drew the same masks)."""
    (tmp_path / "dropout_workload.py").write_text(DROPOUT_WORKLOAD)
    common = {
        "workload": "dropout_workload:make", "workload_args": {}, "schedule": "1f1b",
        "microbatch_size": 4, "microbatches": 2, "replicas": [2],
        "env": {"PYTHONPATH": str(tmp_path)},
    }  # fmt: skip
    stages = [["0", "2"]]
    whole = train_and_load(tmp_path, stages, steps=4, extra=("--checkpoint-every", "2"), **common)
    train_and_load(tmp_path, stages, steps=2, name="halves", **common)
    resumed = train_and_load(
        tmp_path, stages, steps=4, name="halves", extra=("--resume", "auto"), **common
    )
    assert max_rel_diff(resumed, whole) == 0.0


@pytest.mark.parametrize(("schedule", "placement"), [("interleaved-1f1b", [0, 1, 0, 1])])
def test_two_copies_of_a_pipeline_of_several_stages_per_rank(
    tmp_path: Path, schedule: str, placement: list[int]
) -> None:
    """4 processes: copy j of an interleaved pipeline on ranks 2j, 2j + 1, each stage's two
    replicas averaging their gradients (in buckets), against the reference executor."""
    stages = [["0"], ["1"], ["2"], ["3"]]
    plan = straight_plan(
        "mlp", stages, schedule=schedule, microbatch_size=8, microbatches=2, workload_args=ARGS
    )
    for stage, rank in zip(plan["stages"], placement):
        stage["ranks"], stage["replicas"] = [rank, rank + 2], 2
    plan["world_size"] = 4
    path = write_plan(plan, tmp_path / "plan.yaml")
    result = run_plan(
        path, "--steps", "4", "--run-dir", str(tmp_path / "run"), "--timeout", "60",
        "--no-progress",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    got = load_full_state_dict(tmp_path / "run" / "checkpoints" / "step-000004")
    want = reference_layout_weights(
        "mlp", ARGS, stages, schedule=schedule, microbatches=2, steps=4, microbatch_size=8,
        placement=placement, replicas=[2] * 4,
    )  # fmt: skip
    assert max_rel_diff(got, want) < 1e-5


def test_replicated_batch_norm_statistics_are_replica_0s(tmp_path: Path) -> None:
    """A ResNet (batch norm) whose first stage has 2 replicas: the checkpoint's running
    statistics of that stage are those of the minibatches replica 0 ran, the unreplicated
    stage's those of every minibatch (docs/schedules.md), with the parameters of the rule."""
    args = {"width": "4", "samples": "256", "lr": "0.05", "momentum": "0.5"}
    stages = [["stem.0", "layer1.1"], ["layer2.0", "fc"]]
    steps, m, size = 4, 2, 4
    got = train_and_load(
        tmp_path, stages, steps=steps, workload="resnet", workload_args=args,
        schedule="1f1b", microbatch_size=size, microbatches=m, replicas=[2, 1],
    )  # fmt: skip
    workload = load_workload("resnet", args, microbatch_size=size)
    data = MicrobatchStream(workload.dataset, size, 0)
    layers = [name for name, _ in workload.model.named_children()]  # stem, layer1, layer2, ...
    groups = [["stem", "layer1"], [x for x in layers if x not in ("stem", "layer1")]]
    want_params = replicated_oracle(
        workload.model, groups, [2, 1], num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
        loss_fn=workload.loss_fn, optimizer=workload.optimizer,
    )  # fmt: skip
    want = {**workload.model.state_dict(), **want_params}
    assert "stem.1.running_mean" in want and "layer2.0.bn1.running_var" in want
    assert max_rel_diff(got, want) < 1e-5
