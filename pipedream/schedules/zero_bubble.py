"""``zb-h1`` and ``zbv``: zero-bubble schedules (Qi et al., ICLR 2024) with split backwards.

Both split every backward into ``I`` (input gradients, sent on at once) and ``W`` (weight
gradients, which only the update needs) and fill 1F1B's bubbles with the ``W`` s; both flush
after every minibatch, so the rule is ``1f1b``'s: ``W^(k+1) = W^(k) - eta * mean_i grad
f_i(W^(k))``, exact synchronous SGD. Their orders come from one unit-time run of a minibatch
(:mod:`pipedream.schedules.list_schedule`), the same for every minibatch.

- ``zb-h1``: one stage per rank, and no rank holds more microbatches' activations than 1F1B's
  first stage does (``S``). With ``F = I = W`` the bubble is about ``(S - 1) / (3 m)`` of the
  compute, a third of 1F1B's ``(S - 1) / m``::

      S = 3, m = 6:  rank 0:  F0 F1 F2 I0 W0 I1 F3 I2 W1 F4 W2 I3 F5 W3 I4 W4 I5 W5
                     rank 2:  F0 I0 F1 I1 F2 I2 W0 W1 F3 I3 W2 W3 F4 I4 F5 I5 W4 W5

- ``zbv``: ``2 P`` stages on ``P`` ranks in a V, rank ``r`` running stages ``r`` and
  ``2 P - 1 - r`` (so the last stage is on rank 0, with the first), each rank holding at most
  ``2 P`` stage-microbatches' activations, 1F1B's peak in activations of half the layers. With
  equal stage times the bubble is about ``(P - 1) / (6 m)`` of the compute.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedream.errors import ScheduleError
from pipedream.schedules.list_schedule import unit_time_orders
from pipedream.schedules.pipedream import latest_version
from pipedream.schedules.schedule import (
    CLOSE,
    RankEntry,
    Schedule,
    stage_order_of_rank_order,
)
from pipedream.schedules.spec import PipelineSpec

__all__ = ["ZB_H1", "ZBV", "v_placement"]


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


def _zb_h1_order(spec: PipelineSpec, rank: int, minibatches: Sequence[int]) -> list[RankEntry]:
    placement = list(range(spec.num_stages))
    return _rank_order(placement, spec.num_stages, spec, rank, minibatches)


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
    bubble_slots=lambda stages: (stages - 1) / 3,  # the paper's (S - 1)(F + I - W), F = I = W
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
