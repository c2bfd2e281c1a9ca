"""The planner for schedules that run several stages per worker (interleaved-1f1b, zbv), and
memory read off the action tables (those two and zb-h1).

A toy of 8 layers of 10 ms (forward 5, backward 5), no parameters, nothing sent, 100 B saved per
layer, on 2 workers. With stages of equal time ``t`` the simulated times are the schedules'
formulas: 1F1B ``(m + S - 1) t``, interleaved ``(v m + P - 1) t`` on stages of ``t = 80 / (v P)``
ms, ZB-H1 ``m (F + B) + (S - 1)(F + I - W)`` with I = W = B / 2.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from test_optimizer_hierarchy import random_costs
from test_optimizer_schedules import profile_of

from pipedream.errors import PlanningError
from pipedream.formats import LayerProfile, Plan, Profile, StagePlan, Topology
from pipedream.formats.profile import ActionOverhead, TiedParameter
from pipedream.optimizer.cost_model import COST_MODELS, LayerCosts
from pipedream.optimizer.placed import (
    balanced_spans,
    copy_counts,
    default_placed_microbatches,
    stage_times,
)
from pipedream.optimizer.planner import PlanOptions, plan_profile
from pipedream.optimizer.report import format_summary
from pipedream.optimizer.tied_costs import TiedLayers
from pipedream.optimizer.tree import Cluster
from pipedream.optimizer.verify import simulated_ms

EIGHT = profile_of([10] * 8, [0] * 8, [0] * 8, acts=[100] * 8)
TWO_WORKERS = Topology.single_level(2, 1e9)


def _plan(schedule: str, m: int, **options):
    return plan_profile(
        EIGHT,
        topology=TWO_WORKERS,
        options=PlanOptions(schedule=schedule, microbatches=m, **options),
    )


def _compute(values: list[float]) -> np.ndarray:
    prefix = np.concatenate(([0.0], np.cumsum(values)))
    spans = prefix[None, 1:] - prefix[:-1, None]
    return np.where(np.tri(len(values), dtype=bool).T, spans, np.inf)


def test_balanced_spans_minimise_the_slowest_stage() -> None:
    costs = _compute([1, 1, 1, 1, 4, 1, 1])
    assert balanced_spans(costs, 3) == [(0, 3), (4, 4), (5, 6)]  # 4, 4, 2
    assert balanced_spans(costs, 2) == [(0, 3), (4, 6)]  # 4, 6
    assert balanced_spans(costs, 7) == [(i, i) for i in range(7)]
    with pytest.raises(ValueError, match="cannot cut 7 layers into 8"):
        balanced_spans(costs, 8)


@pytest.mark.parametrize(
    ("schedule", "m", "virtual", "ranks", "time_ms", "memory"),
    [
        # (2 m + 1) x 20 ms; rank 0 holds at most 5 (m = 4) stage-microbatches of 200 B
        ("interleaved-1f1b", 2, 2, [0, 1, 0, 1], 100.0, [800, 600, 800, 600]),
        ("interleaved-1f1b", 4, 2, [0, 1, 0, 1], 180.0, [1000, 600, 1000, 600]),
        ("interleaved-1f1b", 4, 4, [0, 1] * 4, 170.0, [900, 700] * 4),  # (16 + 1) x 10
        ("zbv", 4, None, [0, 1, 1, 0], 170.0, [1000, 1200, 1200, 1000]),
        ("zbv", 8, None, [0, 1, 1, 0], 330.0, [1000, 1200, 1200, 1000]),
    ],
)
def test_placed_plans_balance_stages_place_them_and_simulate(
    schedule, m, virtual, ranks, time_ms, memory
) -> None:
    result = _plan(schedule, m, virtual_stages=virtual)
    plan = result.plan
    per_stage = 8 // len(ranks)
    assert [(s.first_layer, s.last_layer) for s in plan.stages] == [
        (f"l{i * per_stage}", f"l{i * per_stage + per_stage - 1}") for i in range(len(ranks))
    ]
    assert [s.ranks[0] for s in plan.stages] == ranks and plan.world_size == 2
    assert plan.prediction is not None and plan.prediction.method == "simulated"
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(time_ms)
    assert plan.prediction.memory_bytes == pytest.approx(memory)
    summary = format_summary(result, profile=EIGHT, topology=TWO_WORKERS, memory_limit=None)
    assert "each worker runs several stages" in summary


def test_interleaving_without_virtual_stages_keeps_the_fastest() -> None:
    # 2 stages per worker: (2 x 4 + 1) x 20 = 180 ms; 4 per worker: (4 x 4 + 1) x 10 = 170 ms
    plan = _plan("interleaved-1f1b", 4).plan
    assert plan.num_stages == 8
    assert plan.prediction is not None
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(170.0)


@pytest.mark.parametrize(
    ("schedule", "m", "time_ms", "memory"),
    [
        ("1f1b", 4, 200.0, [800, 400]),  # (4 + 1) x 40; 2 and 1 microbatches of 400 B
        # (4 x 40 + 20); F to W: 2 microbatches, and W's buffers for 1 (stage 0) or 2
        ("zb-h1", 4, 180.0, [1200, 1600]),
    ],
)
def test_split_backwards_hold_activations_until_w(schedule, m, time_ms, memory) -> None:
    plan = _plan(schedule, m, straight=True).plan
    assert plan.num_stages == 2 and plan.prediction is not None
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(time_ms)
    assert plan.prediction.memory_bytes == pytest.approx(memory)


def test_default_microbatches_fill_the_pipeline() -> None:
    assert [default_placed_microbatches(p) for p in (1, 2, 3, 4, 8)] == [4, 4, 6, 8, 16]
    assert _plan("zbv", None).plan.microbatches == 4


def test_a_placed_plan_that_does_not_fit_is_refused() -> None:
    with pytest.raises(
        PlanningError, match=r"leanest plan needs 1.2 KiB on one worker, the limit is 900 B"
    ):
        _plan("zbv", 4, memory=900.0)
    assert _plan("zbv", 4, memory=1200.0).plan.num_stages == 4


def test_auto_weighs_the_placed_schedules_with_the_others() -> None:
    result = plan_profile(EIGHT, topology=TWO_WORKERS, options=PlanOptions(schedule="auto"))
    times = {
        (o.schedule, o.microbatches): o.time_per_minibatch_ms
        for o in result.candidates
        if o.tree is not None
    }
    assert times[("interleaved-1f1b", 4)] == pytest.approx(180.0)  # 2 stages per worker
    assert times[("zbv", 4)] == pytest.approx(170.0)
    best = max(times, key=lambda key: key[1] / times[key])
    assert (result.plan.schedule, result.plan.microbatches) == best


def test_zb_h1_replicates_stages_when_that_is_faster() -> None:
    # no parameters: data parallelism is 4 x 80 / 2 = 160 ms against the pipeline's 180
    plan = _plan("zb-h1", 4).plan
    assert [(s.replicas, s.ranks) for s in plan.stages] == [(2, (0, 1))]
    assert plan.prediction is not None
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(160.0)


def test_copies_of_the_pipeline_when_the_allreduce_is_cheap() -> None:
    """8 layers of 10 ms with 4000 B of parameters each on 4 workers: at 1 GB/s two copies of
    a 2-worker V (their allreduce costs little) beat one V over all 4; at 100 kB/s one V."""
    assert [copy_counts(w) for w in (1, 2, 4, 6)] == [[1], [1], [1, 2], [1, 2, 3]]
    profile = profile_of([10] * 8, [4000] * 8, [0] * 8, acts=[100] * 8)
    fast = Topology.single_level(4, 1e9)
    plan = plan_profile(profile, topology=fast, options=PlanOptions("zbv", 4)).plan
    assert [(s.replicas, s.ranks) for s in plan.stages] == [
        (2, (0, 2)),
        (2, (1, 3)),
        (2, (1, 3)),
        (2, (0, 2)),
    ]
    slow = Topology.single_level(4, 1e5)
    plan = plan_profile(profile, topology=slow, options=PlanOptions("zbv", 4)).plan
    assert [s.ranks for s in plan.stages] == [(r,) for r in (0, 1, 2, 3, 3, 2, 1, 0)]


def _tied(*layers: str, size: int = 0) -> Profile:
    return replace(EIGHT, tied=(TiedParameter("embed.weight", layers, size),))


def _stage_ms(plan: Plan) -> tuple[float, ...]:
    assert plan.prediction is not None
    return plan.prediction.stage_ms


def _time(plan: Plan) -> float:
    assert plan.prediction is not None
    return plan.prediction.time_per_minibatch_ms


def test_a_tie_across_stages_costs_its_copy_and_its_messages() -> None:
    """A language model's tied embedding (l0) and output head (l7) of 400 kB, on 2 workers at
    10 MB/s: interleaving puts the head's copy on worker 1, which trades 40 ms messages with
    worker 0, so its best plan takes 240 ms instead of 170 (2 stages per worker instead of 4);
    the V puts the copy on worker 0 with its owner, where the exchanges cost no time (170 ms
    either way) and the worker holds the copy and its gradient (800 kB) besides the owner."""
    slow = Topology.single_level(2, 1e7)
    options = {"microbatches": 4, "straight": True}
    results = {
        (schedule, size): plan_profile(
            _tied("l0", "l7", size=size), topology=slow, options=PlanOptions(schedule, **options)
        )
        for schedule in ("interleaved-1f1b", "zbv")
        for size in (0, 400_000)
    }
    plans = {key: result.plan for key, result in results.items()}
    times = {key: _time(plan) for key, plan in plans.items()}
    assert times == {
        ("interleaved-1f1b", 0): 170.0,
        ("interleaved-1f1b", 400_000): 240.0,
        ("zbv", 0): 170.0,
        ("zbv", 400_000): 170.0,
    }
    # the stage table charges the V's first and last stage no trading either (4 MB would
    # take 200 ms per microbatch)
    big = _tied("l0", "l7", size=4_000_000)
    zbv_big = plan_profile(big, topology=slow, options=PlanOptions("zbv", **options)).plan
    assert _stage_ms(zbv_big) == _stage_ms(plans["zbv", 0]) == (20.0, 20.0, 20.0, 20.0)
    zbv = plans["zbv", 400_000]
    assert [s.ranks[0] for s in zbv.stages] == [0, 1, 1, 0]
    assert zbv.prediction is not None
    worker_0, worker_1 = 801_000.0, 1200.0  # every stage is charged its worker's memory
    assert zbv.prediction.memory_bytes == (worker_0, worker_1, worker_1, worker_0)
    summaries = {
        schedule: format_summary(
            results[schedule, 400_000],
            profile=_tied("l0", "l7", size=400_000),
            topology=slow,
            memory_limit=None,
        ).splitlines()
        for schedule in ("interleaved-1f1b", "zbv")
    }
    head = "tied embed.weight (390.6 KiB, layers l0, l7): owned by stage 0, copied on stage 3; "
    assert head + "stage 3 on the owner's workers: handed over in memory" in summaries["zbv"]
    assert any(
        line.startswith(head + "each update trades") for line in summaries["interleaved-1f1b"]
    )
    result = plan_profile(
        _tied("l0", "l7"), topology=TWO_WORKERS, options=PlanOptions("auto", microbatches=4)
    )
    assert {c.schedule: c.problem for c in result.candidates} == dict.fromkeys(
        ("1f1b", "gpipe", "2bw", "zb-h1", "zbv", "interleaved-1f1b"), ""
    )


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv", "auto"])
def test_straight_keeps_one_copy_of_the_pipeline(schedule: str) -> None:
    """--straight (no stage replicated) used to be ignored by the schedules that run several
    stages per worker: on 4 workers they planned two copies of a 2-worker pipeline."""
    four = Topology.single_level(4, 1e9)
    options = PlanOptions(schedule=schedule, microbatches=4, straight=True)
    plan = plan_profile(EIGHT, topology=four, options=options).plan
    assert all(stage.replicas == 1 for stage in plan.stages)
    assert sorted({stage.ranks[0] for stage in plan.stages}) == [0, 1, 2, 3]


def test_a_plan_too_big_to_simulate_is_not_the_leanest_that_does_not_fit() -> None:
    # every candidate of 16384 microbatches is too big to simulate: that is the reason, not
    # the memory of plans that were never candidates (it said "does not fit: its leanest ...")
    with pytest.raises(PlanningError, match="too big to simulate; use fewer microbatches"):
        _plan("zbv", 16384, memory=1.0)


@pytest.mark.parametrize("cost_model", COST_MODELS)
@pytest.mark.parametrize("seed", range(3))
def test_stage_times_are_the_cost_models_stage_costs(cost_model: str, seed: int) -> None:
    """The matrix computed at once holds, bit for bit, what the cost model gives each range
    (the cuts it balances must not change with rounding)."""
    rng = random.Random(seed)
    costs = random_costs(rng, 12)
    if seed:
        costs = replace(costs, tied=TiedLayers(((0, 11), (3, 5, 8)), (3e6, 1e6)))
    cluster = Cluster.from_topology(Topology.single_level(4, 1e9), cost_model=cost_model)
    model = cluster.model(0)
    expected = np.full((12, 12), np.inf)
    for i in range(12):
        for j in range(i, 12):
            expected[i, j] = model.stage_cost(costs, first=i, last=j, replicas=1).total_ms
    assert np.array_equal(stage_times(costs, cluster), expected)


def test_a_stage_adds_its_layers_left_to_right_on_every_python() -> None:
    """Python's sum() compensates rounding from 3.12 on: there the cost model's stage of these
    layers took 1.0000000000000002 ms and the planner's matrix 1.0 (added as np.cumsum adds),
    and test_stage_times_are_the_cost_models_stage_costs failed on Python 3.12."""
    costs = LayerCosts((1.0, 1e-16, 1e-16, 1e-16), (0.0,) * 4, (0.0,) * 4, (0.0,) * 4, (0.0,) * 3)
    cluster = Cluster.from_topology(Topology.single_level(4, 1e9), cost_model="pipedream")
    stage = cluster.model(0).stage_cost(costs, first=0, last=3, replicas=1)
    assert stage.compute_ms == stage_times(costs, cluster)[0, 3] == 1.0


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_the_data_parallel_line_is_simulated_as_the_plan_is(schedule: str) -> None:
    # the plan is simulated, and so is the line next to it: data parallelism under 1f1b with
    # the plan's microbatches, the line `--schedule 1f1b` prints for them (it once was the
    # formula, without the updates and the runtime's cost per action)
    layers = tuple(
        LayerProfile(f"l{i}", "Linear", 1.0, 2.0, 1000, 2**20, update_ms=0.5) for i in range(8)
    )
    overhead = ActionOverhead(forward_ms=0.1, backward_ms=0.2, update_ms=0.3)
    profile = Profile("toy", 8, "cpu", "float32", layers, overhead=overhead)
    topology = Topology.single_level(4, 1e9)
    placed = plan_profile(profile, topology=topology, options=PlanOptions(schedule)).plan
    assert placed.prediction is not None and placed.prediction.method == "simulated"
    m = placed.microbatches
    names = profile.layer_names
    data_parallel = Plan(
        "toy", "1f1b", 8, m, 4, (StagePlan(names[0], names[-1], 4, (0, 1, 2, 3)),), layers=names
    )
    expected = simulated_ms(data_parallel, profile, topology)
    assert expected is not None
    assert placed.prediction.data_parallel_time_per_minibatch_ms == pytest.approx(expected)
    onefoneb = plan_profile(
        profile, topology=topology, options=PlanOptions("1f1b", microbatches=m)
    ).plan
    assert onefoneb.prediction is not None
    assert onefoneb.prediction.data_parallel_time_per_minibatch_ms == pytest.approx(expected)
    # 8 layers of 3 ms and 0.5 ms of update, 0.1 + 0.2 + 0.3 ms per action, allreduce of
    # 8 MiB on 4 replicas (the formula said (24 m + allreduce) / 4)
    allreduce = 3 * 8 * 2**20 / 1e9 * 1e3
    assert expected == pytest.approx((m * (24 + 0.3) + 4 + 0.3 + allreduce) / 4)
