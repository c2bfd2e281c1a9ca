"""PipeDream's dynamic program: contiguous stages and a replication factor per stage.

For a chain of ``n`` layers and ``M`` workers (one network level) it finds the stages
``(first, last, replicas)`` that tile the layers, use ``M`` workers in all, and minimise the
slowest stage's time (:mod:`pipedream.optimizer.cost_model`)::

    best[j][m] = min(  stage(0..j, m)                                  # one stage, m replicas
                       min over k < j, r < m of
                           max(best[k][m - r], stage(k+1..j, r)) )     # last stage k+1..j

    with use_fewer_workers:  best[j][m] = min(best[j][m], best[j][m - 1])

``stage(x..y, r)`` already includes the transfers across the stage's own boundaries, so the
recurrence needs no other term. With ``straight`` every ``r`` is 1 (so ``M`` stages, unless
fewer workers are allowed). A memory limit removes the ``(x..y, r)`` whose per-worker estimate
(:mod:`pipedream.optimizer.memory`) exceeds it; the workers before a stage are ``m - r``, which
is what its number of in-flight minibatches depends on.

:func:`partition_by_stage_count` adds the number of stages as one more index of ``best`` and
returns the best partition for every stage count, for schedules whose cost depends on it.

The ``(k, j)`` loops run as numpy matrix operations, one ``n x n`` matrix per ``(m, r)``:
``O(n^2 M^2)`` work, about 50 ms for a 350-layer ResNet-101 on 16 workers (about 5x that per
stage count). Ties go
to the single stage, then the smallest last-stage replica count, then the earliest split, and
(with ``use_fewer_workers``) to fewer workers.

:func:`solve` is the recurrence on any stage-time matrices, so a hierarchical planner can feed
it one level's pipeline times as the next level's stage times (the original's multi-level DP).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from pipedream.optimizer.cost_model import CostModel, LayerCosts
from pipedream.optimizer.memory import MemoryModel

__all__ = [
    "Partition",
    "StageSpan",
    "partition",
    "partition_by_stage_count",
    "solve",
    "solve_by_stage_count",
]

_CACHE_LIMIT = 1 << 23
"""Largest number of matrix entries kept across ``m`` (64 MiB of float64)."""

StageMatrix = Callable[[int, int], NDArray[np.float64]]
"""``(replicas, workers_before) -> T`` with ``T[x, y]`` the time of stage ``x..y`` (inf: not
allowed or ``x > y``)."""


@dataclass(frozen=True)
class StageSpan:
    """One stage of a partition, by layer index."""

    first: int
    """Index of the stage's first layer."""
    last: int
    """Index of the stage's last layer (inclusive)."""
    replicas: int
    """Data-parallel replicas of the stage."""


@dataclass(frozen=True)
class Partition:
    """The optimizer's answer: stages in pipeline order and their predicted time."""

    stages: tuple[StageSpan, ...]
    """Stages tiling the layers in order."""
    time_ms: float
    """Predicted time of the slowest stage, per microbatch (PipeDream's objective)."""

    @property
    def num_workers(self) -> int:
        return sum(stage.replicas for stage in self.stages)

    def as_tuples(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((stage.first, stage.last, stage.replicas) for stage in self.stages)


def solve(
    num_layers: int,
    *,
    num_workers: int,
    stage_matrix: StageMatrix,
    replica_choices: Sequence[int],
    use_fewer_workers: bool = False,
) -> Partition | None:
    """Run the recurrence of the module docstring; None when no partition is feasible."""
    return _run(num_layers, num_workers, stage_matrix, replica_choices, use_fewer_workers, 0)[0]


def solve_by_stage_count(
    num_layers: int,
    *,
    num_workers: int,
    stage_matrix: StageMatrix,
    replica_choices: Sequence[int],
    use_fewer_workers: bool = False,
) -> dict[int, Partition]:
    """The best partition with exactly ``S`` stages, for every feasible ``S``.

    The same recurrence with the stage count as one more index (``num_stages`` times the
    work): what a schedule whose cost grows with ``S`` (a flush's fill and drain) chooses from.
    """
    most = min(num_layers, num_workers)
    found = _run(num_layers, num_workers, stage_matrix, replica_choices, use_fewer_workers, most)
    return {count: part for count, part in enumerate(found) if part is not None}


def _run(
    n: int,
    total: int,
    stage_matrix: StageMatrix,
    replica_choices: Sequence[int],
    use_fewer_workers: bool,
    max_stages: int,
) -> list[Partition | None]:
    """The DP; with ``max_stages == 0`` one answer for any stage count, else one per count.

    ``best[level, j, m]``: layers ``0..j`` on ``m`` workers, ``level`` = number of stages (or
    0 = any number). A stage appended to a prefix at level ``l`` lands at ``l + counted``.
    """
    assert n >= 1 and total >= 1
    counted = 1 if max_stages else 0
    levels = max_stages + 1
    low, high = counted, max(max_stages, 1)  # prefix levels low..high-1 grow to +counted
    best = np.full((levels, n, total + 1), np.inf)
    split = np.full((levels, n, total + 1), -1, dtype=np.int64)  # last stage: split+1..j
    reps = np.zeros((levels, n, total + 1), dtype=np.int64)  # its replicas; 0: as with m - 1
    for m in range(1, total + 1):
        if m in replica_choices:
            best[counted, :, m] = stage_matrix(m, 0)[0]
            reps[counted, :, m] = m
        for r in replica_choices:
            if r >= m:
                break
            top = min(high, m - r + 1) if counted else high  # l stages need l workers
            prefix = best[low:top, :-1, m - r]  # layers 0..k on m - r workers, k = 0..n-2
            if not np.isfinite(prefix).any():
                continue
            # candidate[l, j, k] = max(prefix through k, stage k+1..j on r workers); k last,
            # so that the reduction runs over contiguous memory
            candidate = np.maximum(prefix[:, None, :], stage_matrix(r, m - r)[1:, :].T[None])
            k = np.argmin(candidate, axis=2)
            value = np.take_along_axis(candidate, k[:, :, None], axis=2)[:, :, 0]
            target = slice(low + counted, top + counted)
            better = value < best[target, :, m]
            best[target, :, m] = np.where(better, value, best[target, :, m])
            split[target, :, m] = np.where(better, k, split[target, :, m])
            reps[target, :, m] = np.where(better, r, reps[target, :, m])
        if use_fewer_workers and m > 1:
            fewer = best[:, :, m - 1] <= best[:, :, m]
            best[:, :, m] = np.where(fewer, best[:, :, m - 1], best[:, :, m])
            reps[:, :, m] = np.where(fewer, 0, reps[:, :, m])
    return [_walk(best, split, reps, level, n, total, counted) for level in range(levels)]


def _walk(
    best: NDArray[np.float64],
    split: NDArray[np.int64],
    reps: NDArray[np.int64],
    level: int,
    n: int,
    total: int,
    counted: int,
) -> Partition | None:
    """Follow the recorded choices back from ``(level, n - 1, total)``."""
    time_ms = float(best[level, n - 1, total])
    if not np.isfinite(time_ms):
        return None
    stages = []
    j, m = n - 1, total
    while True:
        r = int(reps[level, j, m])
        if r == 0:
            m -= 1
            continue
        k = int(split[level, j, m])
        stages.append(StageSpan(k + 1, j, r))
        if k < 0:
            break
        j, m, level = k, m - r, level - counted
    stages.reverse()
    assert stages[0].first == 0 and sum(s.replicas for s in stages) <= total
    return Partition(stages=tuple(stages), time_ms=time_ms)


def _range_sums(values: Sequence[float]) -> NDArray[np.float64]:
    """``S[x, y] = sum(values[x..y])`` (negative garbage below the diagonal)."""
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))
    return prefix[None, 1:] - prefix[:-1, None]


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
    """The best partition of ``costs`` over ``num_workers`` workers under ``model``.

    ``memory_limit`` (bytes per worker) needs ``memory_model``. Returns None when nothing is
    feasible: a straight pipeline with more workers than layers (and ``use_fewer_workers``
    off), or no stage fitting the memory limit.
    """
    matrices = _StageMatrices(costs, model, memory_limit, memory_model, num_workers)
    return solve(
        costs.num_layers,
        num_workers=num_workers,
        stage_matrix=matrices,
        replica_choices=[1] if straight else range(1, num_workers + 1),
        use_fewer_workers=use_fewer_workers,
    )


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
    matrices = _StageMatrices(costs, model, memory_limit, memory_model, num_workers)
    return solve_by_stage_count(
        costs.num_layers,
        num_workers=num_workers,
        stage_matrix=matrices,
        replica_choices=[1] if straight else range(1, num_workers + 1),
        use_fewer_workers=use_fewer_workers,
    )


class _StageMatrices:
    """``(replicas, workers_before) -> T[x, y]``: PipeDream's stage times of all ranges at once.

    Row ``x`` is the first layer, column ``y`` the last; ``x > y`` and stages over the memory
    limit are ``inf``. Without a memory limit a matrix depends on ``replicas`` only and is
    cached while the cache stays small.
    """

    def __init__(
        self,
        costs: LayerCosts,
        model: CostModel,
        memory_limit: float | None,
        memory_model: MemoryModel | None,
        num_workers: int,
    ) -> None:
        assert memory_limit is None or memory_model is not None
        n = costs.num_layers
        self.model, self.memory_limit, self.memory_model = model, memory_limit, memory_model
        self.compute = _range_sums(costs.compute_ms)
        self.compute[np.tril(np.ones((n, n), dtype=bool), -1)] = np.inf  # inf propagates
        self.params = _range_sums(costs.parameter_bytes)
        bounds = np.asarray(costs.boundary_bytes, dtype=np.float64)
        self.bytes_in = np.concatenate(([0.0], bounds))  # into a stage starting at x
        self.bytes_out = np.concatenate((bounds, [0.0]))  # out of a stage ending at y
        if memory_limit is not None:
            self.activations = _range_sums(costs.activation_bytes)
            self.optimizer = _range_sums(costs.optimizer_state_bytes)
        self.cache: dict[int, NDArray[np.float64]] = {}
        self.use_cache = memory_limit is None and n * n * num_workers <= _CACHE_LIMIT

    def __call__(self, replicas: int, workers_before: int) -> NDArray[np.float64]:
        if replicas in self.cache:
            return self.cache[replicas]
        model = self.model
        time = model.compute_ms(self.compute, param_bytes=self.params, replicas=replicas)
        time = np.maximum(time, model.transfer_ms(self.bytes_in, replicas=replicas)[:, None])
        time = np.maximum(time, model.transfer_ms(self.bytes_out, replicas=replicas)[None, :])
        if self.memory_limit is not None and self.memory_model is not None:
            param_factor, act_factor = self.memory_model.factors(
                workers_before=workers_before, replicas=replicas
            )
            memory = param_factor * self.params + self.optimizer + act_factor * self.activations
            time = np.where(memory <= self.memory_limit, time, np.inf)
        if self.use_cache:
            self.cache[replicas] = time
        return time
