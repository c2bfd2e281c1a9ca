"""``gpipe``: GPipe's fill and drain: all forwards of a minibatch, then all its backwards, then
the update. Synchronous SGD like ``1f1b``, with all ``m`` microbatches' activations alive at
the turn::

    S = 2, m = 3:   stage 0:  F0 F1 F2 .  .  B0 B1 B2 U
                    stage 1:     F0 F1 F2 B0 B1 B2 U
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedream.schedules.actions import Op
from pipedream.schedules.pipedream import latest_version
from pipedream.schedules.schedule import CLOSE, OrderEntry, Schedule
from pipedream.schedules.spec import PipelineSpec

__all__ = ["GPIPE"]


def fill_drain(spec: PipelineSpec, stage: int, minibatches: Sequence[int]) -> list[OrderEntry]:
    m = spec.microbatches
    order: list[OrderEntry] = []
    for k in minibatches:
        micro = [k * m + j for j in range(m)]
        order.extend((Op.FORWARD, mb) for mb in micro)
        order.extend((Op.BACKWARD, mb) for mb in micro)
        order.append((CLOSE, k))
    return order


GPIPE = Schedule(
    name="gpipe",
    summary="fill-drain: all forwards, all backwards, a flush after every minibatch",
    asynchronous=False,
    order=fill_drain,
    version=latest_version,
    in_flight=lambda m, stages_from, depth: m,
    memory_key=lambda after, mult, m: None,
    versions_kept=1,
    auto_rank=1,
)
