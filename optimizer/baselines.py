"""The plans ``pipedream plan --compare`` puts next to the optimizer's, under the same model.

* **data parallel**: every worker runs the whole model (one stage on every level);
* **straight pipeline**: the best partition with one replica per stage (fewer workers allowed
  when the model has fewer layers than the cluster has workers);
* **uniform split**: ``S`` stages of equal layer counts, each on ``W / S`` workers;
* **parameter split**: ``S`` stages balancing parameter bytes (DeepSpeed's default
  ``partition_method="parameters"``), each on ``W / S`` workers.

For the two splits every ``S`` dividing the number of workers ``W`` is tried, with every way
of laying the ``S x W/S`` grid on the levels (stages across servers or replicas across them),
and the fastest is kept: the strongest version of each rule. Memory is reported, not enforced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from pipedream.formats.profile import Profile
from pipedream.formats.topology import Topology
from pipedream.optimizer.cost_model import minibatch_ms
from pipedream.optimizer.memory import MemoryModel
from pipedream.optimizer.planner import build_plan
from pipedream.optimizer.search import Request, solve_schedule
from pipedream.optimizer.tree import (
    Cluster,
    Node,
    Tree,
    TreeEvaluation,
    data_parallel_tree,
    evaluate_tree,
)
from pipedream.optimizer.verify import simulated_ms
from pipedream.schedules import lookup

__all__ = [
    "Baseline",
    "baselines",
    "parameter_split",
    "simulated_baselines",
    "split_trees",
    "uniform_split",
]

Span = tuple[int, int]


@dataclass(frozen=True)
class Baseline:
    """One configuration of the comparison."""

    name: str
    """What it is."""
    evaluation: TreeEvaluation | None
    """Its stages' times and memory; None when the rule gives no plan here."""
    time_per_minibatch_ms: float
    """Predicted time per minibatch (``inf`` when there is no plan)."""
    note: str = ""
    """Why there is no plan."""
    tree: Tree | None = None
    """Its workers' tree (None when there is no plan)."""


def uniform_split(num_layers: int, num_stages: int) -> list[Span]:
    """``num_stages`` contiguous spans whose layer counts differ by at most one."""
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(num_stages)]


def parameter_split(parameter_bytes: Sequence[float], num_stages: int) -> list[Span]:
    """``num_stages`` non-empty contiguous spans minimising the largest parameter total."""
    n = len(parameter_bytes)
    assert 1 <= num_stages <= n
    prefix = [0.0]
    for size in parameter_bytes:
        prefix.append(prefix[-1] + size)
    # best[s][j]: smallest largest-part over layers 0..j-1 in s parts; exact, O(S n^2)
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for k in range(s - 1, j):
                value = max(best[s - 1][k], prefix[j] - prefix[k])
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, k
    spans, j = [], n
    for s in range(num_stages, 0, -1):
        k = cut[s][j]
        spans.append((k, j - 1))
        j = k
    return spans[::-1]


def split_trees(spans: Sequence[Span], cluster: Cluster) -> Iterator[Tree]:
    """Every placement of ``spans`` (each on ``W / S`` workers) on the cluster's levels."""

    def place(level: int, group: Sequence[Span]) -> Iterator[tuple[Node, ...]]:
        units = cluster.workers[level]
        for stages in range(1, units + 1):
            if units % stages or len(group) % stages or (level == 0 and stages != len(group)):
                continue
            size = len(group) // stages
            parts = [group[i * size : (i + 1) * size] for i in range(stages)]
            yield from _combine(level, parts, units // stages)

    def _combine(level: int, parts: list[Sequence[Span]], replicas: int) -> Iterator[Tree]:
        if level == 0:
            yield tuple(Node(part[0][0], part[-1][1], replicas) for part in parts)
            return
        # every part uses the same shape one level down (all stages have W / S workers)
        inner = [list(place(level - 1, part)) for part in parts]
        for choice in zip(*inner):
            if len({len(c) for c in choice}) == 1:
                yield tuple(
                    Node(part[0][0], part[-1][1], replicas, sub) for part, sub in zip(parts, choice)
                )

    yield from place(cluster.num_levels - 1, list(spans))


def _best_split(
    name: str,
    make: Callable[[int], list[Span]],
    request: Request,
    cluster: Cluster,
    schedule: str,
) -> Baseline:
    costs, workers = request.costs, cluster.num_workers
    best = Baseline(name, None, math.inf, "no number of stages divides the workers")
    memory = MemoryModel(schedule, cluster.microbatches)
    for stages in range(1, min(workers, costs.num_layers) + 1):
        capped = lookup(schedule).microbatches_at_least_stages
        if workers % stages or (capped and stages > cluster.microbatches):
            continue
        spans = make(stages)
        for tree in split_trees(spans, cluster):
            evaluation = evaluate_tree(costs, tree, cluster=cluster, memory=memory)
            time_ms = minibatch_ms(
                schedule,
                evaluation.microbatch_ms,
                microbatches=cluster.microbatches,
                num_stages=stages,
            )
            if time_ms < best.time_per_minibatch_ms:
                best = Baseline(name, evaluation, time_ms, tree=tree)
    return best


def baselines(request: Request, *, cluster: Cluster, schedule: str) -> list[Baseline]:
    """The four baselines for ``schedule`` with ``cluster``'s microbatches (no memory limit)."""
    costs = request.costs
    m = cluster.microbatches
    memory = MemoryModel(schedule, m)
    found = []
    parallel_tree = data_parallel_tree(cluster, costs.num_layers)
    parallel = evaluate_tree(costs, parallel_tree, cluster=cluster, memory=memory)
    found.append(
        Baseline(
            "data parallel",
            parallel,
            minibatch_ms(schedule, parallel.microbatch_ms, microbatches=m, num_stages=1),
            tree=parallel_tree,
        )
    )
    straight_request = Request(
        costs, request.topology, request.cost_model, straight=True, use_fewer_workers=True
    )
    outcome = solve_schedule(straight_request, schedule=schedule, microbatches=m)
    if outcome.tree is None:
        found.append(Baseline("straight pipeline", None, math.inf, outcome.problem))
    else:
        evaluation = evaluate_tree(costs, outcome.tree, cluster=cluster, memory=memory)
        found.append(
            Baseline(
                "straight pipeline", evaluation, outcome.time_per_minibatch_ms, tree=outcome.tree
            )
        )
    found.append(
        _best_split(
            "uniform split",
            lambda s: uniform_split(costs.num_layers, s),
            request,
            cluster,
            schedule,
        )
    )
    found.append(
        _best_split(
            "parameter split",
            lambda s: parameter_split(costs.parameter_bytes, s),
            request,
            cluster,
            schedule,
        )
    )
    return found


def simulated_baselines(
    found: Sequence[Baseline],
    profile: Profile,
    topology: Topology,
    *,
    cluster: Cluster,
    schedule: str,
    recompute: bool = False,
) -> list[Baseline] | None:
    """``found`` with the times the simulation of each one's action tables gives, to stand
    next to an optimizer's plan whose time is simulated (None when one is too big to
    simulate: then the formula's times stand for all of them)."""
    out = []
    for baseline in found:
        if baseline.tree is None:
            out.append(baseline)
            continue
        plan, _ = build_plan(
            profile,
            tree=baseline.tree,
            cluster=cluster,
            schedule=schedule,
            recompute=recompute,
        )
        time_ms = simulated_ms(plan, profile, topology)
        if time_ms is None:
            return None
        out.append(replace(baseline, time_per_minibatch_ms=time_ms))
    return out
