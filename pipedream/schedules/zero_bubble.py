"""``zb-h1`` and ``zbv``: zero-bubble schedules (Qi et al., ICLR 2024) with split backwards.

Both split every backward into ``I`` (input gradients, sent on at once) and ``W`` (weight
gradients, which only the update needs) and fill 1F1B's bubbles with the ``W`` s; both flush
after every minibatch, so the rule is ``1f1b``'s: ``W^(k+1) = W^(k) - eta * mean_i grad
f_i(W^(k))``, exact synchronous SGD. Every minibatch has the same order.

- ``zb-h1``: one stage per rank (or its replicas, each running its minibatches one after the
  other, as ``1f1b``'s do). Stage ``s`` runs 1F1B's ``S - 1 - s`` warm-up forwards, then
  forwards and input gradients alternately, each ``W`` running ``s`` backwards after its ``I``
  (the last stage's ``W`` s come latest, where the earlier stages still wait for gradients),
  then the remaining ``I`` s and ``W`` s. Every stage holds at most ``S`` microbatches'
  activations, 1F1B's first stage's; with ``F = I = W`` a minibatch idles ``S - 1`` units, the
  paper's ``(S - 1)(F + I - W)``, a third of 1F1B's ``(S - 1) / m`` of the compute::

      S = 3, m = 4:  stage 0:  F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3
                     stage 1:  F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
                     stage 2:  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3

- ``zbv``: ``2 P`` stages on ``P`` ranks in a V, rank ``r`` running stages ``r`` (down) and
  ``2 P - 1 - r`` (up; so the last stage is on rank 0, with the first), the paper's handcrafted
  order: ``2 (P - r) - 1`` forwards down, then ``r`` pairs of forwards up and down, then
  ``P - r`` forwards up each followed by its ``I`` and ``W``; in the steady state a forward,
  ``I`` and ``W`` down, then the same up; in the cool-down ``r`` pairs of ``I`` down and up,
  ``P - r`` of ``I`` and ``W`` down, then the remaining ``W`` s. The order is laid out for at
  least ``2 P - 1`` microbatches and those beyond ``m`` are left out. Each rank holds at most
  ``2 P`` stage-microbatches' activations, 1F1B's peak in activations of half the layers; with
  equal stage times and ``m >= 2 P`` a minibatch idles ``P - 1`` units of one pass of a stage.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedream.errors import ScheduleError
from pipedream.schedules.actions import Op
from pipedream.schedules.pipedream import latest_version
from pipedream.schedules.schedule import (
    CLOSE,
    OrderEntry,
    RankEntry,
    Schedule,
    every_minibatch,
    stage_order_of_rank_order,
)
from pipedream.schedules.spec import PipelineSpec

__all__ = ["ZB_H1", "ZBV", "v_placement", "zb_h1_stage_order", "zbv_rank_order"]


def v_placement(num_stages: int, num_ranks: int) -> list[int]:
    """Stage ``s`` on rank ``s`` going down and on rank ``2 P - 1 - s`` coming back."""
    if num_stages != 2 * num_ranks:
        raise ScheduleError(
            f"schedule 'zbv' places 2 stages on each rank; got {num_stages} stages for "
            f"{num_ranks} ranks"
        )
    return [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(num_stages)]


def zb_h1_stage_order(num_stages: int, stage: int, microbatches: int) -> list[tuple[Op, int]]:
    """One minibatch of ``zb-h1`` at ``stage``: ``(op, microbatch)`` in execution order."""
    m = microbatches
    warmup = min(num_stages - 1 - stage, m)
    order = [(Op.FORWARD, j) for j in range(warmup)]
    weights = 0
    for k in range(warmup, m + warmup):
        if k < m:
            order.append((Op.FORWARD, k))
        order.append((Op.BACKWARD_INPUT, k - warmup))
        if k - warmup >= stage:  # W lags its I by `stage` backwards
            order.append((Op.BACKWARD_WEIGHT, weights))
            weights += 1
    order += [(Op.BACKWARD_WEIGHT, j) for j in range(weights, m)]
    return order


def _zb_h1_order(spec: PipelineSpec, stage: int, minibatches: Sequence[int]) -> list[OrderEntry]:
    """A stage replica's minibatches one after the other, each closing at its end (each
    flushes, so a replica's order does not depend on the other replicas')."""
    m = spec.microbatches
    one = zb_h1_stage_order(spec.num_stages, stage, m)
    order: list[OrderEntry] = []
    for k in minibatches:
        order += [(op, k * m + j) for op, j in one]
        order.append((CLOSE, k))
    return order


def zbv_rank_order(ranks: int, rank: int, microbatches: int) -> list[tuple[Op, int, int]]:
    """One minibatch of ``zbv`` at ``rank``: ``(op, stage, microbatch)`` in execution order."""
    laid_out = max(2 * ranks - 1, microbatches)
    down, up = rank, 2 * ranks - 1 - rank
    order: list[tuple[Op, int, int]] = []
    done = {Op.FORWARD: {down: 0, up: 0}, Op.BACKWARD_INPUT: {down: 0, up: 0}}

    def run(op: Op, stage: int) -> None:
        order.append((op, stage, done[op][stage]))
        done[op][stage] += 1

    def whole_backward(stage: int) -> None:  # I and W of the same microbatch, back to back
        j = done[Op.BACKWARD_INPUT][stage]
        order.extend([(Op.BACKWARD_INPUT, stage, j), (Op.BACKWARD_WEIGHT, stage, j)])
        done[Op.BACKWARD_INPUT][stage] += 1

    forwards = done[Op.FORWARD]
    for _ in range(2 * (ranks - rank) - 1):
        run(Op.FORWARD, down)
    for _ in range(rank):
        run(Op.FORWARD, up)
        run(Op.FORWARD, down)
    for _ in range(ranks - rank):
        run(Op.FORWARD, up)
        whole_backward(up)
    while forwards[up] < forwards[down] or forwards[down] < laid_out:
        if forwards[down] < laid_out:
            run(Op.FORWARD, down)
        whole_backward(down)
        run(Op.FORWARD, up)
        whole_backward(up)
    weights = dict(done[Op.BACKWARD_INPUT])
    for _ in range(rank):
        run(Op.BACKWARD_INPUT, down)
        run(Op.BACKWARD_INPUT, up)
    for _ in range(ranks - rank):
        run(Op.BACKWARD_INPUT, down)
        order.append((Op.BACKWARD_WEIGHT, down, weights[down]))
        weights[down] += 1
    for stage in (up, down):
        order += [(Op.BACKWARD_WEIGHT, stage, j) for j in range(weights[stage], laid_out)]
    return [(op, stage, j) for op, stage, j in order if j < microbatches]


def _zbv_order(spec: PipelineSpec, rank: int, minibatches: Sequence[int]) -> list[RankEntry]:
    one = zbv_rank_order(spec.world_size, rank, spec.microbatches)
    return every_minibatch(one, minibatches, spec.microbatches)


def _zbv_problem(spec: PipelineSpec) -> str:
    if spec.num_stages != 2 * spec.world_size:
        return (
            f"schedule 'zbv' needs 2 stages per rank; got {spec.num_stages} stages on "
            f"{spec.world_size} ranks"
        )
    return ""


ZB_H1 = Schedule(
    name="zb-h1",
    summary="zero bubble H1: split backwards, W in 1F1B's bubbles, 1F1B's peak memory; sync SGD",
    asynchronous=False,
    order=_zb_h1_order,
    version=latest_version,
    # held from F to W: at most min(S, m), plus W's buffers for up to s < S of them (counted
    # as activations once more, optimizer/table_memory.py); without S, bounded through m
    in_flight=lambda m, stages_from, depth: 2 * m - 1,
    memory_key=lambda after, mult, m: m,
    versions_kept=1,
    auto_rank=6,
    splits_backward=True,
    bubble_slots=lambda stages: (stages - 1) / 3,  # (S - 1)(F + I - W) with F = I = W
)

ZBV = Schedule(
    name="zbv",
    summary="zero bubble V: 2 stages per rank in a V, split backwards; sync SGD",
    asynchronous=False,
    order=stage_order_of_rank_order(_zbv_order),
    version=latest_version,
    in_flight=lambda m, stages_from, depth: m,
    memory_key=lambda after, mult, m: m,
    versions_kept=1,
    auto_rank=7,
    placement=v_placement,
    rank_order=_zbv_order,
    splits_backward=True,
    spec_problem=_zbv_problem,
)
