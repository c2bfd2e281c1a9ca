"""PipeDream's cost model (SOSP'19 section 3.1) for one level of a cluster.

The model predicts the steady-state time per minibatch of a pipeline in which stage ``s`` runs
a contiguous range of layers on ``r_s`` data-parallel replicas (1F1B-RR: minibatch ``t`` goes to
replica ``t mod r_s``). Every term is an *average time per minibatch leaving the pipeline*, so
the pipeline's time is the largest term, as in the original optimizer
(``optimizer_graph_hierarchical.py``, "time per stage in pipeline"):

* compute of a stage on ``r`` replicas::

      (sum of forward + backward ms  +  allreduce(params, r) / microbatches) / r
      allreduce(P, r) = 4 * (r - 1) * P / (bandwidth * r)            # ring allreduce, fwd+bwd

  Replicas synchronise once per minibatch, so with ``microbatches`` microbatches per minibatch
  (2bw, 1f1b, gpipe) the allreduce is shared by that many microbatches; PipeDream's own schedule
  has one microbatch per minibatch, which is exactly the original formula.
* communication across a boundary carrying ``a`` bytes, for the stage on each side::

      2 * a / (bandwidth * r)          # activations forward, gradients backward

  It overlaps with compute, so it counts as its own term (``max``, not a sum). The original
  applies this with ``activation_compression_ratio=1``; with ``None`` it drops it.

The original charges the receiving stage's replication for every boundary but the sending
stage's only when the sender is not the first stage; here both sides are always charged (the
first stage sends too). The two agree whenever the first stage has at least as many replicas as
the second, which covers every plan the original picks on its sample profiles.

Times are in milliseconds, sizes in bytes, bandwidth in bytes/second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from pipedream.formats.profile import Profile

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["COST_MODELS", "Amount", "CostModel", "LayerCosts", "StageCost", "minibatch_ms"]

COST_MODELS = ("pipedream",)
"""Names accepted by ``pipedream plan --cost-model``."""

Amount = TypeVar("Amount", float, "NDArray[np.float64]")
"""A float, or a numpy array of them: the formulas are plain arithmetic, and the partitioner
evaluates them on whole matrices of layer ranges at once."""


@dataclass(frozen=True)
class LayerCosts:
    """The per-layer numbers the cost model reads, taken from a :class:`Profile`."""

    compute_ms: tuple[float, ...]
    """Forward + backward time of each layer, one microbatch."""
    parameter_bytes: tuple[float, ...]
    """Parameter bytes of each layer."""
    activation_bytes: tuple[float, ...]
    """Bytes each layer keeps for its backward (``saved_bytes``, else ``output_bytes``)."""
    optimizer_state_bytes: tuple[float, ...]
    """Optimizer-state bytes of each layer (0 where the profile does not say)."""
    boundary_bytes: tuple[float, ...]
    """Bytes crossing the cut after each layer but the last (``len - 1`` entries)."""

    @property
    def num_layers(self) -> int:
        return len(self.compute_ms)

    @classmethod
    def from_profile(cls, profile: Profile) -> LayerCosts:
        layers = profile.layers
        return cls(
            compute_ms=tuple(layer.compute_ms for layer in layers),
            parameter_bytes=tuple(float(layer.parameter_bytes) for layer in layers),
            activation_bytes=tuple(
                float(layer.output_bytes if layer.saved_bytes is None else layer.saved_bytes)
                for layer in layers
            ),
            optimizer_state_bytes=tuple(
                float(layer.optimizer_state_bytes or 0) for layer in layers
            ),
            boundary_bytes=tuple(float(profile.boundary_bytes(i)) for i in range(len(layers) - 1)),
        )


@dataclass(frozen=True)
class StageCost:
    """The predicted time of one stage, split into its parts (all per minibatch, ms)."""

    compute_ms: float
    """(compute + allreduce / microbatches) / replicas."""
    allreduce_ms: float
    """The allreduce part of ``compute_ms`` (already divided as above)."""
    transfer_ms: float
    """Largest of the input and output transfer times / replicas (0 for a single stage)."""

    @property
    def total_ms(self) -> float:
        """The stage's time: compute and communication overlap, the slower one counts."""
        return max(self.compute_ms, self.transfer_ms)


@dataclass(frozen=True)
class CostModel:
    """PipeDream's cost model on one network level (see the module docstring)."""

    bandwidth: float
    """Bandwidth between workers, bytes per second."""
    microbatches: int = 1
    """Microbatches per minibatch; replicas allreduce once per minibatch."""
    workers_per_unit: int = 1
    """Workers inside one unit of this level; they split an allreduce between units (the
    original divides the inter-unit allreduce by this). 1 for a flat cluster."""
    name: str = "pipedream"
    """Name recorded in the plan's prediction."""

    def __post_init__(self) -> None:
        assert self.bandwidth > 0 and self.microbatches >= 1 and self.workers_per_unit >= 1

    def allreduce_ms(self, param_bytes: Amount, *, replicas: int) -> Amount:
        """Time of one ring allreduce of ``param_bytes`` over ``replicas`` workers."""
        return (
            4.0 * (replicas - 1) * param_bytes / (self.bandwidth * replicas) * 1e3
        ) / self.workers_per_unit

    def compute_ms(self, compute_ms: Amount, *, param_bytes: Amount, replicas: int) -> Amount:
        """Average time per minibatch of a stage's compute and allreduce on ``replicas``."""
        allreduce = self.allreduce_ms(param_bytes, replicas=replicas) / self.microbatches
        return (compute_ms + allreduce) / replicas

    def transfer_ms(self, boundary_bytes: Amount, *, replicas: int) -> Amount:
        """Average time per minibatch to move a boundary's activations and gradients."""
        return 2.0 * boundary_bytes / (self.bandwidth * replicas) * 1e3

    def stage_cost(self, costs: LayerCosts, *, first: int, last: int, replicas: int) -> StageCost:
        """The cost of layers ``first..last`` (inclusive) run by ``replicas`` workers."""
        assert 0 <= first <= last < costs.num_layers and replicas >= 1
        compute = sum(costs.compute_ms[first : last + 1])
        params = sum(costs.parameter_bytes[first : last + 1])
        transfer = 0.0
        if first > 0:
            transfer = self.transfer_ms(costs.boundary_bytes[first - 1], replicas=replicas)
        if last < costs.num_layers - 1:
            transfer = max(
                transfer, self.transfer_ms(costs.boundary_bytes[last], replicas=replicas)
            )
        return StageCost(
            compute_ms=self.compute_ms(compute, param_bytes=params, replicas=replicas),
            allreduce_ms=self.allreduce_ms(params, replicas=replicas)
            / self.microbatches
            / replicas,
            transfer_ms=transfer,
        )

    def pipeline_ms(self, costs: LayerCosts, *, stages: Sequence[tuple[int, int, int]]) -> float:
        """Time per microbatch of a pipeline given as ``(first, last, replicas)`` stages."""
        return max(
            self.stage_cost(costs, first=first, last=last, replicas=replicas).total_ms
            for first, last, replicas in stages
        )

    def data_parallel_ms(self, costs: LayerCosts, *, num_workers: int) -> float:
        """Time per microbatch of every worker replicating the whole model."""
        last = costs.num_layers - 1
        return self.stage_cost(costs, first=0, last=last, replicas=num_workers).total_ms


def minibatch_ms(
    schedule: str, microbatch_ms: float, *, microbatches: int, num_stages: int
) -> float:
    """Time per minibatch of ``microbatches`` microbatches when the slowest stage takes
    ``microbatch_ms`` per microbatch.

    ``pipedream``, ``pipedream-vs`` and ``2bw`` never drain the pipeline, so a minibatch costs
    ``microbatches`` steady-state slots (for PipeDream: exactly its "time per stage in
    pipeline"). ``1f1b`` and ``gpipe`` flush after every minibatch, which adds the fill and
    drain bubble of ``num_stages - 1`` slots (the GPipe estimate, exact for equal stages).
    """
    slots = microbatches
    if schedule in ("1f1b", "gpipe"):
        slots += num_stages - 1
    return slots * microbatch_ms
