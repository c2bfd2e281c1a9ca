"""``zb-h1`` and ``zbv``: zero-bubble schedules (Qi et al., ICLR 2024) with split backwards.

Both split every backward into ``I`` (input gradients, sent on at once) and ``W`` (weight
gradients, which only the update needs) and fill 1F1B's bubbles with the ``W`` s; both flush
after every minibatch, so the rule is ``1f1b``'s: ``W^(k+1) = W^(k) - eta * mean_i grad
f_i(W^(k))``, exact synchronous SGD. Every minibatch has the same order.

- ``zb-h1``: one stage per rank. Stage ``s`` runs 1F1B's ``S - 1 - s`` warm-up forwards, then
  forwards and input gradients alternately, each ``W`` running ``s`` backwards after its ``I``
  (the last stage's ``W`` s come latest, where the earlier stages still wait for gradients),
  then the remaining ``I`` s and ``W`` s. Every stage holds at most ``S`` microbatches'
  activations, 1F1B's first stage's; with ``F = I = W`` a minibatch idles ``S - 1`` units, the
  paper's ``(S - 1)(F + I - W)``, a third of 1F1B's ``(S - 1) / m`` of the compute::

      S = 3, m = 4:  stage 0:  F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3
                     stage 1:  F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
                     stage 2:  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3

- ``zbv``: ``2 P`` stages on ``P`` ranks in a V, rank ``r`` running stages ``r`` and
  ``2 P - 1 - r`` (so the last stage is on rank 0, with the first), each rank holding at most
  ``2 P`` stage-microbatches' activations, 1F1B's peak in activations of half the layers. Its
  order comes from one unit-time run of a minibatch (:mod:`pipedream.schedules.list_schedule`).
  With equal stage times the bubble is about ``(P - 1) / (6 m)`` of the compute.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedream.errors import ScheduleError
from pipedream.schedules.actions import Op
from pipedream.schedules.list_schedule import unit_time_orders
from pipedream.schedules.pipedream import latest_version
from pipedream.schedules.schedule import (
    CLOSE,
    RankEntry,
    Schedule,
    stage_order_of_rank_order,
)
from pipedream.schedules.spec import PipelineSpec

__all__ = ["ZB_H1", "ZBV", "v_placement", "zb_h1_stage_order"]


def v_placement(num_stages: int, num_ranks: int) -> list[int]:
    """Stage ``s`` on rank ``s`` going down and on rank ``2 P - 1 - s`` coming back."""
    if num_stages != 2 * num_ranks:
        raise ScheduleError(
            f"schedule 'zbv' places 2 stages on each rank; got {num_stages} stages for "
            f"{num_ranks} ranks"
        )
    return [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(num_stages)]


def _rank_order(
    placement: Sequence[int], limit: int, spec: PipelineSpec, rank: int, minibatches: Sequence[int]
) -> list[RankEntry]:
    m = spec.microbatches
    one = unit_time_orders(placement, m, limit)[rank]
    stages = sorted({stage for _, stage, _ in one})
    order: list[RankEntry] = []
    for k in minibatches:
        order += [(op, stage, k * m + j) for op, stage, j in one]
        order += [(CLOSE, stage, k) for stage in stages]
    return order


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


def _zb_h1_order(spec: PipelineSpec, rank: int, minibatches: Sequence[int]) -> list[RankEntry]:
    (stage,) = spec.stages_of_rank(rank)
    m = spec.microbatches
    one = zb_h1_stage_order(spec.num_stages, stage, m)
    order: list[RankEntry] = []
    for k in minibatches:
        order += [(op, stage, k * m + j) for op, j in one]
        order.append((CLOSE, stage, k))
    return order


def _zbv_order(spec: PipelineSpec, rank: int, minibatches: Sequence[int]) -> list[RankEntry]:
    ranks = spec.world_size
    return _rank_order(v_placement(spec.num_stages, ranks), 2 * ranks, spec, rank, minibatches)


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
    order=stage_order_of_rank_order(_zb_h1_order),
    version=latest_version,
    in_flight=lambda m, stages_from, depth: m,  # at most S; an upper bound without S
    memory_key=lambda after, mult, m: m,
    versions_kept=1,
    auto_rank=6,
    rank_order=_zb_h1_order,
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
