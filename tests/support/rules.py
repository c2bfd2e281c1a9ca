"""The schedules' update rules as staleness functions for the oracles (docs/schedules.md)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["rule"]


def rule(schedule: str, num_stages: int, *, segment: int = 0) -> Callable[[int, int], int]:
    """``staleness(t, s)``: the version stage ``s`` computes minibatch ``t`` on. With
    ``segment`` (``--checkpoint-every``), the pipeline drains at every multiple of it, so a
    segment's first minibatches use the version it started with."""

    def start(t: int) -> int:
        return segment * (t // segment) if segment else 0

    if schedule == "pipedream":
        return lambda t, s: max(start(t), t - (num_stages - 1 - s))
    if schedule == "pipedream-vs":
        return lambda t, s: max(start(t), t - (num_stages - 1))
    if schedule == "2bw":
        return lambda t, s: max(start(t), t - 1)
    return lambda t, s: t
