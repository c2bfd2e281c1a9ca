"""From a Profile and a Topology to a Plan: options, the search, ranks and the prediction.

:func:`plan_profile` checks the options, solves the schedule (or searches them with
``auto``, :mod:`~pipedream.optimizer.search`) with the hierarchical dynamic program on the
topology's levels (:mod:`~pipedream.optimizer.hierarchy`), and turns the chosen
:data:`~pipedream.optimizer.tree.Tree` into a :class:`~pipedream.formats.plan.Plan`
(:func:`build_plan`): one plan stage per innermost stage, its ranks from
:func:`~pipedream.optimizer.tree.leaf_ranks` (consecutive ranks share a server; a stage's
replicas stay inside the innermost unit when the tree puts them there), and the prediction:

* ``stage_ms``: each stage's time per *microbatch* seen from the top (PipeDream's "time per
  stage"), ``bottleneck`` the slowest (the first one on ties);
* ``time_per_minibatch_ms``: :func:`~pipedream.optimizer.cost_model.minibatch_ms` of the
  slowest stage: PipeDream's "time per stage in pipeline" for its own schedule, ``m`` slots
  for 2bw, plus the flush bubble ``S - 1`` for 1f1b/gpipe; where that formula is not exact
  (pipelines, replicated stages under ``m > 1``, split backwards) the simulated time of the
  DP's plan, the best straight pipeline and data parallelism decides, and the fastest is kept
  (``method: simulated``, :mod:`~pipedream.optimizer.verify`); a plan of one stage takes
  :func:`~pipedream.optimizer.verify.one_stage_ms`, which charges exactly what its simulation
  would (the updates and the runtime's cost per action too);
* ``throughput_samples_per_s = microbatch_size * m * 1000 / time_per_minibatch_ms``;
* ``memory_bytes``: :class:`~pipedream.optimizer.memory.MemoryModel`'s estimate per worker;
* ``data_parallel_time_per_minibatch_ms``: every worker replicating the whole model (one
  stage on every level), same schedule and ``m``: exact (as simulated) where the plan's time
  is, the slot formula beside a pipeline's formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pipedream.errors import PlanningError
from pipedream.formats.plan import Plan, Prediction, StagePlan
from pipedream.formats.profile import Profile
from pipedream.formats.topology import Topology
from pipedream.optimizer.bounds import BOUND_SLACK
from pipedream.optimizer.cost_model import (
    COST_MODELS,
    DEFAULT_COST_MODEL,
    LayerCosts,
    minibatch_ms,
)
from pipedream.optimizer.memory import MemoryModel
from pipedream.optimizer.placed import PLACED, copy_counts, placed_search
from pipedream.optimizer.refine import Moves, Refined, refine
from pipedream.optimizer.search import (
    AUTO_MICROBATCHES,
    Outcome,
    Request,
    memory_cause,
    rank_outcomes,
    solve_auto,
    solve_schedule,
)
from pipedream.optimizer.table_memory import worker_memory
from pipedream.optimizer.tree import (
    Cluster,
    Tree,
    TreeEvaluation,
    data_parallel_tree,
    evaluate_tree,
    leaf_ranks,
)
from pipedream.optimizer.verify import (
    cluster_network,
    data_parallel_time_ms,
    lower_bound_ms,
    needs_simulation,
    one_stage_ms,
    simulated_ms,
    simulated_run,
    simulation_work,
    steady_ms,
)
from pipedream.precision import SCALES_LOSS
from pipedream.schedules import MAX_MICROBATCHES, SCHEDULES, lookup, spec_from_plan
from pipedream.schedules.global_norm import global_norm_problem

__all__ = [
    "AUTO",
    "DEFAULT_SCHEDULE",
    "PlanOptions",
    "PlanResult",
    "build_plan",
    "data_parallel_tree",
    "default_schedule",
    "make_plan",
    "plan_profile",
]

AUTO = "auto"
"""``--schedule auto``: search the schedules and numbers of microbatches."""

REFINE_BUDGET = 100_000
"""The simulation work (simulated events and messages, all simulations together) the local
search around a simulated plan may spend (the last simulation may go over it): a few seconds
of planning on a 16-worker plan."""

REFINE_DOUBLINGS = 2
"""How often a simulation of the local search may double its run to find a steady state
(the planner's own allow more): a plan whose runs never settle costs the search little."""


DEFAULT_SCHEDULE = "default"
"""``PlanOptions.schedule`` where none is asked for: see :func:`default_schedule`."""


def default_schedule(profile: Profile) -> str:
    """The schedule planned where none is asked for: PipeDream's own, or ``1f1b`` for an fp16
    profile (its loss scale skips an update on every stage at once)."""
    return "1f1b" if profile.precision in SCALES_LOSS else "pipedream"


@dataclass(frozen=True)
class PlanOptions:
    """What ``pipedream plan`` asks of the optimizer besides the profile and the cluster."""

    schedule: str = DEFAULT_SCHEDULE
    """A schedule name (:data:`pipedream.schedules.SCHEDULES`), ``auto``, or
    :data:`DEFAULT_SCHEDULE`: ``pipedream``, or ``1f1b`` for a profile measured in fp16 (whose
    loss scale needs a schedule that flushes)."""
    microbatches: int | None = None
    """Microbatches per minibatch; None picks the default (see ``search``)."""
    straight: bool = False
    """One replica per stage."""
    memory: float | None = None
    """Bytes per worker; overrides the topology's ``memory``; None: no memory limit."""
    cost_model: str = DEFAULT_COST_MODEL
    """One of :data:`pipedream.optimizer.cost_model.COST_MODELS`."""
    use_fewer_workers: bool = False
    """Allow a plan with fewer workers than the cluster has when it is no slower (the
    original's ``--use_fewer_machines``); off, every worker is used, as in the original."""
    virtual_stages: int | None = None
    """Stages per worker for ``interleaved-1f1b`` (None: the fastest of
    :data:`~pipedream.optimizer.placed.VIRTUAL_STAGES_TRIED`; ``auto`` tries 2)."""
    search: bool = True
    """Search beside the simulated plan by simulation (:mod:`~pipedream.optimizer.refine`);
    off (``--no-search``), the fastest simulated of the dynamic program's plan, the best
    straight pipeline and data parallelism stands."""
    recompute: bool = False
    """Plan a run that recomputes activations in backward (``--recompute``): each backward
    runs its forward again, and a stage keeps only its inputs per microbatch in flight."""


@dataclass(frozen=True)
class PlanResult:
    """A plan with what produced it (for the summary, the comparison and the tests)."""

    plan: Plan
    """The plan, prediction filled."""
    tree: Tree
    """The hierarchical partition behind it."""
    cluster: Cluster
    """The levels planned on and the cost model."""
    evaluation: TreeEvaluation
    """Per-stage times and memory."""
    candidates: tuple[Outcome, ...] = ()
    """With ``auto``: every schedule and number of microbatches tried, best first."""
    refined: Refined | None = None
    """The local search by simulation around the simulated candidates, where it ran."""
    not_compared: str = ""
    """With ``auto``: the schedules (or microbatch counts) it left out and why, e.g.
    ``pipedream, pipedream-vs (one microbatch per minibatch, not 4)``; "" when none."""


def _check_options(options: PlanOptions) -> None:
    if options.schedule not in (*SCHEDULES, AUTO):
        raise PlanningError(
            f"unknown schedule {options.schedule!r}; use one of {', '.join(SCHEDULES)} or auto"
        )
    if options.virtual_stages is not None and options.schedule not in (
        "interleaved-1f1b",
        "zbv",
        AUTO,
    ):
        raise PlanningError(
            f"--virtual-stages {options.virtual_stages} with schedule {options.schedule!r}: "
            "only interleaved-1f1b (and zbv, always 2) run several stages per worker"
        )
    if options.cost_model not in COST_MODELS:
        raise PlanningError(
            f"unknown cost model {options.cost_model!r}; use one of {', '.join(COST_MODELS)}"
        )
    m = options.microbatches
    if m is not None and m < 1:
        raise PlanningError(f"--microbatches {m}: must be at least 1")
    if m is not None and m > MAX_MICROBATCHES:
        raise PlanningError(
            f"--microbatches {m}: at most {MAX_MICROBATCHES} supported; use fewer, larger "
            "microbatches (profile with a larger --microbatch-size)"
        )
    one_microbatch = options.schedule != AUTO and SCHEDULES[options.schedule].one_microbatch
    if m is not None and m != 1 and one_microbatch:
        raise PlanningError(
            f"--microbatches {m} with schedule {options.schedule!r}: PipeDream updates after "
            "every microbatch, so it must be 1; use --schedule 2bw to accumulate gradients"
        )
    if options.memory is not None and options.memory <= 0:
        raise PlanningError(f"--memory {options.memory:g}: must be a positive number of bytes")


def plan_profile(profile: Profile, *, topology: Topology, options: PlanOptions) -> PlanResult:
    """Plan ``profile`` on ``topology``: see the module docstring."""
    if options.schedule == DEFAULT_SCHEDULE:
        options = replace(options, schedule=default_schedule(profile))
    _check_options(options)
    costs = LayerCosts.from_profile(profile, recompute=options.recompute)
    request = Request(
        costs=costs,
        topology=topology,
        cost_model=options.cost_model,
        straight=options.straight,
        use_fewer_workers=options.use_fewer_workers,
        memory_limit=options.memory if options.memory is not None else topology.memory,
    )
    candidates: tuple[Outcome, ...] = ()
    simulated_auto = False
    refined = None
    not_compared = ""
    if options.schedule in PLACED:
        search = placed_search(
            profile,
            topology,
            schedule=options.schedule,
            microbatches=options.microbatches,
            virtual_stages=options.virtual_stages,
            memory_limit=request.memory_limit,
            cost_model=options.cost_model,
            straight=options.straight,
            recompute=options.recompute,
        )
        placed = search.plan
        if placed is None:
            raise PlanningError(search.problem)
        return PlanResult(placed.plan, placed.tree, placed.cluster, placed.evaluation)
    if options.schedule == AUTO:
        found = solve_auto(request, microbatches=options.microbatches)
        if profile.precision in SCALES_LOSS:  # fp16's loss scale: flush, equal replicas
            found = _fp16_outcomes(found, request, microbatches=options.microbatches)
        placed_found, skipped = _placed_outcomes(profile, topology, options, request.memory_limit)
        checked = _simulated_outcomes(
            found, profile, topology, force=bool(placed_found), recompute=options.recompute
        )
        simulated_auto = checked is not found
        if not simulated_auto:
            checked = _one_stage_outcomes(checked, profile)
        dropped = not simulated_auto and bool(placed_found)
        if dropped:  # too big to simulate: the closed forms alone compare
            placed_found = []
        not_compared = _not_compared(options, topology.num_workers, skipped, placed_dropped=dropped)
        candidates = tuple(rank_outcomes(checked + placed_found))
        outcome = candidates[0]
        if outcome.placed is not None:
            chosen = outcome.placed
            return PlanResult(
                chosen.plan,
                chosen.tree,
                chosen.cluster,
                chosen.evaluation,
                candidates,
                not_compared=not_compared,
            )
    else:
        outcome = solve_schedule(
            request, schedule=options.schedule, microbatches=options.microbatches
        )
    if outcome.tree is None:
        raise PlanningError(outcome.problem)
    plan, evaluation = build_plan(
        profile,
        tree=outcome.tree,
        cluster=outcome.cluster,
        schedule=outcome.schedule,
        recompute=options.recompute,
    )
    tree = outcome.tree
    if simulated_auto and not needs_simulation(plan):  # chosen by its simulated time
        assert plan.prediction is not None
        time_ms = outcome.time_per_minibatch_ms
        prediction = replace(
            plan.prediction,
            time_per_minibatch_ms=time_ms,
            throughput_samples_per_s=profile.microbatch_size * plan.microbatches * 1e3 / time_ms,
            data_parallel_time_per_minibatch_ms=data_parallel_time_ms(
                profile, outcome.cluster, outcome.schedule
            ),
            method="simulated",
        )
        plan = replace(plan, prediction=prediction)
    elif needs_simulation(plan):
        best = _fastest_simulated(profile, topology, request, outcome, search=options.search)
        if best is not None:
            plan, evaluation, tree, refined = best
            assert plan.prediction is not None
            if candidates:  # the chosen row shows what was chosen
                chosen = replace(
                    outcome, tree=tree, time_per_minibatch_ms=plan.prediction.time_per_minibatch_ms
                )
                candidates = (chosen, *candidates[1:])
    if profile.precision in SCALES_LOSS:
        _check_fp16(plan)
    return PlanResult(
        plan, tree, outcome.cluster, evaluation, candidates, refined, not_compared=not_compared
    )


def _fp16_outcomes(
    found: list[Outcome], request: Request, *, microbatches: int | None
) -> list[Outcome]:
    """``auto``'s outcomes that can train in fp16; where one of a schedule and number of
    microbatches cannot (stages replicated unequally), the best straight pipeline (one
    replica per stage) of the same in its place."""
    fits = [o for o in found if _fp16_fits(o)]
    if request.straight:
        return fits
    have = {(o.schedule, o.microbatches) for o in fits}
    straight = solve_auto(replace(request, straight=True), microbatches=microbatches)
    return fits + [
        o for o in straight if (o.schedule, o.microbatches) not in have and _fp16_fits(o)
    ]


def _fp16_fits(outcome: Outcome) -> bool:
    """Whether ``auto``'s ``outcome`` can train in fp16 (a schedule that flushes and the same
    replicas at every stage, or one stage); one that failed stays, for its reason."""
    if outcome.tree is None:
        return True
    ranks = leaf_ranks(outcome.tree, cluster=outcome.cluster)
    if len(ranks) == 1:
        return True
    return not lookup(outcome.schedule).asynchronous and len({len(r) for r in ranks}) == 1


def _check_fp16(plan: Plan) -> None:
    """A pipeline of several stages trains in fp16 only under a schedule that flushes, with
    the same replicas at every stage (:func:`global_norm_problem`)."""
    problem = global_norm_problem(spec_from_plan(plan, 0, plan.steps_multiple, global_norm=True))
    if problem:
        raise PlanningError(
            "the profile was measured in fp16, whose loss scale skips an update that "
            f"overflowed on every stage at once: {problem}; or profile in bf16"
        )


def _per_copy(options: PlanOptions, workers: int) -> list[int]:
    """The workers of one copy of the pipeline, for every number of copies tried."""
    counts = [1] if options.straight else copy_counts(workers)
    return [workers // copies for copies in counts]


def _placed_outcomes(
    profile: Profile, topology: Topology, options: PlanOptions, memory_limit: float | None
) -> tuple[list[Outcome], list[int]]:
    """``--schedule auto``'s candidates among the schedules that run several stages per
    worker: each for every number of microbatches tried (interleaved-1f1b with 2 stages per
    worker unless ``--virtual-stages`` says otherwise), simulated; and the numbers of
    microbatches interleaved-1f1b was not tried with (not a multiple of a copy's workers)."""
    workers = topology.num_workers
    out = []
    skipped = []
    for schedule in PLACED:
        for m in (options.microbatches,) if options.microbatches else AUTO_MICROBATCHES:
            if schedule == "interleaved-1f1b" and all(m % p for p in _per_copy(options, workers)):
                skipped.append(m)  # it needs a multiple of a copy's workers
                continue
            per_worker = options.virtual_stages or 2
            try:
                search = placed_search(
                    profile,
                    topology,
                    schedule=schedule,
                    microbatches=m,
                    virtual_stages=per_worker if schedule == "interleaved-1f1b" else None,
                    memory_limit=memory_limit,
                    cost_model=options.cost_model,
                    straight=options.straight,
                    recompute=options.recompute,
                )
                best, problem = search.plan, search.problem
                memory = search.leanest_bytes is not None
            except PlanningError as error:
                best, problem, memory = None, str(error), False
            cluster = Cluster.from_topology(topology, cost_model=options.cost_model, microbatches=m)
            if best is None:
                causes = (
                    (memory_cause(memory_limit),) if memory and memory_limit is not None else ()
                )
                out.append(Outcome(schedule, m, cluster, None, math.inf, problem, causes=causes))
                continue
            assert best.plan.prediction is not None
            time_ms = best.plan.prediction.time_per_minibatch_ms
            out.append(Outcome(schedule, m, best.cluster, best.tree, time_ms, placed=best))
    return out, skipped


def _not_compared(
    options: PlanOptions, workers: int, skipped: list[int], *, placed_dropped: bool
) -> str:
    """``--schedule auto``'s schedules (or microbatch counts) left out of the comparison and
    why, in one line ("" when none): the one-microbatch schedules under ``--microbatches``
    above 1, interleaved-1f1b where the microbatches are not a multiple of a copy's workers
    (``skipped``), and the schedules that run several stages per worker where the others'
    plans are too big to simulate (``placed_dropped``: they are compared only by simulation)."""
    parts = []
    m = options.microbatches
    if m is not None and m != 1:
        names = [name for name, record in SCHEDULES.items() if record.one_microbatch]
        parts.append(f"{', '.join(names)} (one microbatch per minibatch, not {m})")
    if placed_dropped:
        parts.append(
            f"{', '.join(PLACED)} (compared only by simulation, and the other plans are too "
            "big to simulate)"
        )
    elif skipped:
        tried = (m,) if m else AUTO_MICROBATCHES
        at = (
            "" if len(skipped) == len(tried) else f" at {', '.join(map(str, skipped))} microbatches"
        )
        sizes = " or ".join(map(str, sorted(set(_per_copy(options, workers)))))
        parts.append(
            f"interleaved-1f1b{at} (microbatches not a multiple of a pipeline copy's workers, "
            f"{sizes})"
        )
    return "; ".join(parts)


def _simulated_outcomes(
    outcomes: list[Outcome],
    profile: Profile,
    topology: Topology,
    *,
    force: bool = False,
    recompute: bool = False,
) -> list[Outcome]:
    """``--schedule auto``'s candidates, all with simulated times when one of them needs
    simulation (or ``force``: the placed schedules' candidates are simulated) so that every
    candidate is charged the same costs (updates, the runtime's cost per action, weight
    copies), else as they are; also as they are when one is too big."""
    plans = {
        id(outcome): build_plan(
            profile,
            tree=outcome.tree,
            cluster=outcome.cluster,
            schedule=outcome.schedule,
            recompute=recompute,
        )[0]
        for outcome in outcomes
        if outcome.tree is not None
    }
    if not force and not any(needs_simulation(plan) for plan in plans.values()):
        return outcomes
    out = []
    for outcome in outcomes:
        if outcome.tree is None:
            out.append(outcome)
            continue
        simulated = simulated_ms(plans[id(outcome)], profile, topology)
        if simulated is None:
            return outcomes
        out.append(replace(outcome, time_per_minibatch_ms=simulated))
    return out


def _one_stage_outcomes(outcomes: list[Outcome], profile: Profile) -> list[Outcome]:
    """``--schedule auto``'s candidates where none was simulated: with their plans' exact
    times where every one is a single stage (what a simulation would say,
    :func:`~pipedream.optimizer.verify.one_stage_ms`: the updates and the runtime's costs
    per action, which favour more microbatches per update), else as they are (the formula,
    alike for all)."""
    if any(outcome.tree is not None and _num_stages(outcome.tree) > 1 for outcome in outcomes):
        return outcomes
    out = []
    for outcome in outcomes:
        if outcome.tree is not None:
            plan, _ = build_plan(
                profile, tree=outcome.tree, cluster=outcome.cluster, schedule=outcome.schedule
            )
            assert plan.prediction is not None and plan.num_stages == 1
            outcome = replace(outcome, time_per_minibatch_ms=plan.prediction.time_per_minibatch_ms)
        out.append(outcome)
    return out


def _num_stages(tree: Tree) -> int:
    """Stages of the flattened plan of ``tree``."""
    return sum(_num_stages(node.inner) if node.inner else 1 for node in tree)


def _fastest_simulated(
    profile: Profile, topology: Topology, request: Request, outcome: Outcome, *, search: bool
) -> tuple[Plan, TreeEvaluation, Tree, Refined | None] | None:
    """The fastest of the DP's plan, the best straight pipeline and data parallelism (same
    schedule and ``m``), all simulated (``verify``), then of the plans a local search by
    simulation finds beside it (:func:`_refine`), with the simulated time of data
    parallelism for the summary's line (also where it does not fit or may not be chosen);
    None when one is too big to simulate or none fits (the formula stands)."""
    assert outcome.tree is not None
    trees = [outcome.tree]
    straight = solve_schedule(
        replace(request, straight=True),
        schedule=outcome.schedule,
        microbatches=outcome.microbatches,
    )
    if straight.tree is not None and straight.microbatches == outcome.microbatches:
        trees.append(straight.tree)
    data_parallel = data_parallel_tree(outcome.cluster, len(profile.layers))
    may_replicate = lookup(outcome.schedule).replicates and not request.straight
    found: list[tuple[float, Plan, TreeEvaluation, Tree]] = []
    data_parallel_ms = None
    for tree in [*trees, data_parallel]:
        plan, evaluation = build_plan(
            profile,
            tree=tree,
            cluster=outcome.cluster,
            schedule=outcome.schedule,
            recompute=request.costs.recompute,
        )
        simulated = simulated_ms(plan, profile, topology)  # all alike: the same costs
        if simulated is None:
            return None
        if tree is data_parallel:
            data_parallel_ms = simulated
            if not may_replicate:
                continue
        if not _fits(evaluation, request.memory_limit):
            continue  # data parallelism may not fit
        found.append((simulated, plan, evaluation, tree))
    if not found:
        return None
    time_ms, plan, evaluation, tree = min(found, key=lambda item: item[0])
    refined = _refine(profile, topology, request, outcome, tree, time_ms, search=search)
    if refined is not None and refined.tree != tree:
        found_plan, found_evaluation = build_plan(
            profile,
            tree=refined.tree,
            cluster=outcome.cluster,
            schedule=outcome.schedule,
            recompute=request.costs.recompute,
        )
        # the search's runs may stop short of a steady state; the prediction's may not, and
        # has the last word
        found_ms = simulated_ms(found_plan, profile, topology)
        if found_ms is not None and found_ms < time_ms:
            plan, evaluation, tree, time_ms = found_plan, found_evaluation, refined.tree, found_ms
        refined = replace(refined, tree=tree, time_ms=time_ms)
    assert plan.prediction is not None and data_parallel_ms is not None
    prediction = replace(
        plan.prediction,
        time_per_minibatch_ms=time_ms,
        throughput_samples_per_s=profile.microbatch_size * plan.microbatches * 1e3 / time_ms,
        data_parallel_time_per_minibatch_ms=data_parallel_ms,
        method="simulated",
    )
    return replace(plan, prediction=prediction), evaluation, tree, refined


def _fits(evaluation: TreeEvaluation, memory_limit: float | None) -> bool:
    """Whether every worker's estimated memory is within the limit (None: no limit)."""
    worst = max(leaf.memory_bytes for leaf in evaluation.leaves)
    return memory_limit is None or worst <= memory_limit


def _refine(
    profile: Profile,
    topology: Topology,
    request: Request,
    outcome: Outcome,
    start: Tree,
    start_ms: float,
    *,
    search: bool,
) -> Refined | None:
    """The local search by simulation (:mod:`~pipedream.optimizer.refine`) from ``start``,
    under the plan's schedule, ``m``, memory limit and options; None where it does not run:
    ``--no-search``, or the original optimizer's arithmetic (``--cost-model pipedream``),
    which the planner reproduces rather than improves on."""
    cluster = outcome.cluster
    if not search or request.cost_model == "pipedream":
        return None
    record = lookup(outcome.schedule)
    m = outcome.microbatches
    moves = Moves(
        num_workers=cluster.workers[0],
        replicate=record.replicates and not request.straight,
        fewer_workers=request.use_fewer_workers,
        max_stages=m if record.microbatches_at_least_stages else None,
    )

    built: dict[Tree, tuple[Plan, TreeEvaluation]] = {}

    def plan_of(tree: Tree) -> tuple[Plan, TreeEvaluation]:
        if tree not in built:
            built[tree] = build_plan(
                profile,
                tree=tree,
                cluster=cluster,
                schedule=outcome.schedule,
                recompute=request.costs.recompute,
            )
        return built[tree]

    def simulate(tree: Tree) -> tuple[float | None, int]:
        plan, evaluation = plan_of(tree)
        if not _fits(evaluation, request.memory_limit):
            return None, 0
        run = simulated_run(plan, profile, topology, max_doublings=REFINE_DOUBLINGS)
        return steady_ms(run), simulation_work(run, plan)

    def bound(tree: Tree) -> float:
        return lower_bound_ms(plan_of(tree)[0], profile, topology)

    return refine(
        start,
        start_ms,
        simulate=simulate,
        moves=moves,
        layer_ms=request.costs.compute_ms,
        budget=REFINE_BUDGET,
        bound=bound,
        slack=BOUND_SLACK,
    )


def make_plan(profile: Profile, *, topology: Topology, options: PlanOptions) -> Plan:
    """The plan of :func:`plan_profile`."""
    return plan_profile(profile, topology=topology, options=options).plan


def build_plan(
    profile: Profile, *, tree: Tree, cluster: Cluster, schedule: str, recompute: bool = False
) -> tuple[Plan, TreeEvaluation]:
    """The Plan of ``tree`` with its ranks and a filled ``prediction``; ``recompute``: a plan
    that recomputes activations in backward (its times and memory)."""
    costs = LayerCosts.from_profile(profile, recompute=recompute)
    m = cluster.microbatches
    memory = MemoryModel(schedule, m)
    evaluation = evaluate_tree(costs, tree, cluster=cluster, memory=memory)
    leaves = evaluation.leaves
    time_ms = minibatch_ms(
        schedule, evaluation.microbatch_ms, microbatches=m, num_stages=len(leaves)
    )
    if time_ms <= 0:
        raise PlanningError(
            f"the profile of {profile.workload} predicts 0 ms per minibatch (every layer time "
            "and size is zero); profile the workload again"
        )
    names = profile.layer_names
    ranks = leaf_ranks(tree, cluster=cluster)
    stages = tuple(
        StagePlan(names[leaf.first], names[leaf.last], leaf.replicas, leaf_ranks_)
        for leaf, leaf_ranks_ in zip(leaves, ranks)
    )
    plan = Plan(
        workload=profile.workload,
        schedule=schedule,
        microbatch_size=profile.microbatch_size,
        microbatches=m,
        world_size=sum(len(r) for r in ranks),
        stages=stages,
        workload_args=dict(profile.workload_args),
        layers=tuple(names),
        recompute=recompute,
        precision=profile.precision,
    )
    if len(leaves) == 1:  # exact: what the simulation charges, and so the data parallel line
        time_ms = one_stage_ms(plan, profile, cluster_network(cluster))
        data_parallel_ms = data_parallel_time_ms(profile, cluster, schedule, recompute=recompute)
    else:  # a pipeline's formula, and data parallelism's by the same arithmetic
        data_parallel = evaluate_tree(
            costs, data_parallel_tree(cluster, costs.num_layers), cluster=cluster
        )
        data_parallel_ms = data_parallel.microbatch_ms * m
    prediction = Prediction(
        time_per_minibatch_ms=time_ms,
        throughput_samples_per_s=profile.microbatch_size * m * 1e3 / time_ms,
        bottleneck=evaluation.bottleneck,
        stage_ms=tuple(leaf.time_ms for leaf in leaves),
        memory_bytes=tuple(leaf.memory_bytes for leaf in leaves),
        data_parallel_time_per_minibatch_ms=data_parallel_ms,
        cost_model=cluster.cost_model,
    )
    plan = replace(plan, prediction=prediction)
    if lookup(schedule).splits_backward:  # the tables say what the closed form bounds
        memory_of = worker_memory(plan, costs, [(leaf.first, leaf.last) for leaf in leaves])
        exact = tuple(memory_of[stage.ranks[0]] for stage in stages)
        evaluation = TreeEvaluation(
            tuple(replace(leaf, memory_bytes=b) for leaf, b in zip(leaves, exact))
        )
        plan = replace(plan, prediction=replace(prediction, memory_bytes=exact))
    return plan, evaluation
