"""``pipedream-vs``: PipeDream with vertical sync.

The order of :mod:`~pipedream.schedules.pipedream`, but every stage computes minibatch ``t`` on
the version stage 0 used for it, ``W_s^(max(0, t - (S - 1)))``: the version tag travels with
the activations and each stage checks it. Staleness is then the same across stages.
"""

from __future__ import annotations

from fractions import Fraction

from pipedream.schedules.pipedream import asynchronous_order
from pipedream.schedules.schedule import Schedule
from pipedream.schedules.spec import PipelineSpec, warmup_depth

__all__ = ["PIPEDREAM_VS"]


def stage_zero_version(spec: PipelineSpec, stage: int, microbatch: int, updates_done: int) -> int:
    """The version of this stage that covers the minibatches stage 0's version covered.

    Stage 0's replica ran ``max(0, i - w_0)`` updates before the forward of its ``i``-th
    minibatch, each covering ``r_0`` minibatches; this stage's version covering the same
    minibatches is its version at the stretch's start plus the rounds of its ``r_s`` replicas
    they fill, counted from the start as its updates are (where a resumed run starts at a step
    that is not a multiple of ``r_s``, ``(first + covered) // r_s`` named a round not done).
    """
    minibatch = microbatch // spec.microbatches
    r0 = spec.replicas(0)
    local0 = (minibatch - spec.first_minibatch) // r0
    covered = max(0, local0 - warmup_depth(spec, 0)) * r0
    r_s = spec.replicas(stage)
    return spec.first_minibatch // r_s + covered // r_s


PIPEDREAM_VS = Schedule(
    name="pipedream-vs",
    summary="as pipedream, but every stage uses the version stage 0 used (vertical sync)",
    asynchronous=True,
    order=asynchronous_order,
    version=stage_zero_version,
    in_flight=lambda m, stages_from, depth: depth,
    memory_key=lambda after, mult, m: Fraction(after, mult),
    versions_kept=None,
    one_microbatch=True,
    vertical_sync=True,
    auto_rank=4,
)
