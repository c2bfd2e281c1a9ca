"""Where the cost model's formula is not exact, the planner asks the simulator.

The formula (:func:`~pipedream.optimizer.cost_model.minibatch_ms`: ``m`` or ``m + S - 1``
slots of the slowest stage, a stage on ``r`` replicas counting ``1/r`` of its compute) is exact
in its own terms (compute, transfers, allreduces) for straight pipelines and for PipeDream's
one-microbatch schedules. It is not when a replicated stage meets several microbatches per
minibatch: the runtime gives minibatch ``t`` with *all* its ``m`` microbatches to replica
``t mod r``, so a replica does not take ``1/r`` of every minibatch, and under a flush the
unreplicated stages still see each minibatch alone. On the original VGG-16 profile, 4 workers,
1f1b with ``m = 4``, the formula says 1027.6 ms per minibatch for a 3-1 split; the simulation of
the very tables the runtime runs says 1801.8 ms, slower than data parallelism.

So for such plans the planner simulates (:mod:`~pipedream.optimizer.simulator`, profiled costs,
the topology's bandwidths, no latency) the dynamic program's plan, the best straight pipeline
and data parallelism under the same schedule and ``m``, keeps the fastest and records
``method: simulated`` in its prediction; with ``--schedule auto``, every candidate is simulated
as soon as one needs it. The simulation also charges what the formula leaves out (each
layer's ``update_ms``, the runtime's cost per action, weight copies), so simulated plans are
only ever compared with simulated plans. Simulation is skipped (the formula stands for all)
above :data:`MAX_SIMULATED_ACTIONS` actions, where it would cost more than the planning itself;
a simulation that needs more minibatches to reach its steady state stops at that budget.
"""

from __future__ import annotations

import math

from pipedream.formats.plan import Plan
from pipedream.formats.profile import Profile
from pipedream.formats.topology import Topology
from pipedream.optimizer.simulator import Network, default_steps, simulate, stage_work
from pipedream.schedules import lookup

__all__ = ["MAX_SIMULATED_ACTIONS", "needs_simulation", "simulated_ms"]

MAX_SIMULATED_ACTIONS = 200_000
"""Compute actions (forward, backward) of a simulation of :func:`default_steps` minibatches
beyond which the formula stands; also the most a simulation may grow to."""


def needs_simulation(plan: Plan) -> bool:
    """Whether the formula may be wrong for ``plan``: a replicated stage and ``m > 1``, or a
    schedule that splits backwards (its bubble depends on how the backward splits)."""
    replicated = plan.microbatches > 1 and any(stage.replicas > 1 for stage in plan.stages)
    return replicated or lookup(plan.schedule).splits_backward


def _compute_actions(plan: Plan) -> int:
    return 2 * plan.world_size * plan.microbatches * default_steps(plan)


def simulated_ms(plan: Plan, profile: Profile, topology: Topology) -> float | None:
    """The simulated steady-state time per minibatch, or None when the run would be too big."""
    actions = _compute_actions(plan)
    if actions > MAX_SIMULATED_ACTIONS:
        return None
    timeline = simulate(
        plan,
        stage_work(plan, profile),
        Network.from_topology(topology),
        max_minibatches=default_steps(plan) * MAX_SIMULATED_ACTIONS // actions,
    )
    value = timeline.time_per_minibatch_ms
    return value if math.isfinite(value) and value > 0 else None
