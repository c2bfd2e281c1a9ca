"""``interleaved-1f1b``: 1F1B with several stages per rank (Narayanan et al., SC 2021).

The model is cut into ``S = v * P`` stages for ``P`` ranks; rank ``r`` runs the ``v`` stages
``r, r + P, ..., r + (v - 1) * P`` (its *chunks*), so a microbatch passes every rank ``v``
times. Each rank walks its ``m * v`` (chunk, microbatch) forwards in groups of ``P``
microbatches, chunk after chunk (forward ``i`` is chunk ``(i // P) mod v`` of microbatch
``(i // (P v)) P + i mod P``), and its backwards in the same order with the chunks reversed;
it runs ``(P - 1 - r) * 2 + (v - 1) * P`` forwards first, then alternates forward and backward,
then drains, and every stage updates once the minibatch's backwards are done: synchronous SGD,
``W^(k+1) = W^(k) - eta * mean_i grad f_i(W^(k))`` as ``1f1b``. With equal stage times the bubble
is ``(P - 1) / (v m)`` of the minibatch's compute, ``v`` times smaller than 1F1B's, for ``v``
times the messages::

    P = 2, v = 2 (stages 0 and 2 on rank 0, 1 and 3 on rank 1), m = 2:
    rank 0:  0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 U U
    rank 1:  1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 U U

``m`` must be a multiple of ``P`` (the groups), and ``v >= 2`` (``v = 1`` is ``1f1b``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedream.schedules.actions import Op
from pipedream.schedules.pipedream import latest_version
from pipedream.schedules.schedule import (
    RankEntry,
    Schedule,
    every_minibatch,
    stage_order_of_rank_order,
)
from pipedream.schedules.spec import PipelineSpec

__all__ = ["INTERLEAVED_1F1B", "looped_placement"]


def looped_placement(num_stages: int, num_ranks: int) -> list[int]:
    """Stage ``s`` on rank ``s mod P``: each rank holds every ``P``-th stage."""
    return [s % num_ranks for s in range(num_stages)]


def _problem(spec: PipelineSpec) -> str:
    ranks, stages, m = spec.world_size, spec.num_stages, spec.microbatches
    if stages % ranks or stages // ranks < 2:
        return (
            f"schedule 'interleaved-1f1b' needs at least 2 stages per rank and the same number "
            f"on every rank; got {stages} stages on {ranks} ranks (use '1f1b' for one per rank)"
        )
    if m % ranks:
        return (
            f"schedule 'interleaved-1f1b' needs microbatches in groups of the {ranks} ranks; "
            f"got {m} (use a multiple of {ranks})"
        )
    return ""


def interleaved_rank_order(
    spec: PipelineSpec, rank: int, minibatches: Sequence[int]
) -> list[RankEntry]:
    ranks = spec.world_size
    chunks = spec.num_stages // ranks
    m = spec.microbatches
    total = m * chunks
    warmup = min(total, (ranks - 1 - rank) * 2 + (chunks - 1) * ranks)

    def microbatch(i: int) -> int:
        return (i // (ranks * chunks)) * ranks + i % ranks

    def forward(i: int) -> tuple[Op, int, int]:
        chunk = (i // ranks) % chunks
        return (Op.FORWARD, chunk * ranks + rank, microbatch(i))

    def backward(i: int) -> tuple[Op, int, int]:
        chunk = chunks - 1 - (i // ranks) % chunks
        return (Op.BACKWARD, chunk * ranks + rank, microbatch(i))

    one = [forward(i) for i in range(warmup)]
    for i in range(total - warmup):
        one += [forward(warmup + i), backward(i)]
    one += [backward(i) for i in range(total - warmup, total)]
    return every_minibatch(one, minibatches, m)


INTERLEAVED_1F1B = Schedule(
    name="interleaved-1f1b",
    summary="1F1B over v stages per rank (Megatron); bubble (P-1)/(v m); synchronous SGD",
    asynchronous=False,
    order=stage_order_of_rank_order(interleaved_rank_order),
    version=latest_version,
    in_flight=lambda m, stages_from, depth: min(stages_from, m),
    memory_key=lambda after, mult, m: min(after, m),
    versions_kept=1,
    auto_rank=5,
    placement=looped_placement,
    rank_order=interleaved_rank_order,
    spec_problem=_problem,
)
