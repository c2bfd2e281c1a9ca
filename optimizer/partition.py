"""Flat partitions (stages of layers with replica counts) and the one-level convenience API.

For a chain of ``n`` layers and ``M`` workers on one network level, :func:`partition` finds the
contiguous stages ``(first, last, replicas)`` that use ``M`` workers (or fewer, with
``use_fewer_workers``) and minimise the slowest stage's time (PipeDream's objective)::

    best[j][m] = min(  stage(0..j, m),
                       min over k < j, r < m of max(best[k][m - r], stage(k+1..j, r)) )

It is the hierarchical solver (:mod:`~pipedream.optimizer.hierarchy`) on a cluster of one
level. :func:`flatten` turns any hierarchical tree into the flat stages a plan lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedream.optimizer.cost_model import CostModel, LayerCosts
from pipedream.optimizer.hierarchy import Solution, solve_cluster
from pipedream.optimizer.memory import MemoryModel
from pipedream.optimizer.tree import Cluster, Node, Tree

__all__ = ["Partition", "StageSpan", "flatten", "partition", "partition_by_stage_count"]


@dataclass(frozen=True)
class StageSpan:
    """One stage of a flat partition, by layer index."""

    first: int
    """Index of the stage's first layer."""
    last: int
    """Index of the stage's last layer (inclusive)."""
    replicas: int
    """Data-parallel replicas of the stage."""


@dataclass(frozen=True)
class Partition:
    """A flat partition and its predicted time."""

    stages: tuple[StageSpan, ...]
    """Stages tiling the layers in order."""
    time_ms: float
    """Predicted time of the slowest stage, per microbatch (PipeDream's objective)."""

    @property
    def num_workers(self) -> int:
        return sum(stage.replicas for stage in self.stages)

    def as_tuples(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((stage.first, stage.last, stage.replicas) for stage in self.stages)


def flatten(tree: Tree) -> tuple[StageSpan, ...]:
    """The innermost-level stages of ``tree`` in order, replicas multiplied along the path."""
    spans: list[StageSpan] = []

    def walk(nodes: tuple[Node, ...], factor: int) -> None:
        for node in nodes:
            if node.inner:
                walk(node.inner, factor * node.replicas)
            else:
                spans.append(StageSpan(node.first, node.last, factor * node.replicas))

    walk(tree, 1)
    return tuple(spans)


def _one_level(
    costs: LayerCosts,
    num_workers: int,
    model: CostModel,
    straight: bool,
    use_fewer_workers: bool,
    memory_limit: float | None,
    memory_model: MemoryModel | None,
    by_stage_count: bool,
) -> dict[int, Solution]:
    cluster = Cluster(
        workers=(num_workers,),
        bandwidths=(model.bandwidth,),
        cost_model=model.name,
        microbatches=model.microbatches,
    )
    return solve_cluster(
        costs,
        cluster,
        straight=straight,
        use_fewer_workers=use_fewer_workers,
        memory=memory_model,
        memory_limit=memory_limit,
        by_stage_count=by_stage_count,
    )


def partition(
    costs: LayerCosts,
    *,
    num_workers: int,
    model: CostModel,
    straight: bool = False,
    use_fewer_workers: bool = False,
    memory_limit: float | None = None,
    memory_model: MemoryModel | None = None,
) -> Partition | None:
    """The best partition of ``costs`` over ``num_workers`` workers on one level.

    ``memory_limit`` (bytes per worker) needs ``memory_model``. None when nothing is feasible:
    a straight pipeline with more workers than layers (and ``use_fewer_workers`` off), or no
    stage fitting the memory limit.
    """
    found = _one_level(
        costs, num_workers, model, straight, use_fewer_workers, memory_limit, memory_model, False
    )
    if not found:
        return None
    best = found[0]
    return Partition(stages=flatten(best.tree), time_ms=best.time_ms)


def partition_by_stage_count(
    costs: LayerCosts,
    *,
    num_workers: int,
    model: CostModel,
    straight: bool = False,
    use_fewer_workers: bool = False,
    memory_limit: float | None = None,
    memory_model: MemoryModel | None = None,
) -> dict[int, Partition]:
    """Like :func:`partition`, the best partition for each feasible number of stages."""
    found = _one_level(
        costs, num_workers, model, straight, use_fewer_workers, memory_limit, memory_model, True
    )
    return {
        count: Partition(stages=flatten(solution.tree), time_ms=solution.time_ms)
        for count, solution in found.items()
    }
