"""The partitioning DP: literal hand-computed instances and brute force on random profiles."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pipedream.optimizer.cost_model import CostModel, LayerCosts
from pipedream.optimizer.memory import MemoryModel
from pipedream.optimizer.partition import StageSpan, partition, partition_by_stage_count

# At 2e6 bytes/s: transfer_ms(a, r) = a / (1000 r), allreduce_ms(P, r) = 2 (r-1) P / (1000 r).
BANDWIDTH = 2e6


def costs(
    compute: list[float],
    *,
    params: list[float] | None = None,
    bounds: list[float] | None = None,
    acts: list[float] | None = None,
) -> LayerCosts:
    n = len(compute)
    return LayerCosts(
        compute_ms=tuple(compute),
        parameter_bytes=tuple(params or [0.0] * n),
        activation_bytes=tuple(acts or [0.0] * n),
        optimizer_state_bytes=(0.0,) * n,
        boundary_bytes=tuple(bounds or [0.0] * (n - 1)),
    )


def spans(result) -> list[tuple[int, int, int]]:
    return [(s.first, s.last, s.replicas) for s in result.stages]


def test_cost_model_formulas_by_hand() -> None:
    model = CostModel(BANDWIDTH)
    assert model.transfer_ms(5000.0, replicas=1) == pytest.approx(5.0)
    assert model.transfer_ms(5000.0, replicas=2) == pytest.approx(2.5)
    assert model.allreduce_ms(3000.0, replicas=1) == 0.0
    assert model.allreduce_ms(3000.0, replicas=3) == pytest.approx(4.0)  # 2 * 2 * 3000 / 3000
    # (30 ms + 4 ms allreduce) / 3 replicas
    assert model.compute_ms(30.0, param_bytes=3000.0, replicas=3) == pytest.approx(34.0 / 3)
    # with 2 microbatches per minibatch the allreduce is shared by both
    assert CostModel(BANDWIDTH, microbatches=2).compute_ms(
        30.0, param_bytes=3000.0, replicas=3
    ) == pytest.approx(32.0 / 3)


def test_equal_layers_with_params_prefer_a_straight_pipeline() -> None:
    # straight: 10 | 10 | 10; one stage x3: (30 + 4) / 3 = 11.33; (0-1)x2 + 2: (20 + 2) / 2 = 11
    result = partition(
        costs([10, 10, 10], params=[1000, 1000, 1000]), num_workers=3, model=CostModel(BANDWIDTH)
    )
    assert spans(result) == [(0, 0, 1), (1, 1, 1), (2, 2, 1)]
    assert result.time_ms == pytest.approx(10.0)


def test_heavy_parameter_free_layer_is_replicated() -> None:
    # layer 0 x2: 40 / 2 = 20, transfer 5000 B: 2.5; layers 1-2 x1: 20, transfer 5; max 20.
    # straight: 40; one stage x3: (60 + 2.67) / 3 = 20.89; (0-1)x2 + 2: 25.5
    c = costs([40, 10, 10], params=[0, 1000, 1000], bounds=[5000, 0])
    result = partition(c, num_workers=3, model=CostModel(BANDWIDTH))
    assert spans(result) == [(0, 0, 2), (1, 2, 1)]
    assert result.time_ms == pytest.approx(20.0)


def test_transfer_bound_boundary_is_not_cut() -> None:
    # cutting moves 30000 B: 30 ms > either layer; one stage x2: (20 + 10 allreduce) / 2 = 15
    c = costs([10, 10], params=[5000, 5000], bounds=[30000])
    result = partition(c, num_workers=2, model=CostModel(BANDWIDTH))
    assert spans(result) == [(0, 1, 2)]
    assert result.time_ms == pytest.approx(15.0)
    straight = partition(c, num_workers=2, model=CostModel(BANDWIDTH), straight=True)
    assert spans(straight) == [(0, 0, 1), (1, 1, 1)]
    assert straight.time_ms == pytest.approx(30.0)


def test_straight_with_more_workers_than_layers() -> None:
    c = costs([1, 2])
    assert partition(c, num_workers=3, model=CostModel(BANDWIDTH), straight=True) is None
    fewer = partition(
        c, num_workers=3, model=CostModel(BANDWIDTH), straight=True, use_fewer_workers=True
    )
    assert spans(fewer) == [(0, 0, 1), (1, 1, 1)]


def test_fewer_workers_when_extra_replicas_only_cost() -> None:
    # one layer with big params: replicating it only adds allreduce time
    c = costs([10], params=[1e6])
    assert spans(partition(c, num_workers=4, model=CostModel(BANDWIDTH))) == [(0, 0, 4)]
    fewer = partition(c, num_workers=4, model=CostModel(BANDWIDTH), use_fewer_workers=True)
    assert spans(fewer) == [(0, 0, 1)]
    assert fewer.time_ms == pytest.approx(10.0)


def test_memory_limit_changes_the_answer() -> None:
    # one stage x2: in flight 1, 1 version: 2 x 20 + 200 = 240 B, time (40 + 0.02) / 2.
    # straight: stage 0 holds 2 in flight, 2 versions: 3 x 10 + 2 x 100 = 230; stage 1: 120.
    c = costs([10, 30], params=[10, 10], acts=[100, 100])
    model = CostModel(BANDWIDTH)
    memory = MemoryModel("pipedream")
    loose = partition(c, num_workers=2, model=model, memory_limit=240, memory_model=memory)
    assert spans(loose) == [(0, 1, 2)]
    assert loose.time_ms == pytest.approx(20.01)
    tight = partition(c, num_workers=2, model=model, memory_limit=235, memory_model=memory)
    assert spans(tight) == [(0, 0, 1), (1, 1, 1)]
    assert tight.time_ms == pytest.approx(30.0)
    assert partition(c, num_workers=2, model=model, memory_limit=100, memory_model=memory) is None


# ---------------------------------------------------------------- brute force on random cases


def all_partitions(n: int, workers: int, *, straight: bool, fewer: bool):
    """Every tiling of n layers into stages with replica counts summing to workers (or less)."""
    for num_cuts in range(n):
        for cuts in itertools.combinations(range(1, n), num_cuts):
            bounds = [0, *cuts, n]
            layer_spans = [(bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1)]
            choices = [1] if straight else range(1, workers + 1)
            for reps in itertools.product(choices, repeat=len(layer_spans)):
                total = sum(reps)
                if total == workers or (fewer and total < workers):
                    yield [(a, b, r) for (a, b), r in zip(layer_spans, reps)]


def brute_force(c, workers, model, *, straight=False, fewer=False, limit=None, schedule=None):
    best = math.inf
    for stages in all_partitions(c.num_layers, workers, straight=straight, fewer=fewer):
        if limit is not None:
            memory = MemoryModel(schedule, model.microbatches)
            before, fits = 0, True
            for a, b, r in stages:
                fits &= (
                    memory.stage_bytes(
                        c, first=a, last=b, workers_from=workers - before, replicas=r
                    )
                    <= limit
                )
                before += r
            if not fits:
                continue
        best = min(best, model.pipeline_ms(c, stages=stages))
    return best


def random_costs(rng: random.Random, n: int) -> LayerCosts:
    return LayerCosts(
        compute_ms=tuple(rng.choice([0.0, rng.uniform(0, 20)]) for _ in range(n)),
        parameter_bytes=tuple(rng.choice([0.0, rng.uniform(0, 2e7)]) for _ in range(n)),
        activation_bytes=tuple(rng.uniform(0, 1e7) for _ in range(n)),
        optimizer_state_bytes=tuple(rng.choice([0.0, rng.uniform(0, 1e7)]) for _ in range(n)),
        boundary_bytes=tuple(rng.uniform(0, 2e7) for _ in range(n - 1)),
    )


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n, workers = rng.randint(1, 8), rng.randint(1, 6)
    c = random_costs(rng, n)
    model = CostModel(rng.choice([1e9, 1e10]), microbatches=rng.choice([1, 1, 3]))
    for straight, fewer in itertools.product([False, True], repeat=2):
        result = partition(
            c, num_workers=workers, model=model, straight=straight, use_fewer_workers=fewer
        )
        expected = brute_force(c, workers, model, straight=straight, fewer=fewer)
        if math.isinf(expected):
            assert result is None
            continue
        assert result is not None
        assert result.time_ms == pytest.approx(expected, rel=1e-9, abs=1e-12)
        # the reported partition really has the reported time, and is a valid tiling
        assert model.pipeline_ms(c, stages=result.as_tuples()) == pytest.approx(result.time_ms)
        assert result.stages[0].first == 0 and result.stages[-1].last == n - 1
        for left, right in zip(result.stages, result.stages[1:]):
            assert right.first == left.last + 1
        assert result.num_workers == workers or (fewer and result.num_workers < workers)
        if straight:
            assert all(stage.replicas == 1 for stage in result.stages)


@pytest.mark.parametrize("seed", range(25))
def test_dp_by_stage_count_matches_brute_force(seed: int) -> None:
    rng = random.Random(500 + seed)
    n, workers = rng.randint(1, 8), rng.randint(1, 6)
    c = random_costs(rng, n)
    model = CostModel(1e9, microbatches=rng.choice([1, 4]))
    for straight, fewer in itertools.product([False, True], repeat=2):
        expected: dict[int, float] = {}
        for stages in all_partitions(n, workers, straight=straight, fewer=fewer):
            time = model.pipeline_ms(c, stages=stages)
            expected[len(stages)] = min(expected.get(len(stages), math.inf), time)
        found = partition_by_stage_count(
            c, num_workers=workers, model=model, straight=straight, use_fewer_workers=fewer
        )
        assert sorted(found) == sorted(expected)
        for count, result in found.items():
            assert len(result.stages) == count
            assert result.time_ms == pytest.approx(expected[count], rel=1e-9, abs=1e-12)
            assert model.pipeline_ms(c, stages=result.as_tuples()) == pytest.approx(result.time_ms)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("schedule", ["pipedream", "2bw", "1f1b", "gpipe"])
def test_dp_with_memory_limit_matches_brute_force(seed: int, schedule: str) -> None:
    rng = random.Random(1000 + seed)
    n, workers = rng.randint(1, 7), rng.randint(1, 5)
    c = random_costs(rng, n)
    microbatches = 1 if schedule == "pipedream" else rng.randint(1, 4)
    model = CostModel(1e9, microbatches=microbatches)
    memory = MemoryModel(schedule, microbatches)
    whole = memory.stage_bytes(c, first=0, last=n - 1, workers_from=workers, replicas=1)
    limit = rng.uniform(0.1, 1.0) * whole
    result = partition(c, num_workers=workers, model=model, memory_limit=limit, memory_model=memory)
    expected = brute_force(c, workers, model, limit=limit, schedule=schedule)
    if math.isinf(expected):
        assert result is None
    else:
        assert result is not None
        assert result.time_ms == pytest.approx(expected, rel=1e-9)


def test_stage_span_is_frozen() -> None:
    with pytest.raises(AttributeError):
        StageSpan(0, 1, 1).first = 2  # type: ignore[misc]
