"""Every schedule's tables, run by the reference executor with the runtime's own workers (one
process), against its update rule computed independently (tests/support/oracles.py), over many
shapes: stage counts, microbatches, optimizers with state, recomputation, replicated stages.
The distributed runtime is checked against the same rules in tests/distributed/
test_schedules.py, a launch per schedule."""

from __future__ import annotations

import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.workload import load_workload

from oracles import plain_training, replicated_oracle, stale_oracle
from reference_run import reference_layout_weights
from rules import rule
from runs import even_groups, max_rel_diff

B = 8
SGD = {"layers": "5", "width": "16", "lr": "0.2"}


def _names(args: dict[str, str]) -> list[str]:
    return [n for n, _ in load_workload("mlp", args).model.named_children()]


@pytest.mark.parametrize(
    ("schedule", "num_stages", "m", "args", "recompute"),
    [
        ("pipedream", 1, 1, SGD, False),
        ("pipedream", 2, 1, SGD, False),
        (
            "pipedream",
            3,
            1,
            {"layers": "4", "width": "16", "optimizer": "adam", "lr": "0.01"},
            True,
        ),
        (
            "pipedream",
            3,
            1,
            {"layers": "4", "width": "16", "optimizer": "sgd", "lr": "0.1", "momentum": "0.9"},
            False,
        ),
        (
            "pipedream-vs",
            2,
            1,
            {"layers": "4", "width": "16", "optimizer": "adamw", "lr": "0.01"},
            True,
        ),
        ("pipedream-vs", 4, 1, SGD, False),
        ("2bw", 2, 3, {"layers": "4", "width": "16", "optimizer": "adam", "lr": "0.01"}, True),
        ("2bw", 4, 5, SGD, False),
        ("1f1b", 3, 4, SGD, False),
        (
            "1f1b",
            3,
            2,
            {"layers": "4", "width": "16", "optimizer": "sgd", "lr": "0.1", "momentum": "0.9"},
            True,
        ),
        ("gpipe", 2, 2, {"layers": "4", "width": "16", "optimizer": "adamw", "lr": "0.01"}, False),
        ("gpipe", 4, 5, SGD, True),
        ("zb-h1", 3, 4, SGD, False),
        ("zb-h1", 2, 3, {"layers": "4", "width": "16", "optimizer": "adam", "lr": "0.01"}, True),
        ("zb-h1", 4, 6, {"layers": "4", "width": "16", "optimizer": "adamw", "lr": "0.01"}, False),
    ],
)
def test_schedule_equals_its_rule(
    schedule: str, num_stages: int, m: int, args: dict[str, str], recompute: bool
) -> None:
    steps = 2 * num_stages + 2
    stages = even_groups(_names(args), num_stages)
    got = reference_layout_weights(
        "mlp", args, stages, schedule=schedule, microbatches=m, steps=steps,
        microbatch_size=B, recompute=recompute,
    )  # fmt: skip
    workload = load_workload("mlp", args)
    data = MicrobatchStream(workload.dataset, B, 0)
    minibatch = lambda t: [data.microbatch(t * m + j) for j in range(m)]  # noqa: E731
    want = stale_oracle(
        workload.model, stages, num_minibatches=steps, minibatch=minibatch,
        loss_fn=workload.loss_fn, staleness=rule(schedule, num_stages),
        optimizer=workload.optimizer,
    )  # fmt: skip
    assert max_rel_diff(got, want) < 1e-5
    if schedule in ("1f1b", "gpipe", "zb-h1"):  # synchronous: ordinary training on m x B
        assert max_rel_diff(got, _plain(args, m, steps)) < 1e-5
    elif num_stages > 1:  # the staleness is real
        sync = stale_oracle(
            workload.model, stages, num_minibatches=steps, minibatch=minibatch,
            loss_fn=workload.loss_fn, staleness=lambda t, s: t, optimizer=workload.optimizer,
        )  # fmt: skip
        assert max_rel_diff(got, sync) > 1e-4


ADAM4 = {"layers": "4", "width": "16", "optimizer": "adam", "lr": "0.01"}


@pytest.mark.parametrize(
    ("replicas", "schedule", "m", "placement", "args"),
    [
        ([2], "pipedream", 1, None, SGD),
        ([3], "1f1b", 2, None, SGD),
        ([2, 1], "gpipe", 2, None, SGD),
        ([1, 2, 2], "1f1b", 2, None, SGD),
        ([1, 2], "zb-h1", 3, None, SGD),
        ([2, 1, 3], "zb-h1", 2, None, SGD),
        # two copies of an interleaved or V pipeline (4 ranks), copy j on minibatches j, j + 2..
        ([2] * 4, "interleaved-1f1b", 2, [0, 1, 0, 1], SGD),
        ([2] * 4, "zbv", 3, [0, 1, 1, 0], ADAM4),
    ],
)
def test_replicated_stages_equal_their_rule(
    replicas: list[int],
    schedule: str,
    m: int,
    placement: list[int] | None,
    args: dict[str, str],
) -> None:
    """One stage of r replicas is data parallelism on r x the minibatch; replicated stages of a
    synchronous schedule update once per r minibatches with the mean of their gradients."""
    stages = even_groups(_names(args), len(replicas))
    steps = 6
    got = reference_layout_weights(
        "mlp", args, stages, schedule=schedule, microbatches=m, steps=steps, microbatch_size=B,
        replicas=replicas, placement=placement,
    )  # fmt: skip
    workload = load_workload("mlp", args)
    data = MicrobatchStream(workload.dataset, B, 0)
    want = replicated_oracle(
        workload.model, stages, replicas, num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
        loss_fn=workload.loss_fn, optimizer=workload.optimizer,
    )  # fmt: skip
    assert max_rel_diff(got, want) < 1e-5


@pytest.mark.parametrize(
    ("schedule", "placement", "m", "args", "recompute"),
    [
        ("interleaved-1f1b", [0, 1, 0, 1], 2, SGD, False),
        (
            "interleaved-1f1b",
            [0, 1, 2, 0, 1, 2],
            3,
            {"layers": "5", "width": "16", "optimizer": "adam", "lr": "0.01"},
            True,
        ),
        ("zbv", [0, 1, 1, 0], 3, SGD, False),
        (
            "zbv",
            [0, 1, 2, 2, 1, 0],
            4,
            {"layers": "5", "width": "16", "optimizer": "adamw", "lr": "0.01"},
            True,
        ),
    ],
)
def test_several_stages_per_rank_equal_plain_training(
    schedule: str, placement: list[int], m: int, args: dict[str, str], recompute: bool
) -> None:
    """Interleaved and V placements: each rank runs several stages of one model (a process
    each), hands its own stages' messages over in memory, and the synchronous rule holds."""
    steps = 4
    stages = even_groups(_names(args), len(placement))
    got = reference_layout_weights(
        "mlp", args, stages, schedule=schedule, microbatches=m, steps=steps,
        microbatch_size=B, recompute=recompute, placement=placement,
    )  # fmt: skip
    assert max_rel_diff(got, _plain(args, m, steps)) < 1e-5


def _plain(args: dict[str, str], m: int, steps: int) -> dict[str, torch.Tensor]:
    """Ordinary training of the mlp on minibatches of m x B samples: the synchronous rule."""
    workload = load_workload("mlp", args)
    data = MicrobatchStream(workload.dataset, B, 0)

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [data.microbatch(k * m + j) for j in range(m)]
        return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])

    return plain_training(
        workload.model,
        num_updates=steps,
        batch=batch,
        loss_fn=workload.loss_fn,
        optimizer=workload.optimizer,
    )
