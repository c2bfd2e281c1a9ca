"""Where the cost model's formula is not exact, the planner asks the simulator.

The formula (:func:`~pipedream.optimizer.cost_model.minibatch_ms`: ``m`` or ``m + S - 1``
slots of the slowest stage, a stage on ``r`` replicas counting ``1/r`` of its compute) is the
dynamic program's objective. As a prediction it idealizes every pipeline:

* it assumes every transfer, and the round trip of a minibatch through the later stages,
  hidden behind compute. PipeDream's warm-up keeps ``(workers - 1 - replicas before) // r_s``
  minibatches in flight per replica, too few for that where transfers or a replicated stage's
  allreduce are long. On the original ResNet-50 profile, 6 workers at 1 GB/s, the formula says
  106.0 ms per minibatch for a 3-2-1 split, 1.23x faster than data parallelism; the simulation
  of the very tables the runtime runs says 254.8 ms, against 130.7 ms for data parallelism
  (which the PipeDream paper also found best for ResNet-50 on its GPUs), and 406.8 ms for the
  formula's 278.4 ms of a 2-stage pipeline on 2 workers. VGG-16's 7-1 split simulates to the
  formula's 103.8 ms, as the paper's speed-ups for it say;
* it charges a cut's transfer to the stages on either side, and where the replicas of a stage
  feed one worker, that worker takes in their activations through one network interface,
  one after another (:data:`INTERFACE`): ResNet-50's 7-1 split on 8 workers simulates at
  102.8 ms per minibatch so (81.2 ms if every link were on its own, faster than data
  parallelism's 100.2 ms), where the formula charges its last stage 205.5 ms of transfers;
* it charges a flush ``S - 1`` slots of the *slowest* stage, too much for uneven stages;
* where a replicated stage meets several microbatches per minibatch, the runtime gives
  minibatch ``t`` with *all* its ``m`` microbatches to replica ``t mod r``, so a replica does
  not take ``1/r`` of every minibatch, and under a flush the unreplicated stages still see
  each minibatch alone. On the original VGG-16 profile, 4 workers, 1f1b with ``m = 4``, the
  formula says 1027.6 ms per minibatch for a 3-1 split; the simulation says 1846.7 ms, slower
  than data parallelism;
* it does not know how a split backward fills the bubble.

So the planner simulates (:mod:`~pipedream.optimizer.simulator`, profiled costs, the
topology's bandwidths, a network interface per worker and level, no latency) every plan of
several stages, every replicated plan with several microbatches and every plan with split
backwards: the dynamic program's plan, the best straight pipeline and data parallelism under
the same schedule and ``m``, then the plans a local search finds beside the fastest of those
(:mod:`~pipedream.optimizer.refine`), keeping the fastest and recording ``method: simulated``
in its prediction; with ``--schedule auto``, every
candidate is simulated as soon as one needs it. The simulation also charges what the formula
leaves out (each layer's ``update_ms``, the runtime's cost per action, weight copies), so
simulated plans are only ever compared with simulated plans. A plan of one stage needs no
simulation: :func:`one_stage_ms` charges exactly what the simulation would (its replicas meet
only in the allreduce, so nothing waits), and its prediction and the data parallel line are
that. ``--cost-model pipedream``, the
original optimizer's arithmetic, keeps the formula but for replicated stages under several
microbatches and split backwards. Simulation is skipped (the formula stands for all) above
:data:`MAX_SIMULATED_ACTIONS` actions, where it would cost more than the planning itself; a
simulation that needs more minibatches to reach its steady state stops at that budget.
"""

from __future__ import annotations

import functools
import math

from pipedream.formats.plan import Plan, StagePlan
from pipedream.formats.profile import Profile
from pipedream.formats.topology import Topology
from pipedream.optimizer.bounds import minibatch_lower_bound
from pipedream.optimizer.simulator import Network, Timeline, default_steps, simulate, stage_work
from pipedream.optimizer.tree import Cluster
from pipedream.schedules import Op, build_tables, lookup, spec_from_plan, version_use

__all__ = [
    "INTERFACE",
    "MAX_SIMULATED_ACTIONS",
    "cluster_network",
    "data_parallel_time_ms",
    "lower_bound_ms",
    "needs_simulation",
    "one_stage_ms",
    "planner_network",
    "simulated_ms",
    "simulated_run",
    "simulation_work",
    "steady_ms",
    "too_big_to_simulate",
]

INTERFACE = True
"""Whether the planner's simulations give every worker a network interface per level, which
sends one message at a time and receives one at a time: a worker receives from several
others no faster than from one (:class:`~pipedream.optimizer.simulator.Network`'s
``interface``)."""

MAX_SIMULATED_ACTIONS = 200_000
"""Compute actions (forward, backward) of a simulation of :func:`default_steps` minibatches
beyond which the formula stands; also the most a simulation may grow to."""


def needs_simulation(plan: Plan) -> bool:
    """Whether the plan's time is the simulation's rather than the formula's: split backwards,
    a replicated stage under several microbatches, or (but under ``--cost-model pipedream``,
    the original optimizer's arithmetic) a pipeline of several stages."""
    if lookup(plan.schedule).splits_backward:
        return True
    replicated = any(stage.replicas > 1 for stage in plan.stages)
    if plan.microbatches > 1 and replicated:
        return True
    original = plan.prediction is not None and plan.prediction.cost_model == "pipedream"
    return len(plan.stages) > 1 and not original


def one_stage_ms(plan: Plan, profile: Profile, network: Network) -> float:
    """The time per minibatch of a plan of one stage, exactly as :func:`simulated_ms` gives it
    (on ``network``, whose allreduce it charges), without simulating.

    Every replica runs the whole model on its own minibatches (minibatch ``t`` on replica
    ``t mod R``) and meets the others only in the allreduce before each update, so nothing
    waits and every replica's ``R`` minibatches take the sum of its actions:
    ``m (F + B) + (m - 1) accumulate + allreduce + U`` (the layers' forward and backward and
    ``update_ms``, the runtime's cost per action, reading the inputs and targets, the loss,
    adding into ``.grad``: :func:`~pipedream.optimizer.simulator.stage_work`) plus a weight
    copy for each update whose version is stashed (2bw's), divided by ``R``.
    """
    assert len(plan.stages) == 1, plan.stages
    (work,) = stage_work(plan, profile)
    (stage,) = plan.stages
    m = plan.microbatches
    allreduce = network.allreduce_ms(work.parameter_bytes, stage.ranks) if stage.replicas > 1 else 0
    round_ms = (
        m * (work.forward_ms + work.backward_ms)
        + (m - 1) * work.accumulate_ms
        + allreduce
        + work.update_ms
        + _copies_per_update(plan.schedule, m) * work.copy_ms
    )
    return round_ms / stage.replicas


COPY_PROBE_MINIBATCHES = 8
"""Minibatches of the table :func:`_copies_per_update` reads (its middle updates are those of
the steady state: one stage keeps at most two versions)."""


@functools.cache
def _copies_per_update(schedule: str, microbatches: int) -> float:
    """The share of a one-stage plan's steady-state updates whose version is stashed (used
    after the next update), read from the schedule's own table for one worker."""
    n = COPY_PROBE_MINIBATCHES
    probe = Plan("probe", schedule, 1, microbatches, 1, (StagePlan("a", "a", 1, (0,)),))
    (table,) = build_tables(spec_from_plan(probe, 0, n)).values()
    use = version_use(table, initial_version=0)
    updates = sum(action.op is Op.UPDATE for action in table)
    middle = range(updates // 4 + 1, updates - updates // 4 + 1)  # version v: the v-th update
    return sum(use.needs_copy(v) for v in middle) / len(middle)


def _compute_actions(plan: Plan) -> int:
    return 2 * plan.world_size * plan.microbatches * default_steps(plan)


def too_big_to_simulate(plan: Plan) -> bool:
    """Whether :func:`simulated_run` gives None for ``plan`` (above
    :data:`MAX_SIMULATED_ACTIONS`)."""
    return _compute_actions(plan) > MAX_SIMULATED_ACTIONS


def simulated_run(
    plan: Plan, profile: Profile, topology: Topology, *, max_doublings: int | None = None
) -> Timeline | None:
    """The simulated run of the plan, or None when it would be too big; with
    ``max_doublings``, a run whose steady state has not shown by then stops with
    ``2**max_doublings`` times :func:`default_steps` minibatches (its time is then the
    average of its second half)."""
    if too_big_to_simulate(plan):
        return None
    actions = _compute_actions(plan)
    longest = default_steps(plan) * MAX_SIMULATED_ACTIONS // actions
    if max_doublings is not None:
        longest = min(longest, default_steps(plan) * 2**max_doublings)
    return simulate(
        plan, stage_work(plan, profile), planner_network(topology), max_minibatches=longest
    )


def planner_network(topology: Topology) -> Network:
    """The network the planner's simulations run on: the topology's bandwidths, an interface
    per worker and level (:data:`INTERFACE`), no latency and no cost of posting."""
    return Network.from_topology(topology, interface=INTERFACE)


def lower_bound_ms(plan: Plan, profile: Profile, topology: Topology) -> float:
    """A lower bound on the steady-state time :func:`simulated_ms` gives for ``plan``
    (:mod:`~pipedream.optimizer.bounds`; a run too short for its steady state can average
    less)."""
    return minibatch_lower_bound(plan, stage_work(plan, profile), planner_network(topology))


def steady_ms(timeline: Timeline | None) -> float | None:
    """A simulated run's steady-state time per minibatch (None: no run, or no finite time)."""
    if timeline is None:
        return None
    value = timeline.time_per_minibatch_ms
    return value if math.isfinite(value) and value > 0 else None


def simulation_work(timeline: Timeline | None, plan: Plan) -> int:
    """What a simulated run cost, in events and messages: its own, and those of the shorter
    runs :func:`~pipedream.optimizer.simulator.simulate` doubled from (each half as long,
    from :func:`default_steps` on); 0 for no run."""
    if timeline is None:
        return 0
    longest = timeline.num_minibatches
    runs = (2 * longest - default_steps(plan)) / longest  # 1 + 1/2 + ... down to the first
    return math.ceil((len(timeline.events) + len(timeline.messages)) * runs)


def simulated_ms(plan: Plan, profile: Profile, topology: Topology) -> float | None:
    """The simulated steady-state time per minibatch, or None when the run would be too big."""
    return steady_ms(simulated_run(plan, profile, topology))


def cluster_network(cluster: Cluster) -> Network:
    """The planner's network (:func:`planner_network`) of the
    topology ``cluster`` was made from (its levels of one unit change no allreduce)."""
    sizes = tuple(cluster.unit_workers(level) for level in range(cluster.num_levels))
    return Network(sizes, cluster.bandwidths, interface=INTERFACE)


def data_parallel_time_ms(
    profile: Profile, cluster: Cluster, schedule: str, *, recompute: bool = False
) -> float:
    """Every worker of ``cluster`` running the whole model under ``schedule`` (its ``m``;
    ``recompute``: recomputing activations): exact, as the simulation gives it
    (:func:`one_stage_ms`)."""
    names = profile.layer_names
    workers = cluster.num_workers
    plan = Plan(
        workload=profile.workload,
        schedule=schedule,
        microbatch_size=profile.microbatch_size,
        microbatches=cluster.microbatches,
        world_size=workers,
        stages=(StagePlan(names[0], names[-1], workers, tuple(range(workers))),),
        workload_args=dict(profile.workload_args),
        layers=tuple(names),
        recompute=recompute,
    )
    return one_stage_ms(plan, profile, cluster_network(cluster))
