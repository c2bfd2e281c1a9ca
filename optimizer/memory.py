"""Per-worker memory estimate of a stage, by schedule (what ``--memory`` is checked against).

A worker running a stage (layers ``first..last``) holds::

    weights      versions x params        (versions counts the live copy)
    gradients    1 x params
    optimizer    optimizer_state_bytes    (0 when the profile does not record it)
    activations  in_flight x activations  (saved_bytes, else output_bytes, per microbatch)

where params include the copies of tied parameters that the stage holds without owning them
(:mod:`~pipedream.optimizer.tied_costs`; their optimizer state lives with the owner). With
``--recompute`` (``LayerCosts.recompute``) a stage keeps only its inputs per microbatch in
flight, and the activations of the one microbatch whose backward recomputes them::

    activations  in_flight x input bytes + 1 x activations

(the first stage's input bytes: one microbatch of the model's input, the profile's
``input_bytes``).

``in_flight`` is the number of microbatches whose activations a worker keeps at once, read
off the runtime's action tables (``pipedream.schedules``) for a stage of ``R`` replicas
with ``W_from`` workers in it and all later stages, ``S - s`` stages from it on:

=============  ======================================  ========
schedule       in_flight                               versions
=============  ======================================  ========
pipedream(-vs) ceil(W_from / R)  (warm-up depth + 1)   in_flight
2bw            S - s                                   2
1f1b           min(S - s, m)                           1
gpipe          m                                       1
=============  ======================================  ========

The dynamic program builds pipelines front to back, so it knows the workers before a stage but
not how many stages follow; it uses ``W_from - R + 1 >= S - s`` (every later stage has a
worker), exact for straight pipelines and an upper bound otherwise.

**Placement context.** On a hierarchical cluster a stage of the innermost level is one of
several stages of a pipeline inside a unit, and that unit pipeline may itself be replicated
``mult`` times and followed by ``after`` workers of later (outer) stages. With ``w`` the
unit's workers from the stage on and ``r`` its replicas inside the unit::

    R = mult * r,    W_from = mult * w + after,    S - s <= (w - r + 1) + after

:class:`Context` carries ``(mult, after)``; a one-level cluster is ``Context(1, 0)``.

With ``use_fewer_workers`` the program, building front to back, counts the capacity after a
stage as if it were all used (an upper bound); the plan reports the estimate for the workers
it really uses (:func:`~pipedream.optimizer.tree.evaluate_tree`).

This is an estimate for planning (no framework overhead, workspace or fragmentation).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedream.optimizer.cost_model import LayerCosts
from pipedream.schedules import SCHEDULES

__all__ = ["ROOT", "Context", "MemoryModel"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Context:
    """Where a unit's pipeline sits in the whole pipeline (see the module docstring)."""

    mult: int = 1
    """Replicas of the enclosing unit pipeline (product over the outer levels)."""
    after: int = 0
    """Workers of the outer stages that follow the enclosing unit pipeline."""

    def inner(self, *, replicas: int, after_units: int, unit_workers: int) -> Context:
        """The context of the pipeline inside a stage of ``replicas`` units of ``unit_workers``
        workers each, followed by ``after_units`` units of the same pipeline level."""
        return Context(self.mult * replicas, self.mult * after_units * unit_workers + self.after)


ROOT = Context()
"""The context of the top level: nothing encloses it."""


@dataclass(frozen=True)
class MemoryModel:
    """Memory per worker of a stage for one schedule and minibatch shape."""

    schedule: str
    """A schedule name (:data:`pipedream.schedules.SCHEDULES`)."""
    microbatches: int = 1
    """Microbatches per minibatch."""

    def __post_init__(self) -> None:
        assert self.schedule in SCHEDULES, self.schedule
        assert self.microbatches >= 1

    def in_flight(self, *, workers_from: int, replicas: int, context: Context = ROOT) -> int:
        """Microbatches whose activations one replica holds; ``workers_from`` and ``replicas``
        are counted inside the unit (the whole cluster on one level)."""
        assert workers_from >= replicas >= 1
        total = context.mult * workers_from + context.after
        depth = _ceil_div(total, context.mult * replicas)  # PipeDream's warm-up depth + 1
        stages_from = workers_from - replicas + 1 + context.after
        return SCHEDULES[self.schedule].in_flight(self.microbatches, stages_from, depth)

    def weight_versions(self, *, workers_from: int, replicas: int, context: Context = ROOT) -> int:
        """Copies of the stage's weights one replica keeps (live copy included)."""
        in_flight = self.in_flight(workers_from=workers_from, replicas=replicas, context=context)
        return SCHEDULES[self.schedule].weight_versions(in_flight)

    def factors(
        self, *, workers_from: int, replicas: int, context: Context = ROOT
    ) -> tuple[int, int]:
        """``(parameter factor, activation factor)``: memory = pf x params + opt + af x acts.

        The partitioner applies these to whole matrices of layer ranges at once.
        """
        versions = self.weight_versions(
            workers_from=workers_from, replicas=replicas, context=context
        )
        return versions + 1, self.in_flight(
            workers_from=workers_from, replicas=replicas, context=context
        )

    def context_key(self, context: Context) -> object:
        """What of ``context`` the estimate depends on (equal keys: equal estimates), so that
        the planner solves an inner level once per distinct key."""
        key = SCHEDULES[self.schedule].memory_key
        return key(context.after, context.mult, self.microbatches)

    def stage_bytes(
        self,
        costs: LayerCosts,
        *,
        first: int,
        last: int,
        workers_from: int,
        replicas: int,
        context: Context = ROOT,
    ) -> float:
        """Estimated bytes per worker of layers ``first..last`` (inclusive)."""
        param_factor, activation_factor = self.factors(
            workers_from=workers_from, replicas=replicas, context=context
        )
        span = slice(first, last + 1)
        copies = costs.tied.copy_bytes(first, last) if costs.tied else 0.0
        activations = sum(costs.activation_bytes[span])
        if costs.recompute:  # inputs per microbatch in flight, one microbatch's activations
            held = activation_factor * costs.kept_input_bytes(first) + activations
        else:
            held = activation_factor * activations
        return (
            param_factor * (sum(costs.parameter_bytes[span]) + copies)
            + sum(costs.optimizer_state_bytes[span])
            + held
        )
