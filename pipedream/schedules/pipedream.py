"""``pipedream``: PipeDream's asynchronous 1F1B with weight stashing (SOSP'19).

Stage ``s`` runs ``w_s = S - 1 - s`` warm-up forwards (PipeDream's rule with replicated
stages: ``(world_size - 1 - replicas of earlier stages) // r_s``), then alternates the forward of
minibatch ``t`` and the backward of ``t - w_s``; the update from ``t`` follows its backward. The
forward *and* the backward of ``t`` use the version the stage had when the forward ran,
``W_s^(max(0, t - w_s))``, stashed until the backward. One microbatch per minibatch::

    stage 0:  F0 F1 F2 B0 U F3 B1 U F4 B2 U ...      warm-up w_0 = 2
    stage 1:     F0 F1 B0 U F2 B1 U F3 B2 U ...      warm-up w_1 = 1
    stage 2:        F0 B0 U F1 B1 U F2 B2 U ...      warm-up w_2 = 0
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from pipedream.schedules.schedule import OrderEntry, Schedule, flushed_one_f_one_b, interleaved
from pipedream.schedules.spec import PipelineSpec, warmup_depth

__all__ = ["PIPEDREAM", "asynchronous_order"]


def asynchronous_order(
    spec: PipelineSpec, stage: int, minibatches: Sequence[int]
) -> list[OrderEntry]:
    """1F1B across minibatches with PipeDream's warm-up (``S - 1 - s`` forwards when a
    minibatch has several microbatches).

    With several microbatches per minibatch and a replicated stage anywhere, every stage
    finishes each minibatch before it starts the next (1F1B within the minibatch): a warm-up
    carried over a minibatch boundary waits for forwards of a minibatch that a replica starts
    only after its allreduce, which waits in turn for backwards behind that warm-up (across
    every layout of up to 8 ranks, some 40% of such tables deadlocked). The update rule is
    unchanged; only the overlap of consecutive minibatches is lost."""
    m = spec.microbatches
    if m > 1 and any(len(ranks) > 1 for ranks in spec.stage_ranks):
        return flushed_one_f_one_b(spec, stage, minibatches)
    warmup = warmup_depth(spec, stage) if m == 1 else spec.num_stages - 1 - stage
    return interleaved(spec, minibatches, warmup)


def latest_version(spec: PipelineSpec, stage: int, microbatch: int, updates_done: int) -> int:
    """The weights as they are when the forward runs."""
    return updates_done


PIPEDREAM = Schedule(
    name="pipedream",
    summary="async 1F1B; stage s uses weights S-1-s updates old, stashed for its backward",
    asynchronous=True,
    order=asynchronous_order,
    version=latest_version,
    in_flight=lambda m, stages_from, depth: depth,
    memory_key=lambda after, mult, m: Fraction(after, mult),
    versions_kept=None,
    one_microbatch=True,
    auto_rank=3,
)
