"""PipeDream's hierarchical dynamic program (SOSP'19 section 3.1): levels innermost first.

The innermost level is solved for *every* range of layers on one unit (a server of workers):
``T_0[i][j]`` = the best pipeline of layers ``i..j`` on that unit. The next level treats those
as the compute times of its stages (a stage of ``r`` servers runs the range's best server
pipeline on each, plus the cross-server allreduce and transfers at that level's bandwidth), and
so on; the outermost level is solved for the whole model only, and the chosen ranges are
re-solved one level down to recover their inner pipelines (a :data:`~.tree.Tree`). This is the
original ``optimizer_graph_hierarchical.py``'s algorithm, with its cost model (``pipedream``)
or the symmetric variant (see :mod:`~pipedream.optimizer.cost_model`).

With a memory limit, an inner stage's in-flight microbatches depend on where its unit sits in
the whole pipeline (:class:`~pipedream.optimizer.memory.Context`): an inner level is solved once
per distinct context that the level above can put it in (cached), so memory-aware hierarchical
plans are exact (with ``use_fewer_workers``: conservative, see ``memory``) but cost more.
Without a limit each level is solved once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from pipedream.optimizer.cost_model import LayerCosts
from pipedream.optimizer.level_dp import LevelProblem, LevelResult, solve_level
from pipedream.optimizer.memory import ROOT, Context, MemoryModel
from pipedream.optimizer.stage_times import MemoryMask, StageTimes
from pipedream.optimizer.tree import Cluster, Node, Tree

__all__ = ["Solution", "solve_cluster"]

FloatArray = NDArray[np.float64]
_DENSE_FLOATS = 1 << 25
"""Materialised stage-time matrices kept at once, in floats (256 MiB)."""


@dataclass(frozen=True)
class Solution:
    """The best hierarchical partition found (for one number of stages, or overall)."""

    tree: Tree
    """The partition."""
    time_ms: float
    """Its slowest stage's time per microbatch."""

    @property
    def num_stages(self) -> int:
        def count(nodes: tuple[Node, ...]) -> int:
            return sum(count(node.inner) if node.inner else 1 for node in nodes)

        return count(self.tree)


def solve_cluster(
    costs: LayerCosts,
    cluster: Cluster,
    *,
    straight: bool = False,
    use_fewer_workers: bool = False,
    memory: MemoryModel | None = None,
    memory_limit: float | None = None,
    by_stage_count: bool = False,
) -> dict[int, Solution]:
    """The best partition: ``{0: best}``, or with ``by_stage_count`` the best for every
    feasible number of flattened stages. Empty when nothing is feasible."""
    assert memory_limit is None or memory is not None
    solver = _Solver(costs, cluster, straight, use_fewer_workers, memory, memory_limit)
    solver.counted = by_stage_count
    top = cluster.num_levels - 1
    n = costs.num_layers
    result = solve_level(solver.problem(top, ROOT, 0, n - 1), start=0, want_choices=True)
    found = {}
    for count, table in sorted(result.range_table.items()):
        time_ms = float(table[0, n - 1])
        if np.isfinite(time_ms):
            tree = solver.rebuild(top, ROOT, result, count, 0, n - 1)
            found[count] = Solution(tree=tree, time_ms=time_ms)
    return found


def _range_sums(prefix: FloatArray) -> FloatArray:
    """``S[x, y] = prefix[y + 1] - prefix[x]``, ``inf`` below the diagonal."""
    sums = prefix[None, 1:] - prefix[:-1, None]
    sums[np.tril_indices(len(prefix) - 1, -1)] = np.inf
    return sums


def _prefix(values: Sequence[float]) -> FloatArray:
    return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))


class _Solver:
    """The per-level problems, the cache of inner tables, and the reconstruction.

    A problem covers a sub-chain ``lo..hi`` of the layers: the whole model for the tables and
    the outermost level, the chosen range when a stage's inner pipeline is rebuilt (so that
    rebuilding costs only that range's size).
    """

    def __init__(
        self,
        costs: LayerCosts,
        cluster: Cluster,
        straight: bool,
        use_fewer: bool,
        memory: MemoryModel | None,
        limit: float | None,
    ) -> None:
        self.costs, self.cluster, self.straight, self.use_fewer = (
            costs,
            cluster,
            straight,
            use_fewer,
        )
        self.memory, self.limit = memory, limit
        self.counted = False
        n = costs.num_layers
        self.cum = _prefix(costs.compute_ms)
        self.pcum = _prefix(costs.parameter_bytes)
        self.compute = _range_sums(self.cum)
        bounds = np.asarray(costs.boundary_bytes, dtype=np.float64)
        self.bytes_in = np.concatenate(([0.0], bounds))  # into a stage starting at x
        self.kept_in = np.concatenate(([costs.data_bytes], bounds))  # kept when recomputing
        self.bytes_out = np.concatenate((bounds, [0.0]))  # out of a stage ending at y
        self.acum = _prefix(costs.activation_bytes)
        self.ocum = _prefix(costs.optimizer_state_bytes)
        self.tables: dict[tuple[int, object], dict[int, FloatArray]] = {}
        self.dense: dict[tuple[object, ...], list[StageTimes]] = {}
        self.dense_budget = _DENSE_FLOATS // max(1, n * n)  # matrices kept at once

    def key(self, context: Context) -> object:
        if self.limit is None or self.memory is None:
            return None
        return self.memory.context_key(context)

    def problem(
        self, level: int, context: Context, lo: int, hi: int, *, dense: bool = False
    ) -> LevelProblem:
        cluster = self.cluster
        units = cluster.workers[level]
        size = hi - lo + 1
        return LevelProblem(
            num_layers=size,
            units=units,
            replica_choices=(1,) if self.straight else tuple(range(1, units + 1)),
            source=lambda r, before: self.stages(level, context, r, before, lo, hi, dense),
            range_uses_cut=cluster.cost_model == "pipedream",
            max_count=min(size, cluster.unit_workers(level)) if self.counted else 0,
            use_fewer=self.use_fewer,
        )

    def range_tables(self, level: int, context: Context) -> dict[int, FloatArray]:
        """Best pipelines of every range on one unit of ``level`` (cached per context key)."""
        key = (level, self.key(context))
        if key not in self.tables:
            n = self.costs.num_layers
            problem = self.problem(level, context, 0, n - 1, dense=True)
            self.tables[key] = solve_level(problem, start=None).range_table
            for stale in [k for k in self.dense if k[0] == level]:
                del self.dense[stale]  # this level's matrices served their solve
        return self.tables[key]

    def stages(
        self, level: int, context: Context, r: int, before: int, lo: int, hi: int, dense: bool
    ) -> Sequence[StageTimes]:
        """The source of a problem: stage times on ``r`` units after ``before`` units."""
        units = self.cluster.workers[level]
        mask = None
        if level == 0:
            if self.limit is not None and self.memory is not None:
                param_factor, act_factor = self.memory.factors(
                    workers_from=units - before, replicas=r, context=context
                )
                mask = MemoryMask(
                    param_factor,
                    act_factor,
                    self.limit,
                    self.ocum[lo : hi + 2],
                    self.acum[lo : hi + 2],
                    self.kept_in[lo : hi + 1] if self.costs.recompute else None,
                )
            key: tuple[object, ...] = (
                0,
                r,
                None if mask is None else mask.param_factor,
                None if mask is None else mask.act_factor,
            )
            bases: dict[int, FloatArray] = {1 if self.counted else 0: self.compute}
        else:
            child = context.inner(
                replicas=r,
                after_units=units - before - r,
                unit_workers=self.cluster.unit_workers(level - 1),
            )
            key = (level, r, self.key(child))
            bases = self.range_tables(level - 1, child)
        key = (*key, lo, hi)
        if key in self.dense:
            return self.dense[key]
        times = [
            self._times(level, r, count, base[lo : hi + 1, lo : hi + 1], lo, hi, mask)
            for count, base in bases.items()
        ]
        # a one-start problem asks for the same stage times at every larger unit count: kept
        # as matrices, its gathers are lookups too (in half the budget: the levels solved for
        # all starts keep the other half whatever came before)
        keep = len(self.dense) < (self.dense_budget if dense else self.dense_budget // 2)
        if dense or keep:
            times = [t.materialised() for t in times]
        if keep:
            self.dense[key] = times
        return times

    def _times(
        self,
        level: int,
        r: int,
        count: int,
        base: FloatArray,
        lo: int,
        hi: int,
        mask: MemoryMask | None,
    ) -> StageTimes:
        model = self.cluster.model(level)
        lead_coef = model.allreduce_ms(1.0, replicas=r, lead=True) / model.microbatches
        later_coef = model.allreduce_ms(1.0, replicas=r, lead=False) / model.microbatches
        workers = self.cluster.unit_workers(level - 1)
        cum, pcum = self.cum[lo : hi + 2], self.pcum[lo : hi + 2]
        return StageTimes(
            base=base,
            param_cum=pcum,
            replicas=r,
            lead_coef=lead_coef,
            later_coef=later_coef,
            in_ms=model.transfer_ms(self.bytes_in[lo : hi + 1], replicas=r),
            out=model.transfer_ms(self.bytes_out[lo : hi + 1], replicas=r),
            lead_out=model.name == "symmetric",
            q_key=(cum / workers + min(lead_coef, later_coef) * pcum) / r,
            count=count,
            memory=mask,
            tied=self.costs.tied or None,
            offset=lo,
            tied_coef=model.tied_ms(1.0, replicas=r),
        )

    def rebuild(
        self, level: int, context: Context, result: LevelResult, count: int, lo: int, hi: int
    ) -> tuple[Node, ...]:
        """The pipeline of layers ``lo..hi`` that ``result`` chose (a one-start run over the
        sub-chain ``lo..``: its indices are relative to ``lo``)."""
        units = self.cluster.workers[level]
        stages = []
        choices, j, m, c = result.range_choices, hi - lo, units, count
        while True:
            choice = choices[(c, m)]
            r = int(choice.replicas[j])
            if r == 0:
                m -= 1
                continue
            split, child = int(choice.split[j]), int(choice.count[j])
            stages.append((lo + split + 1, lo + j, r, child, m))
            if split < 0:
                break
            choices, j, m, c = result.cut_choices, split, m - r, c - child
        nodes = []
        for first, last, r, child, used in reversed(stages):
            inner: tuple[Node, ...] = ()
            if level > 0:
                inner_context = context.inner(
                    replicas=r,
                    after_units=units - used,
                    unit_workers=self.cluster.unit_workers(level - 1),
                )
                problem = self.problem(level - 1, inner_context, first, last)
                sub = solve_level(problem, start=0, want_choices=True)
                inner = self.rebuild(level - 1, inner_context, sub, child, first, last)
            nodes.append(Node(first, last, r, inner))
        return tuple(nodes)
