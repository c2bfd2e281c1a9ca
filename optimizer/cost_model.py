"""PipeDream's cost model (SOSP'19 section 3.1), per network level, in two variants.

A stage runs a contiguous range of layers on ``r`` replicas (1F1B-RR: minibatch ``t`` goes to
replica ``t mod r``). Every term is an *average time per microbatch leaving the pipeline*, so a
pipeline's time is its largest term (the original's "time per stage in pipeline"):

* compute of a stage on ``r`` units (workers, or servers each running an inner pipeline)::

      (T + allreduce(P, r) / microbatches) / r
      allreduce(P, r) = 4 * (r - 1) * P / (bandwidth * r) / w        # ring allreduce, fwd+bwd

  ``T`` is the layers' forward + backward time (innermost level) or the best pipeline time of
  the range on one unit (outer levels); ``w`` shares a cross-unit allreduce among the workers
  of a unit. Replicas synchronise once per minibatch, so it is shared by ``microbatches``.
* communication across a cut carrying ``a`` bytes, for a stage on ``r`` units::

      2 * a / (bandwidth * r)          # activations forward, gradients backward

  It overlaps with compute, so it counts as its own term (``max``, not a sum).
* tied parameters (:mod:`~pipedream.optimizer.tied_costs`): a stage that shares ``b`` bytes of
  them with other stages trades them once per minibatch (the copy's gradient to the owner, the
  new version back), another overlapped term::

      2 * b / (bandwidth * r) / microbatches

The two variants (``--cost-model``) differ only in which terms are charged:

``symmetric`` (default)
    every cut is charged to the stages on *both* sides (each with its own ``r``), at the
    bandwidth of the level where the cut happens (an inner pipeline never charges the ends of
    its own range: the enclosing level does, at its own bandwidth), and ``w`` is the number of
    workers in a unit of the level below, for every stage.
``pipedream``
    the original ``optimizer_graph_hierarchical.py`` exactly, with
    ``--activation_compression_ratio 1``: the first stage of every pipeline pays no transfer
    (its output is charged to the next stage only), a pipeline of an inner level charges its
    last stage's output at the *inner* bandwidth, and only a pipeline's first stage divides its
    allreduce by ``w`` (``w`` = units of the previous level).

Both give the same numbers on one level whenever the first stage has at least as many replicas
as the second. Times are in milliseconds, sizes in bytes, bandwidths in bytes/second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from pipedream.formats.profile import Profile
from pipedream.optimizer.tied_costs import TiedLayers
from pipedream.schedules import lookup

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = [
    "COST_MODELS",
    "DEFAULT_COST_MODEL",
    "Amount",
    "CostModel",
    "LayerCosts",
    "StageCost",
    "minibatch_ms",
]

COST_MODELS = ("symmetric", "pipedream")
"""Names accepted by ``pipedream plan --cost-model`` (see the module docstring)."""
DEFAULT_COST_MODEL = "symmetric"

Amount = TypeVar("Amount", float, "NDArray[np.float64]")
"""A float, or a numpy array of them: the formulas are plain arithmetic, and the partitioner
evaluates them on whole matrices of layer ranges at once."""


@dataclass(frozen=True)
class LayerCosts:
    """The per-layer numbers the cost and memory models read, taken from a :class:`Profile`."""

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
    tied: TiedLayers = field(default_factory=TiedLayers)
    """Parameters several layers use (counted in ``parameter_bytes`` of the first)."""
    recompute: bool = False
    """Activations are recomputed in backward (``--recompute``): ``compute_ms`` holds each
    layer's forward twice, and a stage keeps only its inputs per microbatch in flight, the
    activations of one microbatch at a time (:mod:`~pipedream.optimizer.memory`)."""
    data_bytes: float = 0.0
    """Bytes of one microbatch's model input, which the first stage reads from the data
    (0 where the profile does not say)."""

    @property
    def num_layers(self) -> int:
        return len(self.compute_ms)

    def cut_bytes(self, index: int) -> float:
        """Bytes crossing the cut after layer ``index`` (0 after the last layer)."""
        return self.boundary_bytes[index] if index < len(self.boundary_bytes) else 0.0

    def input_bytes(self, first: int) -> float:
        """Bytes a stage starting at layer ``first`` receives per microbatch (0 for the first
        stage, whose input the data loader gives)."""
        return self.boundary_bytes[first - 1] if first > 0 else 0.0

    def kept_input_bytes(self, first: int) -> float:
        """Bytes of input a stage starting at layer ``first`` keeps per microbatch in flight
        when it recomputes its activations: what it receives, or the first stage's data."""
        return self.input_bytes(first) if first > 0 else self.data_bytes

    @classmethod
    def from_profile(cls, profile: Profile, *, recompute: bool = False) -> LayerCosts:
        """The profile's costs; ``recompute``: of a run that recomputes activations in
        backward (each backward runs its layers' forward again first)."""
        layers = profile.layers
        return cls(
            recompute=recompute,
            data_bytes=float(profile.input_bytes or 0),
            compute_ms=tuple(
                layer.compute_ms + (layer.forward_ms if recompute else 0.0) for layer in layers
            ),
            parameter_bytes=tuple(float(layer.parameter_bytes) for layer in layers),
            activation_bytes=tuple(
                float(layer.output_bytes if layer.saved_bytes is None else layer.saved_bytes)
                for layer in layers
            ),
            optimizer_state_bytes=tuple(
                float(layer.optimizer_state_bytes or 0) for layer in layers
            ),
            boundary_bytes=tuple(float(profile.boundary_bytes(i)) for i in range(len(layers) - 1)),
            tied=TiedLayers.from_profile(profile),
        )


@dataclass(frozen=True)
class StageCost:
    """The predicted time of one stage, split into its parts (all per microbatch, ms)."""

    compute_ms: float
    """(T + allreduce / microbatches) / replicas."""
    allreduce_ms: float
    """The allreduce part of ``compute_ms`` (already divided as above)."""
    transfer_ms: float
    """Largest charged input or output transfer time / replicas (0 if none is charged)."""
    tied_ms: float = 0.0
    """Trading tied parameters with the other stages that use them, per microbatch."""

    @property
    def total_ms(self) -> float:
        """The stage's time: compute and communication overlap, the slowest part counts."""
        return max(self.compute_ms, self.transfer_ms, self.tied_ms)


@dataclass(frozen=True)
class CostModel:
    """The cost model of one network level (see the module docstring)."""

    bandwidth: float
    """Bandwidth between the units of this level, bytes per second."""
    microbatches: int = 1
    """Microbatches per minibatch; replicas allreduce once per minibatch."""
    workers_per_unit: int = 1
    """``w``: the allreduce divisor (1 on the innermost level)."""
    name: str = DEFAULT_COST_MODEL
    """``symmetric`` or ``pipedream``."""

    def __post_init__(self) -> None:
        assert self.bandwidth > 0 and self.microbatches >= 1 and self.workers_per_unit >= 1
        assert self.name in COST_MODELS, self.name

    def allreduce_ms(self, param_bytes: Amount, *, replicas: int, lead: bool = True) -> Amount:
        """One ring allreduce of ``param_bytes`` over ``replicas`` units; ``lead``: the stage
        starts its pipeline (only such stages share it among the unit's workers under the
        ``pipedream`` variant)."""
        ring = 4.0 * (replicas - 1) * param_bytes / (self.bandwidth * replicas) * 1e3
        if lead or self.name == "symmetric":
            return ring / self.workers_per_unit
        return ring

    def compute_ms(
        self, compute_ms: Amount, *, param_bytes: Amount, replicas: int, lead: bool = True
    ) -> Amount:
        """Average time per microbatch of a stage's compute and allreduce on ``replicas``."""
        allreduce = self.allreduce_ms(param_bytes, replicas=replicas, lead=lead)
        return (compute_ms + allreduce / self.microbatches) / replicas

    def transfer_ms(self, boundary_bytes: Amount, *, replicas: int) -> Amount:
        """Average time per microbatch to move a cut's activations and gradients."""
        return 2.0 * boundary_bytes / (self.bandwidth * replicas) * 1e3

    def tied_ms(self, tied_bytes: Amount, *, replicas: int) -> Amount:
        """Average time per microbatch to trade ``tied_bytes`` of tied parameters (a gradient
        and a version once per minibatch)."""
        return self.transfer_ms(tied_bytes, replicas=replicas) / self.microbatches

    def charges(
        self, *, first: int, last: int, range_first: int, range_last: int, num_layers: int
    ) -> tuple[bool, bool]:
        """(input charged, output charged) for a stage ``first..last`` of a pipeline over
        ``range_first..range_last`` (an inner level's range, or the whole model)."""
        charge_in = first > range_first
        if self.name == "symmetric":
            return charge_in, last < range_last
        return charge_in, charge_in and last < num_layers - 1

    def stage_cost(
        self,
        costs: LayerCosts,
        *,
        first: int,
        last: int,
        replicas: int,
        inner_ms: float | None = None,
        range_first: int = 0,
        range_last: int | None = None,
    ) -> StageCost:
        """The cost of layers ``first..last`` on ``replicas`` units, as a stage of a pipeline
        over ``range_first..range_last`` (default: the whole model). ``inner_ms`` replaces the
        layers' compute time (an outer level's unit runs a pipeline of its own)."""
        n = costs.num_layers
        assert 0 <= range_first <= first <= last < n and replicas >= 1
        range_last = n - 1 if range_last is None else range_last
        lead = first == range_first
        compute = _in_order(costs.compute_ms[first : last + 1]) if inner_ms is None else inner_ms
        params = sum(costs.parameter_bytes[first : last + 1])
        charge_in, charge_out = self.charges(
            first=first, last=last, range_first=range_first, range_last=range_last, num_layers=n
        )
        transfer = 0.0
        if charge_in:
            transfer = self.transfer_ms(costs.cut_bytes(first - 1), replicas=replicas)
        if charge_out:
            transfer = max(transfer, self.transfer_ms(costs.cut_bytes(last), replicas=replicas))
        allreduce = self.allreduce_ms(params, replicas=replicas, lead=lead)
        tied = costs.tied.exchanged_bytes(first, last) if costs.tied else 0.0
        return StageCost(
            compute_ms=self.compute_ms(compute, param_bytes=params, replicas=replicas, lead=lead),
            allreduce_ms=allreduce / self.microbatches / replicas,
            transfer_ms=transfer,
            tied_ms=self.tied_ms(tied, replicas=replicas),
        )

    def pipeline_ms(self, costs: LayerCosts, *, stages: Sequence[tuple[int, int, int]]) -> float:
        """Time per microbatch of a one-level pipeline given as ``(first, last, replicas)``."""
        return max(
            self.stage_cost(costs, first=first, last=last, replicas=replicas).total_ms
            for first, last, replicas in stages
        )


def _in_order(values: Sequence[float]) -> float:
    """The sum of ``values`` added left to right, as ``np.cumsum`` adds them (the planner's
    matrix of stage times, :func:`~pipedream.optimizer.placed.stage_times`, must hold these very
    bits). Python's ``sum`` compensates rounding from 3.12 on, so it can differ in the last bit."""
    total = 0.0
    for value in values:
        total += value
    return total


def minibatch_ms(
    schedule: str, microbatch_ms: float, *, microbatches: int, num_stages: int
) -> float:
    """Time per minibatch of ``microbatches`` microbatches when the slowest stage takes
    ``microbatch_ms`` per microbatch.

    Asynchronous schedules (``pipedream``, ``pipedream-vs``, ``2bw``) never drain the
    pipeline, so a minibatch costs ``microbatches`` steady-state slots (for PipeDream: exactly
    its "time per stage in pipeline")::

        stage 0: F0 F1 B0 F2 B1 F3 B2 ...     one F and one B per slot once full

    Flushing ones (``1f1b``, ``gpipe``) drain after every minibatch, which adds the fill and
    drain bubble of ``num_stages - 1`` slots (exact for equal stages: ``(m + S - 1)(F + B)``)::

        stage 0: F0 F1 .  .  B0 B1 | F0 ...   S = 2, m = 2: 3 slots of F + B per minibatch
        stage 1: .  F0 F1 B0 B1 .  |

    A schedule may state its own bubble (:meth:`Schedule.drain_slots`): ``zb-h1`` fills two
    thirds of it with weight gradients, ``(S - 1) / 3`` slots when ``F = I = W``; the planner
    simulates such plans anyway (:func:`~pipedream.optimizer.verify.needs_simulation`).
    """
    return (microbatches + lookup(schedule).drain_slots(num_stages)) * microbatch_ms
