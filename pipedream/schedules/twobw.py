"""``2bw``: PipeDream-2BW (ICML'21), double-buffered weights.

Minibatches of ``m >= S`` microbatches flow through 1F1B without a flush; every microbatch of
minibatch ``k`` uses ``W^(max(0, k - 1))``, one update stale, so at most two versions are live,
and ``W^(k+1) = W^(k) - eta * mean grad over minibatch k at W^(k - 1)``.
"""

from __future__ import annotations

from pipedream.schedules.pipedream import asynchronous_order
from pipedream.schedules.schedule import Schedule
from pipedream.schedules.spec import PipelineSpec

__all__ = ["TWO_BW"]


def previous_minibatch_version(
    spec: PipelineSpec, stage: int, microbatch: int, updates_done: int
) -> int:
    """One update stale: the version before the update of the previous minibatch."""
    minibatch = microbatch // spec.microbatches
    base = spec.first_minibatch // spec.replicas(stage)
    local = (minibatch - spec.first_minibatch) // spec.replicas(stage)
    return base + max(0, local - 1)


TWO_BW = Schedule(
    name="2bw",
    summary="minibatches of m >= S microbatches, gradient at the previous minibatch's weights",
    asynchronous=True,
    order=asynchronous_order,
    version=previous_minibatch_version,
    in_flight=lambda m, stages_from, depth: stages_from,
    memory_key=lambda after, mult, m: after,
    versions_kept=2,
    microbatches_at_least_stages=True,
    auto_rank=2,
)
