"""Every schedule on gloo against its update rule (DESIGN.md section 7), computed independently
in one process with plain autograd (tests/support/oracles.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.runtime.buffers import MIN_POOLED_BYTES
from pipedream.workload import load_workload

from oracles import plain_training, stale_oracle
from runs import even_groups, max_rel_diff, train_and_load

ARGS = {"layers": "5", "width": "16", "lr": "0.2"}
B = 8  # microbatch size
SEED = 0  # the launcher's default --seed


def _names() -> list[str]:
    return [n for n, _ in load_workload("mlp", ARGS).model.named_children()]


def _data(microbatch_size: int = B) -> MicrobatchStream:
    return MicrobatchStream(load_workload("mlp", ARGS).dataset, microbatch_size, SEED)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2)


def _rule(schedule: str, num_stages: int):
    if schedule == "pipedream":
        return lambda t, s: max(0, t - (num_stages - 1 - s))
    if schedule == "pipedream-vs":
        return lambda t, s: max(0, t - (num_stages - 1))
    if schedule == "2bw":
        return lambda t, s: max(0, t - 1)
    return lambda t, s: t


def _rule_oracle(
    schedule: str, stages: list[list[str]], steps: int, m: int, microbatch_size: int = B
) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` minibatches of ``m`` microbatches under the schedule's rule."""
    data = _data(microbatch_size)
    workload = load_workload("mlp", ARGS)
    return stale_oracle(
        workload.model,
        stages,
        num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
        loss_fn=workload.loss_fn,
        staleness=_rule(schedule, len(stages)),
        optimizer=_sgd,
    )


# Three and four stages, fewer and more microbatches than stages. Two-stage runs of every
# schedule are checked against the same rules in test_variants.py (with stateful optimizers and
# recomputation), test_hybrid.py and test_resume.py; each launch costs seconds of process start.
@pytest.mark.parametrize(
    ("schedule", "num_stages", "m"),
    [
        ("pipedream-vs", 3, 1),
        ("pipedream-vs", 4, 1),
        ("2bw", 3, 4),
        ("2bw", 4, 5),
        ("1f1b", 3, 4),
        ("1f1b", 4, 3),
        ("gpipe", 3, 2),
        ("gpipe", 4, 5),
    ],
)
def test_schedule_equals_its_rule(tmp_path: Path, schedule: str, num_stages: int, m: int) -> None:
    steps = 2 * num_stages + 1
    stages = even_groups(_names(), num_stages)
    got = train_and_load(
        tmp_path, stages, steps=steps, schedule=schedule, microbatches=m, workload_args=ARGS
    )
    assert max_rel_diff(got, _rule_oracle(schedule, stages, steps, m)) < 1e-5
    data = _data()
    workload = load_workload("mlp", ARGS)
    if schedule in ("1f1b", "gpipe"):
        # synchronous: the same as ordinary training on the whole minibatch of m x B samples
        def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
            parts = [data.microbatch(k * m + j) for j in range(m)]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

        plain = plain_training(
            load_workload("mlp", ARGS).model,
            num_updates=steps,
            batch=batch,
            loss_fn=workload.loss_fn,
            optimizer=_sgd,
        )
        assert max_rel_diff(got, plain) < 1e-5
    else:
        sync = _rule_oracle("gpipe", stages, steps, m)  # the same updates without staleness
        assert max_rel_diff(got, sync) > 1e-4  # the staleness is real


@pytest.mark.parametrize("replicas", [2, 3])
def test_one_stage_replicated_is_data_parallel(tmp_path: Path, replicas: int) -> None:
    """r replicas of the whole model = single-process training on the combined batch."""
    steps = 2 * replicas
    got = train_and_load(tmp_path, [_names()], steps=steps, replicas=[replicas], workload_args=ARGS)
    data = _data()

    def combined(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [data.microbatch(k * replicas + j) for j in range(replicas)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    workload = load_workload("mlp", ARGS)
    want = plain_training(
        workload.model,
        num_updates=steps // replicas,
        batch=combined,
        loss_fn=workload.loss_fn,
        optimizer=_sgd,
    )
    assert max_rel_diff(got, want) < 1e-5


@pytest.mark.parametrize(("schedule", "m"), [("pipedream", 1), ("1f1b", 4)])
def test_large_messages_in_reused_buffers_follow_the_rule(
    tmp_path: Path, schedule: str, m: int
) -> None:
    """Microbatches of 2,048 samples: every activation and gradient is 128 KiB, so the
    receiving stages take their buffers from the pool of released storage
    (runtime/buffers.py), with several microbatches and weight versions in flight."""
    big = 2048
    assert big * int(ARGS["width"]) * 4 >= MIN_POOLED_BYTES
    num_stages, steps = 3, 5
    stages = even_groups(_names(), num_stages)
    got = train_and_load(
        tmp_path,
        stages,
        steps=steps,
        schedule=schedule,
        microbatch_size=big,
        microbatches=m,
        workload_args=ARGS,
    )
    assert max_rel_diff(got, _rule_oracle(schedule, stages, steps, m, big)) < 1e-5
