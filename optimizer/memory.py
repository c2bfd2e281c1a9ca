"""Per-worker memory estimate of a stage, by schedule (what ``--memory`` is checked against).

A worker running stage ``s`` (layers ``first..last``, ``r`` replicas) holds::

    weights      versions x params        (versions counts the live copy)
    gradients    1 x params
    optimizer    optimizer_state_bytes    (0 when the profile does not record it)
    activations  in_flight x activations  (saved_bytes, else output_bytes, per microbatch)

``in_flight`` is the number of microbatches whose activations the worker keeps at once. For
PipeDream's 1F1B-RR schedule it is the warm-up depth + 1 of DESIGN.md section 7,
``ceil(workers_from_stage / r)`` where ``workers_from_stage`` counts the workers of this stage
and all later ones (``S - s`` for a straight pipeline); weight stashing keeps one weight version
per in-flight minibatch. The original optimizer's check is the same idea with the workers
*after* the stage, ``ceil((M - used) / r) * (activations + params)``; counting the stage itself
makes the last stage hold one minibatch instead of none.

=============  ==========================  ========
schedule       in_flight                   versions
=============  ==========================  ========
pipedream(-vs) ceil(W_from / r)            in_flight
2bw            ceil(W_from / r)            2
1f1b           min(ceil(W_from / r), m)    1
gpipe          m                           1
=============  ==========================  ========

This is an estimate for planning (no framework overhead, workspace or fragmentation); the
runtime reports what it really holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedream.formats.plan import SCHEDULES
from pipedream.optimizer.cost_model import LayerCosts

__all__ = ["MemoryModel"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class MemoryModel:
    """Memory per worker of a stage for one schedule, cluster size and minibatch shape."""

    schedule: str
    """One of :data:`pipedream.formats.plan.SCHEDULES`."""
    num_workers: int
    """Workers in the whole pipeline (all stages, all replicas)."""
    microbatches: int = 1
    """Microbatches per minibatch."""

    def __post_init__(self) -> None:
        assert self.schedule in SCHEDULES, self.schedule
        assert self.num_workers >= 1 and self.microbatches >= 1

    def in_flight(self, *, workers_before: int, replicas: int) -> int:
        """Microbatches whose activations one replica of the stage holds at once."""
        workers_from_stage = self.num_workers - workers_before
        assert workers_from_stage >= replicas >= 1
        depth = _ceil_div(workers_from_stage, replicas)
        if self.schedule == "gpipe":
            return self.microbatches
        if self.schedule == "1f1b":
            return min(depth, self.microbatches)
        return depth

    def weight_versions(self, *, workers_before: int, replicas: int) -> int:
        """Copies of the stage's weights one replica keeps (live copy included)."""
        if self.schedule in ("pipedream", "pipedream-vs"):
            return self.in_flight(workers_before=workers_before, replicas=replicas)
        return 2 if self.schedule == "2bw" else 1

    def factors(self, *, workers_before: int, replicas: int) -> tuple[int, int]:
        """``(parameter factor, activation factor)``: memory = pf x params + opt + af x acts.

        The partitioner applies these to whole matrices of layer ranges at once.
        """
        versions = self.weight_versions(workers_before=workers_before, replicas=replicas)
        return versions + 1, self.in_flight(workers_before=workers_before, replicas=replicas)

    def stage_bytes(
        self, costs: LayerCosts, *, first: int, last: int, workers_before: int, replicas: int
    ) -> float:
        """Estimated bytes per worker of layers ``first..last`` (inclusive)."""
        param_factor, activation_factor = self.factors(
            workers_before=workers_before, replicas=replicas
        )
        span = slice(first, last + 1)
        return (
            param_factor * sum(costs.parameter_bytes[span])
            + sum(costs.optimizer_state_bytes[span])
            + activation_factor * sum(costs.activation_bytes[span])
        )
