"""Hierarchical partitions, their evaluation under the cost model, and their ranks.

A hierarchical plan (PipeDream's section 3.1) is a pipeline of stages at the outermost level,
each stage a range of layers on ``r`` units of the level below; every such unit runs the same
pipeline of that range one level down, and so on to the innermost level, whose stages run on
workers. :class:`Node` is one such stage; a :data:`Tree` is the outermost pipeline::

    2 servers x 4 GPUs, outer: [0..9 on 1 server][10..15 on 1 server]
      server 0: [0..3 on 1 GPU][4..9 on 3 GPUs]    server 1: [10..15 on 4 GPUs]
    flattened: stages 0..3 (1 replica), 4..9 (3 replicas), 10..15 (4 replicas)

:func:`evaluate_tree` is the cost model's definition for a whole tree (what the dynamic program
of :mod:`~pipedream.optimizer.hierarchy` minimises, written plainly, so tests can compare the
two); :func:`leaf_ranks` numbers the workers so that consecutive ranks share the innermost unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipedream.formats.topology import Topology
from pipedream.optimizer.cost_model import (
    DEFAULT_COST_MODEL,
    CostModel,
    LayerCosts,
    StageCost,
)
from pipedream.optimizer.memory import ROOT, Context, MemoryModel

__all__ = [
    "Cluster",
    "Leaf",
    "Node",
    "Tree",
    "TreeEvaluation",
    "data_parallel_tree",
    "evaluate_tree",
    "leaf_ranks",
]


@dataclass(frozen=True)
class Node:
    """One stage of a pipeline at some level: layers ``first..last`` on ``replicas`` units."""

    first: int
    """Index of the stage's first layer."""
    last: int
    """Index of the stage's last layer (inclusive)."""
    replicas: int
    """Units of this level running the stage (workers on the innermost level)."""
    inner: tuple[Node, ...] = ()
    """The pipeline each of those units runs over ``first..last``; empty on the innermost
    level."""


Tree = tuple[Node, ...]
"""The outermost pipeline of a hierarchical plan."""


@dataclass(frozen=True)
class Cluster:
    """The levels the optimizer plans on, innermost first, and the cost model's settings."""

    workers: tuple[int, ...]
    """Units of the level below in one unit of each level (workers on the innermost)."""
    bandwidths: tuple[float, ...]
    """Bandwidth between those units, bytes/s, per level."""
    cost_model: str = DEFAULT_COST_MODEL
    """Cost model variant (:data:`~pipedream.optimizer.cost_model.COST_MODELS`)."""
    microbatches: int = 1
    """Microbatches per minibatch."""

    def __post_init__(self) -> None:
        assert len(self.workers) == len(self.bandwidths) >= 1
        assert all(w >= 1 for w in self.workers)

    @classmethod
    def from_topology(
        cls, topology: Topology, *, cost_model: str = DEFAULT_COST_MODEL, microbatches: int = 1
    ) -> Cluster:
        """The topology's levels, less those of a single unit (they change nothing)."""
        levels = [level for level in topology.levels if level.workers > 1]
        levels = levels or [topology.levels[0]]
        return cls(
            workers=tuple(level.workers for level in levels),
            bandwidths=tuple(level.bandwidth for level in levels),
            cost_model=cost_model,
            microbatches=microbatches,
        )

    @property
    def num_levels(self) -> int:
        return len(self.workers)

    @property
    def num_workers(self) -> int:
        return math.prod(self.workers)

    def unit_workers(self, level: int) -> int:
        """Workers in one unit of ``level`` (1 below the innermost level)."""
        return math.prod(self.workers[: level + 1])

    def model(self, level: int) -> CostModel:
        """The cost model of ``level``; ``w`` per the variant (see ``cost_model``)."""
        if level == 0:
            share = 1
        elif self.cost_model == "symmetric":
            share = self.unit_workers(level - 1)
        else:
            share = self.workers[level - 1]
        return CostModel(
            self.bandwidths[level],
            microbatches=self.microbatches,
            workers_per_unit=share,
            name=self.cost_model,
        )


@dataclass(frozen=True)
class Leaf:
    """A stage of the flattened plan (an innermost-level node) and its predicted costs."""

    first: int
    """Index of the first layer."""
    last: int
    """Index of the last layer (inclusive)."""
    replicas: int
    """Workers running it: the product of the replicas on its path."""
    cost: StageCost
    """Its own cost on the innermost level (compute, allreduce, transfers)."""
    time_ms: float
    """Its time per microbatch seen from the top: the enclosing stages' allreduces, divisions
    and transfers applied; the pipeline's time is the largest of these."""
    memory_bytes: float
    """Estimated memory per worker."""


@dataclass(frozen=True)
class TreeEvaluation:
    """A tree under the cost and memory models."""

    leaves: tuple[Leaf, ...]
    """The flattened stages in pipeline order."""

    @property
    def microbatch_ms(self) -> float:
        """The slowest stage's time per microbatch."""
        return max(leaf.time_ms for leaf in self.leaves)

    @property
    def bottleneck(self) -> int:
        """Index of the slowest flattened stage (the first on ties)."""
        times = [leaf.time_ms for leaf in self.leaves]
        return times.index(max(times))


def evaluate_tree(
    costs: LayerCosts, tree: Tree, *, cluster: Cluster, memory: MemoryModel | None = None
) -> TreeEvaluation:
    """Time and memory of every flattened stage of ``tree`` (memory 0 without a model)."""
    top = cluster.num_levels - 1
    leaves = _pipeline(costs, cluster, memory, top, tree, 0, costs.num_layers - 1, ROOT)
    return TreeEvaluation(leaves=tuple(leaves))


def _pipeline(
    costs: LayerCosts,
    cluster: Cluster,
    memory: MemoryModel | None,
    level: int,
    nodes: tuple[Node, ...],
    range_first: int,
    range_last: int,
    context: Context,
) -> list[Leaf]:
    assert nodes and nodes[0].first == range_first and nodes[-1].last == range_last
    assert all(a.last + 1 == b.first for a, b in zip(nodes, nodes[1:]))
    units = cluster.workers[level]
    assert sum(node.replicas for node in nodes) <= units
    model = cluster.model(level)
    out: list[Leaf] = []
    # the workers the runtime really has from each node on (idle ones do not count)
    sizes = [node.replicas * _unit_size(node.inner) for node in nodes]
    for index, node in enumerate(nodes):
        after = sum(sizes[index + 1 :])
        if level == 0:
            assert not node.inner
            cost = model.stage_cost(
                costs,
                first=node.first,
                last=node.last,
                replicas=node.replicas,
                range_first=range_first,
                range_last=range_last,
            )
            mem = 0.0
            if memory is not None:
                mem = memory.stage_bytes(
                    costs,
                    first=node.first,
                    last=node.last,
                    workers_from=node.replicas + after,
                    replicas=node.replicas,
                    context=context,
                )
            out.append(Leaf(node.first, node.last, node.replicas, cost, cost.total_ms, mem))
            continue
        inner_context = context.inner(replicas=node.replicas, after_units=after, unit_workers=1)
        inner = _pipeline(
            costs, cluster, memory, level - 1, node.inner, node.first, node.last, inner_context
        )
        for leaf in inner:
            # max commutes with this monotone map, so the node's time is the max of these
            wrapped = model.stage_cost(
                costs,
                first=node.first,
                last=node.last,
                replicas=node.replicas,
                inner_ms=leaf.time_ms,
                range_first=range_first,
                range_last=range_last,
            )
            out.append(
                Leaf(
                    leaf.first,
                    leaf.last,
                    leaf.replicas * node.replicas,
                    leaf.cost,
                    wrapped.total_ms,
                    leaf.memory_bytes,
                )
            )
    return out


def _unit_size(pipeline: tuple[Node, ...]) -> int:
    """Workers one unit running ``pipeline`` really uses (1 for a worker itself)."""
    if not pipeline:
        return 1
    return sum(node.replicas * _unit_size(node.inner) for node in pipeline)


def leaf_ranks(tree: Tree, *, cluster: Cluster) -> tuple[tuple[int, ...], ...]:
    """Global ranks of each flattened stage's replicas, in the order minibatches visit them.

    A worker's rank is its address with the innermost digit fastest, so consecutive ranks
    share the innermost unit. A flattened stage's replica list varies the *outermost* unit
    fastest: minibatch ``t`` goes to replica ``t mod R`` (1F1B-RR), hence to the same outer
    unit at every stage of that unit's pipeline, and never leaves it between inner stages.
    Ranks are renumbered densely when some workers stay idle (``use_fewer_workers``).
    """
    stride = [cluster.unit_workers(level - 1) for level in range(cluster.num_levels)]
    found: list[list[int]] = []

    def walk(level: int, nodes: tuple[Node, ...], bases: list[int]) -> None:
        offset = 0
        for node in nodes:
            mine = [
                base + stride[level] * (offset + q) for q in range(node.replicas) for base in bases
            ]
            offset += node.replicas
            if level == 0:
                found.append(mine)
            else:
                walk(level - 1, node.inner, mine)

    walk(cluster.num_levels - 1, tree, [0])
    dense = {rank: index for index, rank in enumerate(sorted(r for ranks in found for r in ranks))}
    return tuple(tuple(dense[rank] for rank in ranks) for ranks in found)


def data_parallel_tree(cluster: Cluster, num_layers: int) -> Tree:
    """Every worker runs the whole model: one stage on every level, all units."""
    node: Node | None = None
    for level in range(cluster.num_levels):
        inner = () if node is None else (node,)
        node = Node(0, num_layers - 1, cluster.workers[level], inner)
    assert node is not None
    return (node,)
