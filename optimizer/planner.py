"""From a Profile and a Topology to a Plan: options, the DP, ranks and the prediction block.

``make_plan`` checks the options and runs :func:`pipedream.optimizer.partition.partition` on
the cluster's one network level (for 1f1b and gpipe, whose flush costs ``S - 1`` slots per
minibatch, :func:`~pipedream.optimizer.partition.partition_by_stage_count`, keeping the stage
count ``S`` with the smallest ``(m + S - 1) x slowest stage``). It gives stage ``s`` the next
``r_s`` consecutive global ranks (so a straight pipeline puts stage ``s`` on rank ``s``) and
fills the plan's ``prediction``:

* ``stage_ms``: each stage's time per *microbatch* (PipeDream's "time per stage"), and
  ``bottleneck`` the slowest stage (the first one on ties);
* ``time_per_minibatch_ms``: :func:`~pipedream.optimizer.cost_model.minibatch_ms` of the slowest
  stage, i.e. PipeDream's "time per stage in pipeline" for its own schedule (one microbatch
  per minibatch), ``microbatches`` slots for 2bw, plus the flush bubble for 1f1b/gpipe;
* ``throughput_samples_per_s = microbatch_size * microbatches * 1000 / time_per_minibatch_ms``;
* ``memory_bytes``: :class:`~pipedream.optimizer.memory.MemoryModel`'s estimate per worker;
* ``data_parallel_time_per_minibatch_ms``: all workers replicating the whole model under the
  same cost model (``microbatches`` slots, no bubble).

Default ``microbatches``: 1 for pipedream/pipedream-vs; for 2bw/1f1b/gpipe ``max(4, S)`` with
``S`` the number of stages (2bw needs ``m >= S``; ``m >= S`` also keeps 1f1b's bubble small):
plan with 4, and if that plan has more stages, plan again with ``m = S`` (a larger ``m`` only
makes allreduce cheaper per microbatch), keeping ``m >= S`` in the end.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipedream.errors import PlanningError
from pipedream.formats.plan import ASYNC_SCHEDULES, SCHEDULES, Plan, Prediction, StagePlan
from pipedream.formats.profile import Profile
from pipedream.formats.topology import Level, Topology
from pipedream.formats.units import format_bytes
from pipedream.optimizer.cost_model import (
    COST_MODELS,
    CostModel,
    LayerCosts,
    StageCost,
    minibatch_ms,
)
from pipedream.optimizer.memory import MemoryModel
from pipedream.optimizer.partition import (
    Partition,
    StageSpan,
    partition,
    partition_by_stage_count,
)

__all__ = [
    "DEFAULT_SYNC_MICROBATCHES",
    "FLUSH_SCHEDULES",
    "Evaluation",
    "PlanOptions",
    "build_plan",
    "evaluate",
    "make_plan",
    "network_level",
]

DEFAULT_SYNC_MICROBATCHES = 4
"""Smallest default number of microbatches for 2bw, 1f1b and gpipe."""
FLUSH_SCHEDULES = ("1f1b", "gpipe")
"""Schedules that drain the pipeline after every minibatch (a bubble of S - 1 slots)."""


@dataclass(frozen=True)
class PlanOptions:
    """What ``pipedream plan`` asks of the optimizer besides the profile and the cluster."""

    schedule: str = "pipedream"
    """One of :data:`pipedream.formats.plan.SCHEDULES`."""
    microbatches: int | None = None
    """Microbatches per minibatch; None picks the default of the module docstring."""
    straight: bool = False
    """One replica per stage."""
    memory: float | None = None
    """Bytes per worker; overrides the topology's ``memory``; None: no memory limit."""
    cost_model: str = "pipedream"
    """One of :data:`pipedream.optimizer.cost_model.COST_MODELS`."""
    use_fewer_workers: bool = False
    """Allow a plan with fewer workers than the cluster has when it is no slower (the
    original's ``--use_fewer_machines``); off, every worker is used, as in the original."""


@dataclass(frozen=True)
class Evaluation:
    """A partition evaluated under the cost and memory models."""

    stage_costs: tuple[StageCost, ...]
    """Each stage's time per microbatch, by part."""
    memory_bytes: tuple[float, ...]
    """Each stage's estimated memory per worker."""
    microbatch_ms: float
    """Slowest stage's time per microbatch."""
    time_per_minibatch_ms: float
    """See the module docstring."""
    bottleneck: int
    """Index of the slowest stage."""


def evaluate(
    costs: LayerCosts,
    *,
    stages: tuple[StageSpan, ...],
    model: CostModel,
    schedule: str,
) -> Evaluation:
    """Predict the time and memory of ``stages`` (any partition, also a hand-made one)."""
    num_workers = sum(stage.replicas for stage in stages)
    memory_model = MemoryModel(schedule, num_workers, model.microbatches)
    stage_costs, memory, before = [], [], 0
    for stage in stages:
        stage_costs.append(
            model.stage_cost(costs, first=stage.first, last=stage.last, replicas=stage.replicas)
        )
        memory.append(
            memory_model.stage_bytes(
                costs,
                first=stage.first,
                last=stage.last,
                workers_before=before,
                replicas=stage.replicas,
            )
        )
        before += stage.replicas
    totals = [cost.total_ms for cost in stage_costs]
    slowest = max(totals)
    return Evaluation(
        stage_costs=tuple(stage_costs),
        memory_bytes=tuple(memory),
        microbatch_ms=slowest,
        time_per_minibatch_ms=minibatch_ms(
            schedule, slowest, microbatches=model.microbatches, num_stages=len(stages)
        ),
        bottleneck=totals.index(slowest),
    )


def network_level(topology: Topology) -> Level:
    """The one level to plan on; levels of a single unit are no level at all."""
    levels = [level for level in topology.levels if level.workers > 1] or [topology.levels[0]]
    if len(levels) > 1:
        shape = " x ".join(f"{level.workers} {level.name}" for level in levels)
        raise PlanningError(
            f"the topology has {len(levels)} levels with more than one unit ({shape}); "
            "multi-level (hierarchical) planning is not supported yet: plan for one level with "
            f"--workers {topology.num_workers} --bandwidth B, B the slowest level's bandwidth"
        )
    return Level(levels[0].name, topology.num_workers, levels[0].bandwidth)


def _check_options(options: PlanOptions) -> None:
    if options.schedule not in SCHEDULES:
        raise PlanningError(
            f"unknown schedule {options.schedule!r}; use one of {', '.join(SCHEDULES)}"
        )
    if options.cost_model not in COST_MODELS:
        raise PlanningError(
            f"unknown cost model {options.cost_model!r}; use one of {', '.join(COST_MODELS)}"
        )
    m = options.microbatches
    if m is not None and m < 1:
        raise PlanningError(f"--microbatches {m}: must be at least 1")
    if m is not None and m != 1 and options.schedule in ASYNC_SCHEDULES:
        raise PlanningError(
            f"--microbatches {m} with schedule {options.schedule!r}: PipeDream updates after "
            "every microbatch, so it must be 1; use --schedule 2bw to accumulate gradients"
        )
    if options.memory is not None and options.memory <= 0:
        raise PlanningError(f"--memory {options.memory:g}: must be a positive number of bytes")


def _partition(
    costs: LayerCosts, level: Level, options: PlanOptions, microbatches: int, memory: float | None
) -> tuple[Partition, CostModel]:
    model = CostModel(level.bandwidth, microbatches=microbatches, name=options.cost_model)
    memory_model = MemoryModel(options.schedule, level.workers, microbatches)
    straight, fewer = options.straight, options.use_fewer_workers
    result: Partition | None
    if options.schedule in FLUSH_SCHEDULES:
        # the bubble grows with the number of stages: choose the count too, not only the stages
        by_count = partition_by_stage_count(
            costs,
            num_workers=level.workers,
            model=model,
            straight=straight,
            use_fewer_workers=fewer,
            memory_limit=memory,
            memory_model=memory_model,
        )
        result = min(
            by_count.values(),
            key=lambda p: (
                minibatch_ms(
                    options.schedule, p.time_ms, microbatches=microbatches, num_stages=len(p.stages)
                ),
                len(p.stages),
            ),
            default=None,
        )
    else:
        result = partition(
            costs,
            num_workers=level.workers,
            model=model,
            straight=straight,
            use_fewer_workers=fewer,
            memory_limit=memory,
            memory_model=memory_model,
        )
    if result is not None:
        return result, model
    n, workers = costs.num_layers, level.workers
    if options.straight and workers > n and not options.use_fewer_workers:
        raise PlanningError(
            f"--straight with {workers} workers needs at least {workers} layers, but the "
            f"profile has {n}; use --workers {n} or fewer, or drop --straight to replicate stages"
        )
    assert memory is not None
    fixes = "raise --memory or add workers"
    if options.schedule in ASYNC_SCHEDULES:
        fixes += ", or use a schedule that keeps fewer weight versions (2bw, 1f1b)"
    raise PlanningError(
        f"no partition of {n} layers over {workers} workers fits in {format_bytes(memory)} "
        f"per worker (schedule {options.schedule}, estimated memory); {fixes}"
    )


def make_plan(profile: Profile, *, topology: Topology, options: PlanOptions) -> Plan:
    """Plan ``profile`` on ``topology``: see the module docstring."""
    _check_options(options)
    level = network_level(topology)
    memory = options.memory if options.memory is not None else topology.memory
    costs = LayerCosts.from_profile(profile)
    microbatches = options.microbatches
    if microbatches is None and options.schedule in ASYNC_SCHEDULES:
        microbatches = 1
    if microbatches is None:
        microbatches = DEFAULT_SYNC_MICROBATCHES
        result, model = _partition(costs, level, options, microbatches, memory)
        for _ in range(3):
            if len(result.stages) <= microbatches:
                break
            microbatches = len(result.stages)
            result, model = _partition(costs, level, options, microbatches, memory)
        if len(result.stages) > microbatches:  # did not settle: keep the plan, raise m
            model = replace(model, microbatches=len(result.stages))
    else:
        result, model = _partition(costs, level, options, microbatches, memory)
    microbatches = model.microbatches
    if options.schedule == "2bw" and microbatches < len(result.stages):
        raise PlanningError(
            f"--microbatches {microbatches} with schedule 2bw: the plan has "
            f"{len(result.stages)} stages and 2bw needs at least one microbatch per stage; "
            f"use --microbatches {len(result.stages)} or more"
        )
    return build_plan(profile, stages=result.stages, model=model, schedule=options.schedule)


def build_plan(
    profile: Profile, *, stages: tuple[StageSpan, ...], model: CostModel, schedule: str
) -> Plan:
    """The Plan of ``stages`` with consecutive ranks and a filled ``prediction``."""
    costs = LayerCosts.from_profile(profile)
    names = profile.layer_names
    evaluation = evaluate(costs, stages=stages, model=model, schedule=schedule)
    num_workers = sum(stage.replicas for stage in stages)
    data_parallel_ms = model.data_parallel_ms(costs, num_workers=num_workers) * model.microbatches
    samples = profile.microbatch_size * model.microbatches
    stage_plans, rank = [], 0
    for stage in stages:
        ranks = tuple(range(rank, rank + stage.replicas))
        rank += stage.replicas
        stage_plans.append(StagePlan(names[stage.first], names[stage.last], stage.replicas, ranks))
    time_ms = evaluation.time_per_minibatch_ms
    if time_ms <= 0:
        raise PlanningError(
            f"the profile of {profile.workload} predicts 0 ms per minibatch (every layer time "
            "and size is zero); profile the workload again"
        )
    prediction = Prediction(
        time_per_minibatch_ms=time_ms,
        throughput_samples_per_s=samples * 1e3 / time_ms,
        bottleneck=evaluation.bottleneck,
        stage_ms=tuple(cost.total_ms for cost in evaluation.stage_costs),
        memory_bytes=evaluation.memory_bytes,
        data_parallel_time_per_minibatch_ms=data_parallel_ms,
        cost_model=model.name,
    )
    return Plan(
        workload=profile.workload,
        schedule=schedule,
        microbatch_size=profile.microbatch_size,
        microbatches=model.microbatches,
        world_size=num_workers,
        stages=tuple(stage_plans),
        workload_args=dict(profile.workload_args),
        layers=tuple(names),
        prediction=prediction,
    )
