"""Solving for one schedule, and ``--schedule auto``: which schedule and how many microbatches.

The schedule changes what the dynamic program minimises and what fits in memory:

* ``pipedream``/``pipedream-vs``: one microbatch per minibatch, the slowest stage's time;
  weight stashing keeps one version per minibatch in flight (memory);
* ``2bw``: ``m`` microbatches per minibatch (the allreduce is shared by them), two weight
  versions, and at most ``m`` stages (solved per stage count when ``m`` is given);
* ``1f1b``/``gpipe``: ``m`` microbatches and a flush, ``(m + S - 1)`` slots per minibatch, so
  the number of stages ``S`` is chosen too (solved per stage count); 1F1B keeps at most
  ``min(S - s, m)`` microbatches of activations, GPipe all ``m``.

Default ``m`` (no ``--microbatches``) for 2bw, 1f1b and gpipe is ``max(4, S)``: solve with 4,
and if the answer has more stages, solve again with ``m = S`` (a larger ``m`` only shares the
allreduce more), keeping ``m >= S`` in the end.

``auto`` solves pipedream, pipedream-vs (``m = 1``) and 2bw, 1f1b, gpipe, zb-h1 for every ``m``
in ``--microbatches`` if given, else :data:`AUTO_MICROBATCHES` (the planner adds
interleaved-1f1b and zbv, :mod:`~pipedream.optimizer.placed`), and keeps the highest predicted
throughput (samples per second) that fits; ties go to the schedules' ``auto_rank``
(:data:`AUTO_ORDER`: synchronous semantics first), then to fewer microbatches. Larger
minibatches amortise the flush and the allreduce, so ``auto`` tends to the largest ``m`` that
fits: pin the minibatch with ``--microbatches``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipedream.errors import PlanningError
from pipedream.formats.topology import Topology
from pipedream.formats.units import format_bytes
from pipedream.optimizer.cost_model import LayerCosts, minibatch_ms
from pipedream.optimizer.hierarchy import Solution, solve_cluster
from pipedream.optimizer.memory import MemoryModel
from pipedream.optimizer.placed import PlacedPlan
from pipedream.optimizer.tree import Cluster, Tree, evaluate_tree
from pipedream.schedules import (
    SCHEDULES,
    lookup,
)

__all__ = [
    "AUTO_MICROBATCHES",
    "AUTO_ORDER",
    "DEFAULT_SYNC_MICROBATCHES",
    "Cause",
    "Outcome",
    "Request",
    "memory_cause",
    "none_feasible",
    "rank_outcomes",
    "solve_auto",
    "solve_schedule",
]

DEFAULT_SYNC_MICROBATCHES = 4
"""Smallest default number of microbatches for 2bw, 1f1b and gpipe."""
AUTO_MICROBATCHES = (2, 4, 8, 16, 32)
"""Microbatches per minibatch that ``--schedule auto`` tries for 2bw, 1f1b and gpipe."""
AUTO_ORDER = tuple(sorted(SCHEDULES, key=lambda name: SCHEDULES[name].auto_rank))
"""Preference among equally fast schedules: exact (synchronous) semantics first."""


@dataclass(frozen=True)
class Request:
    """What to solve: the cluster and the search options besides the schedule."""

    costs: LayerCosts
    """Per-layer costs."""
    topology: Topology
    """The cluster."""
    cost_model: str
    """Cost model variant."""
    straight: bool = False
    """One replica per stage."""
    use_fewer_workers: bool = False
    """Allow idle workers when that is no slower."""
    memory_limit: float | None = None
    """Bytes per worker, or None."""
    solved: dict[tuple[object, ...], dict[int, Solution]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    """The dynamic program's answers so far (:func:`_solve`): schedules that pose the same
    problem share one (a request made with ``dataclasses.replace`` starts without)."""


@dataclass(frozen=True)
class Cause:
    """One reason a schedule has no plan, worded without the schedule and the microbatches, so
    that ``--schedule auto`` names it once for all the schedules it rules out."""

    text: str
    """What rules the plans out, e.g. ``no plan fits in 1.0 KiB per worker``."""
    fix: str
    """What to change, e.g. ``raise --memory or add workers``."""


def memory_cause(limit: float) -> Cause:
    """The cause of a schedule none of whose plans fits in ``limit`` bytes per worker."""
    return Cause(
        f"no plan fits in {format_bytes(limit)} per worker", "raise --memory or add workers"
    )


@dataclass(frozen=True)
class Outcome:
    """The best plan for one schedule and number of microbatches (or why there is none)."""

    schedule: str
    """Schedule name."""
    microbatches: int
    """Microbatches per minibatch."""
    cluster: Cluster
    """The levels planned on, with ``microbatches``."""
    tree: Tree | None
    """The partition; None when nothing is feasible."""
    time_per_minibatch_ms: float
    """Predicted time per minibatch (``inf`` when infeasible)."""
    problem: str = ""
    """Why nothing is feasible (a sentence with the fix)."""
    placed: PlacedPlan | None = None
    """A schedule that runs several stages per rank: its finished plan
    (:mod:`~pipedream.optimizer.placed`; the dynamic program does not plan these)."""
    causes: tuple[Cause, ...] = ()
    """What ``problem`` says, one :class:`Cause` per reason (empty: ``problem``'s first
    clause is the reason, the rest the fix)."""

    @property
    def reasons(self) -> tuple[Cause, ...]:
        """The causes of an infeasible outcome (:attr:`causes`, or taken from ``problem``)."""
        if self.causes:
            return self.causes
        text, _, fix = self.problem.partition(";")
        return (Cause(text.strip(), fix.strip()),)

    @property
    def microbatches_per_ms(self) -> float:
        """Microbatches per millisecond: throughput up to the microbatch size."""
        return self.microbatches / self.time_per_minibatch_ms


def _solve(
    request: Request, schedule: str, m: int, counted: bool, *, limited: bool = True
) -> dict[int, Solution]:
    """The dynamic program's best partitions (per stage count if ``counted``). The schedule
    enters only through the memory estimate, with a limit, and whether it replicates stages:
    without a limit, ``--schedule auto``'s schedules of one ``m`` share their answer.
    ``limited`` False: ignoring the memory limit (why nothing fits, :func:`_why_infeasible`)."""
    straight = request.straight or not lookup(schedule).replicates
    limit = request.memory_limit if limited else None
    key = (m, counted, straight, None if limit is None else schedule)
    if key not in request.solved:
        cluster = Cluster.from_topology(
            request.topology, cost_model=request.cost_model, microbatches=m
        )
        request.solved[key] = solve_cluster(
            request.costs,
            cluster,
            straight=straight,
            use_fewer_workers=request.use_fewer_workers,
            memory=MemoryModel(schedule, m),
            memory_limit=limit,
            by_stage_count=counted,
        )
    return request.solved[key]


def _pick(schedule: str, m: int, found: dict[int, Solution]) -> Solution | None:
    """The best solution for ``schedule`` among per-count (or overall) solutions."""
    capped = lookup(schedule).microbatches_at_least_stages
    options = [s for count, s in found.items() if not (capped and count and count > m)]
    if not options:
        return None
    return min(
        options,
        key=lambda s: (
            minibatch_ms(schedule, s.time_ms, microbatches=m, num_stages=s.num_stages),
            s.num_stages,
        ),
    )


def solve_schedule(request: Request, *, schedule: str, microbatches: int | None) -> Outcome:
    """The best plan for ``schedule`` (``microbatches`` None: the default of the docstring)."""
    record = lookup(schedule)
    counted = record.flushes or (record.microbatches_at_least_stages and microbatches is not None)
    m = microbatches or (1 if record.one_microbatch else DEFAULT_SYNC_MICROBATCHES)

    best = _pick(schedule, m, _solve(request, schedule, m, counted))
    if microbatches is None and not record.one_microbatch:
        for _ in range(3):
            if best is None or best.num_stages <= m:
                break
            m = best.num_stages
            best = _pick(schedule, m, _solve(request, schedule, m, counted))
        if best is not None and best.num_stages > m:  # did not settle: keep it, raise m
            m = best.num_stages
    cluster = Cluster.from_topology(request.topology, cost_model=request.cost_model, microbatches=m)
    if best is None:
        problem, causes = _why_infeasible(request, schedule, m, counted)
        return Outcome(schedule, m, cluster, None, math.inf, problem, causes=causes)
    # the tree's value under the final m (raising m only shares the allreduce more)
    evaluation = evaluate_tree(request.costs, best.tree, cluster=cluster)
    time_ms = minibatch_ms(
        schedule,
        evaluation.microbatch_ms,
        microbatches=m,
        num_stages=len(evaluation.leaves),
    )
    return Outcome(schedule, m, cluster, best.tree, time_ms)


def _why_infeasible(
    request: Request, schedule: str, m: int, counted: bool
) -> tuple[str, tuple[Cause, ...]]:
    """Why ``schedule`` at ``m`` microbatches has no plan: a sentence with the fix, and its
    causes. What rules the plans out is checked, not assumed: the layers (too few for one
    stage per worker), the microbatches (``2bw``: every plan has more stages than ``m``), the
    memory limit, or the microbatches and the memory together."""
    n, workers = request.costs.num_layers, request.topology.num_workers
    if not lookup(schedule).replicates and workers > n and not request.use_fewer_workers:
        fix = f"use --workers {n} or fewer"
        return (
            f"schedule {schedule} does not replicate stages, so {workers} workers need at least "
            f"{workers} layers, but the profile has {n}; {fix}",
            (Cause(f"{workers} workers need at least {workers} layers, the profile has {n}", fix),),
        )
    if request.straight and workers > n and not request.use_fewer_workers:
        fix = f"use --workers {n} or fewer, or drop --straight to replicate stages"
        return (
            f"--straight with {workers} workers needs at least {workers} layers, but the "
            f"profile has {n}; {fix}",
            (Cause(f"--straight with {workers} workers needs at least {workers} layers", fix),),
        )
    record = lookup(schedule)
    limit = request.memory_limit
    fitting = _solve(request, schedule, m, counted)  # under the limit, every stage count
    if record.microbatches_at_least_stages:
        unlimited = _solve(request, schedule, m, counted, limited=False)
        # memory aside, no plan has at most m stages: the microbatches rule every plan out
        if _pick(schedule, m, unlimited) is None:
            fewest = min(unlimited, default=m + 1)
            need = f"use --microbatches {fewest} or more"
            too_few = Cause("every plan has more stages than microbatches", need)
            head = (
                f"--microbatches {m} with schedule {schedule}: every plan has at least "
                f"{fewest} stages and {schedule} needs at least one microbatch per stage"
            )
            if fitting or limit is None:
                return f"{head}; {need}", (too_few,)
            # and no plan of any number of stages fits either
            memory = memory_cause(limit)
            return (
                f"{head}, and none fits in {format_bytes(limit)} per worker (estimated memory); "
                f"{need}, and {memory.fix}",
                (too_few, memory),
            )
        if fitting:  # the plans of at most m stages do not fit, the ones that fit have more
            assert limit is not None
            fewest = min(fitting)
            need = f"use --microbatches {fewest} or more, or raise --memory"
            few = Cause(
                f"the plans with no more stages than microbatches do not fit in "
                f"{format_bytes(limit)} per worker",
                need,
            )
            return (
                f"--microbatches {m} with schedule {schedule}: the plans of at most {m} "
                f"stage{'s' if m > 1 else ''} "
                f"({schedule} needs at least one microbatch per stage) do not fit in "
                f"{format_bytes(limit)} per worker (estimated memory), and those that fit have "
                f"{fewest} or more; {need}",
                (few,),
            )
    assert limit is not None and not fitting
    memory = memory_cause(limit)
    fixes = memory.fix
    if record.versions_kept is None:
        fixes += ", or use a schedule that keeps fewer weight versions (2bw, 1f1b)"
    return (
        f"no partition of {n} layers over {workers} workers fits in "
        f"{format_bytes(limit)} per worker (schedule {schedule}, estimated "
        f"memory); {fixes}",
        (memory,),
    )


def solve_auto(request: Request, *, microbatches: int | None) -> list[Outcome]:
    """Every candidate of ``--schedule auto`` the dynamic program plans (unsorted:
    :func:`rank_outcomes` orders them)."""
    outcomes = []
    for schedule in AUTO_ORDER:
        if lookup(schedule).several_stages_per_rank:
            continue  # planned apart (placed_outcomes)
        if lookup(schedule).one_microbatch:
            if microbatches in (None, 1):
                outcomes.append(solve_schedule(request, schedule=schedule, microbatches=1))
            continue
        for m in (microbatches,) if microbatches else AUTO_MICROBATCHES:
            outcomes.append(solve_schedule(request, schedule=schedule, microbatches=m))
    return outcomes


def rank_outcomes(outcomes: list[Outcome]) -> list[Outcome]:
    """Fastest first (samples per second), ties by :data:`AUTO_ORDER` then fewer microbatches;
    raises when none is feasible."""

    def rank(outcome: Outcome) -> tuple[float, int, int]:
        speed = 0.0 if outcome.tree is None else outcome.microbatches_per_ms
        return (-float(f"{speed:.9g}"), AUTO_ORDER.index(outcome.schedule), outcome.microbatches)

    outcomes = sorted(outcomes, key=rank)
    if outcomes[0].tree is None:
        raise PlanningError(none_feasible(outcomes))
    return outcomes


def none_feasible(outcomes: list[Outcome]) -> str:
    """``--schedule auto``'s one line when no candidate has a plan: each distinct cause once,
    with the schedules it rules out (and their microbatch counts where it rules out only some
    of those tried), then each distinct fix once (of a cause that rules out some schedule at
    every count tried: the other counts of the others failed for a cause of their own)."""
    tried: dict[str, set[int]] = {}
    for outcome in outcomes:
        tried.setdefault(outcome.schedule, set()).add(outcome.microbatches)
    # cause -> schedule -> (the microbatch counts it rules out, their fixes)
    ruled_out: dict[str, dict[str, tuple[set[int], dict[str, None]]]] = {}
    for outcome in outcomes:
        for cause in outcome.reasons:
            counts, fixes_of = ruled_out.setdefault(cause.text, {}).setdefault(
                outcome.schedule, (set(), {})
            )
            counts.add(outcome.microbatches)
            if cause.fix:
                fixes_of.setdefault(cause.fix)
    groups = []
    fixes: dict[str, None] = {}  # an ordered set
    for text, by_schedule in ruled_out.items():
        names = []
        for name, (counts, fixes_of) in by_schedule.items():
            if counts == tried[name]:
                names.append(name)
                fixes.update(fixes_of)
            else:
                names.append(f"{name} at {', '.join(map(str, sorted(counts)))} microbatches")
        groups.append(f"{text} ({', '.join(names)})")
    reasons = "; ".join(groups)
    return "; ".join([f"--schedule auto: no schedule has a feasible plan: {reasons}", *fixes])
