"""Plans for the schedules that run several stages on every rank: ``interleaved-1f1b``, ``zbv``.

The dynamic program gives every stage its own workers. These schedules instead cut the model
into ``S = v P`` stages for ``P`` workers and put ``v`` of them on every worker: interleaved
1F1B loops (stage ``s`` on rank ``s mod P``, ``v`` chosen), the V of zero-bubble V goes down
the ranks and back (``v = 2``). A plan for them is found in four steps:

1. the cluster runs ``r`` copies of the pipeline (every ``r`` that leaves at least 2 workers
   per copy is tried; copy ``j`` on workers ``j P .. j P + P - 1``, minibatch ``t`` on copy
   ``t mod r``, the copies averaging their gradients before every update), and every worker of
   a copy runs ``v`` stages;
2. the layers are cut into ``S`` contiguous stages so that the slowest stage (its forward +
   backward, or its transfers where they take longer, as the cost model counts a stage) is as
   fast as it can be (:func:`balanced_spans`);
3. the schedule's placement puts each stage on its rank, and the time per minibatch is the
   simulation of the very tables the runtime runs (profiled costs, the topology's bandwidths,
   the runtime's cost per action): the formulas' bubbles assume equal stages and free
   messages, and the V's and the interleaving's messages are not free;
4. memory per worker comes from those tables too (:mod:`~pipedream.optimizer.table_memory`).

The fastest per microbatch is kept. The candidates are simulated in the order of a lower
bound on their time (:mod:`~pipedream.optimizer.bounds`: a worker's compute, a link's or an
interface's transfers), and those whose bound the fastest so far beats are not simulated at
all: on the original ResNet-50 profile, 16 workers at 1 GB/s, interleaved-1f1b with 32
microbatches simulates 1 of its 24 candidates. Microbatches per minibatch: given, or by
default the smallest multiple of ``P`` that is at least ``max(4, 2 P)`` (interleaved needs a
multiple of ``P``; both need about ``2 P`` to fill the pipeline). ``interleaved-1f1b``
without ``--virtual-stages`` tries 2, 3 and 4 stages per worker (as many as the layers
allow).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipedream.errors import PlanningError
from pipedream.formats.plan import Plan, Prediction, StagePlan
from pipedream.formats.profile import Profile
from pipedream.formats.topology import Topology
from pipedream.formats.units import format_bytes
from pipedream.optimizer.bounds import BOUND_SLACK
from pipedream.optimizer.cost_model import LayerCosts, StageCost
from pipedream.optimizer.minmax import FloatArray
from pipedream.optimizer.table_memory import worker_memory
from pipedream.optimizer.tied_costs import TiedLayers
from pipedream.optimizer.tree import (
    Cluster,
    Leaf,
    Node,
    Tree,
    TreeEvaluation,
)
from pipedream.optimizer.verify import (
    data_parallel_time_ms,
    lower_bound_ms,
    simulated_ms,
    too_big_to_simulate,
)
from pipedream.schedules import SCHEDULES, lookup

__all__ = [
    "PLACED",
    "VIRTUAL_STAGES_TRIED",
    "PlacedPlan",
    "PlacedSearch",
    "balanced_spans",
    "candidate_cuts",
    "copy_counts",
    "default_placed_microbatches",
    "placed_search",
    "stage_times",
    "stages_per_worker_options",
]

PLACED = tuple(name for name, record in SCHEDULES.items() if record.several_stages_per_rank)
"""The schedules this module plans."""
VIRTUAL_STAGES_TRIED = (2, 3, 4)
"""Stages per worker ``interleaved-1f1b`` tries when ``--virtual-stages`` is not given."""


@dataclass(frozen=True)
class PlacedPlan:
    """A plan for a placed schedule, with what the summary shows of it."""

    plan: Plan
    """The plan, its prediction simulated."""
    tree: Tree
    """Its stages as one level of unreplicated nodes (the form the report reads)."""
    evaluation: TreeEvaluation
    """Per stage: its cost on the innermost level, its time, its worker's memory."""
    cluster: Cluster
    """The levels it was planned on."""


def balanced_spans(span_ms: FloatArray, num_stages: int) -> list[tuple[int, int]]:
    """Cut layers into ``num_stages`` contiguous, non-empty ``(first, last)`` spans whose
    slowest span is as fast as it can be; ``span_ms[i, j]`` is the time of layers ``i..j`` as
    one stage. Exact (a dynamic program over the cuts); ties go to the earliest cuts."""
    n = span_ms.shape[0]
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} non-empty stages")
    upper = np.triu(span_ms) + np.tril(np.full((n, n), np.inf), -1)  # only i <= j exist
    # best[j]: the slowest span of the best cut of layers 0..j into k spans; first[k][j]: the
    # first layer of that cut's last span
    best = upper[0].copy()
    first = [np.zeros(n, dtype=np.int64)]
    for _ in range(1, num_stages):
        shifted = np.concatenate(([np.inf], best[:-1]))  # the cut before layer i ends at i-1
        options = np.maximum(shifted[:, None], upper)  # [i, j]: last span i..j
        starts = np.argmin(options, axis=0)
        best = options[starts, np.arange(n)]
        first.append(starts)
    spans = []
    last = n - 1
    for k in range(num_stages - 1, -1, -1):
        start = int(first[k][last])
        spans.append((start, last))
        last = start - 1
    assert last == -1, spans
    return spans[::-1]


def candidate_cuts(
    costs: LayerCosts, cluster: Cluster, num_stages: int
) -> list[list[tuple[int, int]]]:
    """The cuts worth simulating: the one whose slowest stage is fastest counting transfers
    (:func:`stage_times`), and the one that balances compute alone. Neither sees that a
    worker runs several stages (its time is theirs together) or which messages stay on a
    worker; the simulation of both does, and the faster is kept."""
    n = costs.num_layers
    prefix = np.concatenate(([0.0], np.cumsum(costs.compute_ms)))
    compute = prefix[None, 1:] - prefix[:-1, None]  # [i, j]: layers i..j
    cuts = [balanced_spans(stage_times(costs, cluster), num_stages)]
    balanced = balanced_spans(np.where(np.tri(n, dtype=bool).T, compute, np.inf), num_stages)
    return cuts if balanced in cuts else [*cuts, balanced]


def stage_times(costs: LayerCosts, cluster: Cluster) -> FloatArray:
    """``[i, j]``: layers ``i..j`` as one unreplicated stage on the innermost level (compute
    and transfers overlap, the larger counts), ``inf`` below the diagonal: what
    :meth:`~pipedream.optimizer.cost_model.CostModel.stage_cost` gives each range, at once.
    An unreplicated stage has no allreduce."""
    n = costs.num_layers
    model = cluster.model(0)
    first, last = np.arange(n)[:, None], np.arange(n)[None, :]
    # each row summed from its first layer on, in the order CostModel.stage_cost sums
    compute = np.full((n, n), np.inf)
    layer_ms = np.asarray(costs.compute_ms, dtype=np.float64)
    for i in range(n):
        compute[i, i:] = np.cumsum(layer_ms[i:])
    out_ms = model.transfer_ms(np.array([costs.cut_bytes(k) for k in range(n)]), replicas=1)
    in_ms = np.concatenate(([0.0], out_ms[:-1]))  # the cut before layer i
    charge_in, charge_out = first > 0, last < n - 1
    if model.name == "pipedream":
        charge_out = charge_in & charge_out
    times = np.maximum(compute, np.where(charge_in, in_ms[:, None], 0.0))
    np.maximum(times, np.where(charge_out, out_ms[None, :], 0.0), out=times)
    if costs.tied:
        tied = costs.tied.exchanged_bytes(first, last)
        np.maximum(times, model.tied_ms(tied, replicas=1), out=times)
    return times  # inf below the diagonal, as compute is


def default_placed_microbatches(workers: int) -> int:
    """Smallest multiple of ``workers`` that is at least ``max(4, 2 workers)``."""
    return workers * math.ceil(max(4, 2 * workers) / workers)


def stages_per_worker_options(
    schedule: str, *, workers: int, layers: int, virtual_stages: int | None
) -> list[int]:
    """The ``v`` to try (each cut into ``v * workers`` stages of at least one layer)."""
    if schedule == "zbv":
        if virtual_stages not in (None, 2):
            raise PlanningError(
                f"--virtual-stages {virtual_stages} with schedule 'zbv': its V places exactly "
                "2 stages on every worker; leave --virtual-stages out"
            )
        wanted: Sequence[int] = (2,)
    elif virtual_stages is not None:
        if virtual_stages < 2:
            raise PlanningError(
                f"--virtual-stages {virtual_stages}: interleaving needs at least 2 stages per "
                "worker (use --schedule 1f1b for one)"
            )
        wanted = (virtual_stages,)
    else:
        wanted = VIRTUAL_STAGES_TRIED
    options = [v for v in wanted if v * workers <= layers]
    if not options:
        raise PlanningError(
            f"schedule {schedule!r} on {workers} workers needs at least {wanted[0] * workers} "
            f"layers ({wanted[0]} stages per worker), the profile has {layers}; use fewer "
            "workers or --schedule 1f1b"
        )
    return options


@dataclass(frozen=True)
class _Layout:
    """A candidate before its simulation: its plan (no prediction yet), what the cost model
    and the tables say of its stages, and its lower bound."""

    plan: Plan
    spans: tuple[tuple[int, int], ...]
    stage_costs: tuple[StageCost, ...]
    memory: tuple[float, ...]
    """Per stage, its worker's memory."""
    bound_ms: float
    """A lower bound on its simulated time per minibatch (:mod:`~pipedream.optimizer.bounds`)."""

    @property
    def bound_per_microbatch_ms(self) -> float:
        return self.bound_ms / self.plan.microbatches


def _layout(
    profile: Profile,
    topology: Topology,
    cluster: Cluster,
    *,
    schedule: str,
    microbatches: int,
    spans: Sequence[tuple[int, int]],
    copies: int,
    recompute: bool = False,
) -> _Layout | None:
    """Stages ``spans`` on ``copies`` copies of the pipeline (copy ``j`` on ranks
    ``j P .. j P + P - 1``), placed but not simulated; None when it is too big to simulate
    (not a candidate: its memory is not even counted)."""
    costs = LayerCosts.from_profile(profile, recompute=recompute)
    workers = cluster.num_workers
    per_copy = workers // copies
    placement = lookup(schedule).placement
    assert placement is not None
    ranks = placement(len(spans), per_copy)
    names = profile.layer_names
    model = cluster.model(0)
    traded = replace(costs, tied=_traded_across_ranks(costs.tied, spans, ranks))
    stage_costs = tuple(
        model.stage_cost(traded, first=first, last=last, replicas=copies) for first, last in spans
    )
    plan = Plan(
        workload=profile.workload,
        schedule=schedule,
        microbatch_size=profile.microbatch_size,
        microbatches=microbatches,
        world_size=workers,
        stages=tuple(
            StagePlan(
                names[first], names[last], copies, tuple(rank + j * per_copy for j in range(copies))
            )
            for (first, last), rank in zip(spans, ranks)
        ),
        workload_args=dict(profile.workload_args),
        layers=tuple(names),
        recompute=recompute,
        precision=profile.precision,
    )
    if too_big_to_simulate(plan):
        return None
    memory = worker_memory(plan, costs, spans)
    bound = lower_bound_ms(plan, profile, topology)
    return _Layout(plan, tuple(spans), stage_costs, tuple(memory[r] for r in ranks), bound)


def _simulated(
    layout: _Layout, profile: Profile, topology: Topology, cluster: Cluster
) -> PlacedPlan | None:
    """The candidate with its simulated prediction (None: too big to simulate, or no finite
    time)."""
    time_ms = simulated_ms(layout.plan, profile, topology)
    if time_ms is None:
        return None
    plan = layout.plan
    stage_ms = tuple(cost.total_ms for cost in layout.stage_costs)
    copies = plan.stages[0].replicas
    plan = replace(
        plan,
        prediction=Prediction(
            time_per_minibatch_ms=time_ms,
            throughput_samples_per_s=profile.microbatch_size * plan.microbatches * 1e3 / time_ms,
            bottleneck=stage_ms.index(max(stage_ms)),
            stage_ms=stage_ms,
            memory_bytes=layout.memory,
            data_parallel_time_per_minibatch_ms=_data_parallel_ms(
                profile, cluster, recompute=plan.recompute
            ),
            cost_model=cluster.cost_model,
            method="simulated",
        ),
    )
    leaves = tuple(
        Leaf(first, last, copies, cost, ms, mem)
        for (first, last), cost, ms, mem in zip(
            layout.spans, layout.stage_costs, stage_ms, layout.memory
        )
    )
    tree = tuple(Node(first, last, copies) for first, last in layout.spans)
    return PlacedPlan(plan, tree, TreeEvaluation(leaves), cluster)


DATA_PARALLEL_SCHEDULE = "1f1b"
"""The schedule of the data parallel line next to a placed plan: its update rule with one
stage per worker (``pipedream plan --compare``'s baselines run under it too)."""


def _data_parallel_ms(profile: Profile, cluster: Cluster, *, recompute: bool) -> float:
    """Data parallelism on ``cluster``'s workers, ``m`` microbatches, under
    :data:`DATA_PARALLEL_SCHEDULE` (``recompute``: recomputing activations): exact, what its
    simulation gives, as the placed plan's time is simulated."""
    return data_parallel_time_ms(profile, cluster, DATA_PARALLEL_SCHEDULE, recompute=recompute)


@dataclass(frozen=True)
class PlacedSearch:
    """What :func:`placed_search` found."""

    plan: PlacedPlan | None
    """The fastest plan that fits, or None."""
    problem: str
    """Why there is none ("" when there is one)."""
    leanest_bytes: float | None = None
    """Where the memory limit is why there is none: the least memory on one worker of the
    candidates (None otherwise)."""


def placed_search(
    profile: Profile,
    topology: Topology,
    *,
    schedule: str,
    microbatches: int | None,
    virtual_stages: int | None,
    memory_limit: float | None,
    cost_model: str,
    straight: bool = False,
    recompute: bool = False,
) -> PlacedSearch:
    """The fastest plan for ``schedule`` that fits ``memory_limit`` (see the module
    docstring), or None and why there is none, and whether the memory limit is why;
    ``straight``: one copy of the pipeline over all workers (no stage replicated);
    ``recompute``: activations recomputed in backward.

    The candidates that fit are simulated in the order of their lower bounds
    (:func:`~pipedream.optimizer.bounds.minibatch_lower_bound`, per microbatch); once the
    fastest simulated is faster than the next bound by :data:`~pipedream.optimizer.bounds.
    BOUND_SLACK`, no candidate left can beat it and none is simulated."""
    workers = Cluster.from_topology(topology, cost_model=cost_model).num_workers
    costs = LayerCosts.from_profile(profile, recompute=recompute)
    layouts: list[tuple[_Layout, Cluster]] = []
    smallest: float | None = None
    problems = []
    for copies in [1] if straight else copy_counts(workers):
        per_copy = workers // copies
        m = microbatches or default_placed_microbatches(per_copy)
        if schedule == "interleaved-1f1b" and m % per_copy:
            problems.append(
                f"--microbatches {m} with schedule 'interleaved-1f1b' on {per_copy} workers per "
                f"copy of the pipeline: it runs microbatches in groups of the workers; use a "
                f"multiple of {per_copy}"
            )
            continue
        cluster = Cluster.from_topology(topology, cost_model=cost_model, microbatches=m)
        try:
            options = stages_per_worker_options(
                schedule,
                workers=per_copy,
                layers=len(profile.layers),
                virtual_stages=virtual_stages,
            )
        except PlanningError as error:
            problems.append(str(error))
            continue
        cuts = [cut for v in options for cut in candidate_cuts(costs, cluster, v * per_copy)]
        for spans in cuts:
            layout = _layout(
                profile,
                topology,
                cluster,
                schedule=schedule,
                microbatches=m,
                spans=spans,
                copies=copies,
                recompute=recompute,
            )
            if layout is None:
                continue
            peak = max(layout.memory)
            if memory_limit is not None and peak > memory_limit:
                smallest = peak if smallest is None else min(smallest, peak)
                continue
            layouts.append((layout, cluster))
    # compared per microbatch: the copies' default microbatches differ
    order = sorted(range(len(layouts)), key=lambda i: layouts[i][0].bound_per_microbatch_ms)
    best: PlacedPlan | None = None
    best_rank = (math.inf, 0, 0)
    for index in order:
        layout, cluster = layouts[index]
        if layout.bound_per_microbatch_ms > best_rank[0] * (1 + BOUND_SLACK):
            break  # sorted: no candidate left can be faster than the best (inf: none yet)
        candidate = _simulated(layout, profile, topology, cluster)
        if candidate is None:
            continue  # no finite time
        rank = (*_rank(candidate.plan), index)  # ties: fewer copies, then the earlier candidate
        if rank < best_rank:
            best, best_rank = candidate, rank
    if best is not None:
        return PlacedSearch(best, "")
    if problems and smallest is None:
        return PlacedSearch(None, problems[0])
    if smallest is not None:
        assert memory_limit is not None
        return PlacedSearch(
            None,
            f"schedule {schedule!r} does not fit: its leanest plan needs {format_bytes(smallest)} "
            f"on one worker, the limit is {format_bytes(memory_limit)}; use fewer microbatches, "
            "more memory, or another schedule",
            smallest,
        )
    return PlacedSearch(
        None,
        f"schedule {schedule!r} on {workers} workers is too big to simulate; use fewer "
        "microbatches",
    )


def _rank(plan: Plan) -> tuple[float, int]:
    """Faster per microbatch first, then fewer copies of the pipeline."""
    assert plan.prediction is not None
    return plan.prediction.time_per_minibatch_ms / plan.microbatches, plan.stages[0].replicas


def _traded_across_ranks(
    tied: TiedLayers, spans: Sequence[tuple[int, int]], ranks: Sequence[int]
) -> TiedLayers:
    """The tied parameters whose stages are on more than one rank: an owner and its copies
    on one rank (the V's first and last stage) hand over in memory and trade nothing."""
    rank_of_layer = {
        layer: ranks[stage]
        for stage, (first, last) in enumerate(spans)
        for layer in range(first, last + 1)
    }
    kept = [
        (members, nbytes)
        for members, nbytes in zip(tied.members, tied.nbytes)
        if len({rank_of_layer[layer] for layer in members}) > 1
    ]
    return TiedLayers(tuple(m for m, _ in kept), tuple(b for _, b in kept))


def copy_counts(workers: int) -> list[int]:
    """How many copies of the pipeline to try: every divisor of ``workers`` that leaves at
    least 2 workers per copy (1 copy when there is only one worker)."""
    return [r for r in range(1, workers + 1) if workers % r == 0 and workers // r >= 2] or [1]
