"""Tied weights across stages, in one process: the ``gpt`` model with its head reusing the token
embedding (``tie=true``), cut so that the embedding is on the first stage and the head on the
last, run by the reference executor on the runtime's own action tables, stage modules and
workers, against independent oracles (tests/support/oracles.py): plain single-process training
for the synchronous schedules, the documented rule for the asynchronous ones."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from pipedream.data import MicrobatchStream
from pipedream.runtime.stage_layout import build_stage_module
from pipedream.runtime.stage_worker import StageWorker, TiedLinks, WorkerConfig
from pipedream.workload import load_workload

from oracles import replicated_oracle, stale_oracle
from reference_run import reference_layout_weights
from tied_gpt import ARGS, LAYERS, MICROBATCH, plain_tied_training

B = MICROBATCH
CUTS = {  # the embedding on the first stage, the head on the last
    2: [LAYERS[:2], LAYERS[2:]],
    3: [LAYERS[:1], LAYERS[1:3], LAYERS[3:]],
    4: [LAYERS[:1], LAYERS[1:2], LAYERS[2:4], LAYERS[4:]],
}


def _canonical(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != "head.weight"}


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(_canonical(got)) == set(want), sorted(set(_canonical(got)) ^ set(want))
    return max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want
    )


def _run(stages: list[list[str]], schedule: str, m: int, steps: int, **kw) -> dict:
    got = reference_layout_weights(
        "gpt", ARGS, stages, schedule=schedule, microbatches=m, steps=steps, microbatch_size=B, **kw
    )
    assert got["head.weight"] is got["embed.tok.weight"]  # the state dict keeps the tie
    return got


def _data() -> MicrobatchStream:
    return MicrobatchStream(load_workload("gpt", ARGS).dataset, B, 0)


@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_flush_schedules_equal_tied_single_process_training(schedule: str, num_stages: int) -> None:
    m, steps = 3, 4
    got = _run(CUTS[num_stages], schedule, m, steps)
    assert _diff(got, plain_tied_training(steps=steps, microbatches=m)) < 1e-5


@pytest.mark.parametrize(
    ("schedule", "placement", "replicas"),
    [
        ("interleaved-1f1b", [0, 1, 0, 1], None),  # the copy on another rank
        ("zbv", [0, 1, 1, 0], None),  # the owner and the copy on rank 0
        ("zbv", [0, 1, 1, 0], [2, 2, 2, 2]),  # two copies of that pipeline
    ],
)
def test_several_stages_per_rank_equal_tied_single_process_training(
    schedule: str, placement: list[int], replicas: list[int] | None
) -> None:
    """The embedding on the first stage and the head on the last under the schedules that run
    several stages per rank (zbv's backwards split, the head's copy in the input half)."""
    m, steps = 2, 4
    got = _run(CUTS[4], schedule, m, steps, placement=placement, replicas=replicas)
    copies = replicas[0] if replicas else 1
    want = plain_tied_training(steps=steps, microbatches=m, copies=copies)
    assert _diff(got, want) < 1e-5


def test_a_copy_on_its_owners_rank_is_a_tensor_of_its_own() -> None:
    """One process builds both stages from one model, so the head's weight is the embedding's
    very parameter; the copy must not write into it (a new version replaces the copy's value)
    nor gather gradients in it."""
    workload = load_workload("gpt", ARGS)
    owner = build_stage_module(workload.model, LAYERS[:1])
    copy_stage = build_stage_module(workload.model, LAYERS[1:])
    assert copy_stage.head.weight is owner.embed.tok.weight
    before = owner.embed.tok.weight.detach().clone()
    worker = StageWorker(
        WorkerConfig(1, 2, 1),
        copy_stage,
        [],
        optimizer_factory=workload.optimizer,
        loss_fn=workload.loss_fn,
        data=None,
        tied=TiedLinks(copies={0: ("head.weight",)}),
    )
    assert worker.module.head.weight is not owner.embed.tok.weight
    assert torch.equal(worker.module.head.weight, before)  # the same value to start with
    worker.set_copies(0, [torch.zeros_like(before)])
    assert torch.equal(owner.embed.tok.weight, before)
    assert not worker.module.head.weight.any()


def _copy_worker(module: nn.Module, copies: tuple[str, ...]) -> StageWorker:
    workload = load_workload("gpt", ARGS)
    return StageWorker(
        WorkerConfig(1, 2, 1),
        module,
        [],
        optimizer_factory=workload.optimizer,
        loss_fn=workload.loss_fn,
        data=None,
        tied=TiedLinks(copies={0: copies}),
    )


def test_a_module_both_stages_call_keeps_the_owners_tensor() -> None:
    """A module the owner's stage and the copy's stage both call (on one rank, under
    interleaving or the V): the copy used to replace the tensor in that shared module, so the
    owner's forward ran on the copy while its optimizer updated the original."""
    shared = nn.Linear(3, 3)
    owner = nn.Sequential(OrderedDict(f=shared))
    copy_stage = nn.Sequential(OrderedDict(g=shared, out=nn.Linear(3, 1)))
    worker = _copy_worker(copy_stage, ("g.weight", "g.bias"))
    assert owner.f is shared and owner.f.weight is shared.weight  # the owner's stage untouched
    assert worker.module.g is not shared and worker.module.g.weight is not shared.weight
    assert worker.module.out is copy_stage.out  # what holds no copy stays shared
    assert torch.equal(worker.module.g.weight, shared.weight)


def test_every_name_of_a_copy_gets_the_copy() -> None:
    """A tensor registered twice in one module of the copy's stage kept the owner's tensor
    under its second name (never updated on the copy's rank)."""
    embed = nn.Embedding(5, 3)
    mix = nn.Module()
    mix.register_parameter("a", embed.weight)
    mix.register_parameter("a2", embed.weight)
    worker = _copy_worker(nn.Sequential(OrderedDict(mix=mix)), ("mix.a",))
    fresh = worker.module.mix
    assert fresh.a is fresh.a2 and fresh.a is not embed.weight
    assert mix.a is embed.weight and mix.a2 is embed.weight


def test_untied_training_is_measurably_different() -> None:
    """What the runtime did before ties were handled (each stage trained its own copy)."""
    m, steps = 3, 4
    got = _run(CUTS[3], "1f1b", m, steps)
    want = plain_tied_training(steps=steps, microbatches=m, untie=True)
    assert _diff(got, {k: v for k, v in want.items() if k != "head.weight"}) > 1e-3


def test_recomputation_and_replicas_equal_tied_training() -> None:
    """Both stages with 2 replicas: data parallelism over 2 minibatches per update."""
    m, steps = 2, 4
    got = _run(CUTS[2], "1f1b", m, steps, replicas=[2, 2], recompute=True)
    assert _diff(got, plain_tied_training(steps=steps, microbatches=m, copies=2)) < 1e-5


@pytest.mark.parametrize(
    ("replicas", "schedule"), [([2, 1, 1], "1f1b"), ([1, 1, 2], "gpipe"), ([1, 2, 2], "1f1b")]
)
def test_owner_and_copy_with_different_replica_counts(replicas: list[int], schedule: str) -> None:
    """The owner updates the tied tensor once per r_owner minibatches; the copies follow."""
    m, steps = 2, 4
    got = _run(CUTS[3], schedule, m, steps, replicas=replicas)
    data, workload = _data(), load_workload("gpt", ARGS)
    want = replicated_oracle(
        workload.model,
        CUTS[3],
        replicas,
        num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
        loss_fn=workload.loss_fn,
        optimizer=workload.optimizer,
    )
    assert _diff(got, want) < 1e-5


def _rule(schedule: str, num_stages: int):
    if schedule == "pipedream":
        return lambda t, s: max(0, t - (num_stages - 1 - s))
    if schedule == "pipedream-vs":
        return lambda t, s: max(0, t - (num_stages - 1))
    return lambda t, s: max(0, t - 1)  # 2bw


@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-vs", "2bw"])
def test_async_schedules_equal_the_tied_rule(schedule: str, num_stages: int) -> None:
    """Every use of the tied tensor in minibatch t takes the owner's version of t; the owner
    applies the sum of all uses' gradients of t."""
    m = num_stages if schedule == "2bw" else 1
    steps = 6
    got = _run(CUTS[num_stages], schedule, m, steps)
    data, workload = _data(), load_workload("gpt", ARGS)
    want = stale_oracle(
        workload.model,
        CUTS[num_stages],
        num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
        loss_fn=workload.loss_fn,
        staleness=_rule(schedule, num_stages),
        optimizer=workload.optimizer,
    )
    assert _diff(got, want) < 1e-5
    synchronous = stale_oracle(
        workload.model,
        CUTS[num_stages],
        num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
        loss_fn=workload.loss_fn,
        staleness=lambda t, s: t,
        optimizer=workload.optimizer,
    )
    assert _diff(got, synchronous) > 1e-4  # the staleness is real
