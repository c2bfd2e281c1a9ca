"""Schedule awareness: bubbles, versions and in-flight memory, ``--schedule auto``."""

from __future__ import annotations

import math

import pytest

from pipedream.errors import PlanningError
from pipedream.formats import LayerProfile, Profile, Topology
from pipedream.optimizer import search, verify
from pipedream.optimizer.cost_model import LayerCosts, minibatch_ms
from pipedream.optimizer.memory import Context, MemoryModel
from pipedream.optimizer.planner import PlanOptions, make_plan, plan_profile
from pipedream.schedules import Op, PipelineSpec, build_tables


def test_minibatch_time_by_schedule_by_hand() -> None:
    # slowest stage 10 ms per microbatch, 3 stages
    assert minibatch_ms("pipedream", 10.0, microbatches=1, num_stages=3) == 10.0
    assert minibatch_ms("pipedream-vs", 10.0, microbatches=1, num_stages=3) == 10.0
    assert minibatch_ms("2bw", 10.0, microbatches=4, num_stages=3) == 40.0
    assert minibatch_ms("1f1b", 10.0, microbatches=4, num_stages=3) == 60.0  # (4 + 2) x 10
    assert minibatch_ms("gpipe", 10.0, microbatches=4, num_stages=3) == 60.0


def _in_flight_and_versions(spec: PipelineSpec) -> dict[int, tuple[int, int]]:
    """(max microbatches whose backward is pending, max distinct weight versions) per rank."""
    found = {}
    for rank, table in build_tables(spec).items():
        pending: dict[int, int] = {}  # microbatch -> version
        peak = versions = 0
        for action in table:
            if action.op is Op.FORWARD:
                pending[action.index] = action.version or 0
            elif action.op is Op.BACKWARD:
                pending.pop(action.index)
            peak = max(peak, len(pending))
            versions = max(versions, len(set(pending.values())))
        found[rank] = (peak, versions)
    return found


@pytest.mark.parametrize(
    "replicas", [(1,), (1, 1), (1, 1, 1, 1), (2, 1), (1, 2), (3, 1, 1), (2, 2), (1, 3)]
)
@pytest.mark.parametrize(
    ("schedule", "m"), [("pipedream", 1), ("2bw", 4), ("1f1b", 3), ("gpipe", 3)]
)
def test_memory_model_matches_the_runtime_tables(replicas, schedule: str, m: int) -> None:
    ranks, rank = [], 0
    for r in replicas:
        ranks.append(tuple(range(rank, rank + r)))
        rank += r
    if schedule == "2bw" and m < len(replicas):
        m = len(replicas)
    period = math.lcm(*replicas)
    spec = PipelineSpec(schedule, tuple(ranks), m, period * 12)
    actual = _in_flight_and_versions(spec)
    model = MemoryModel(schedule, m)
    world = sum(replicas)
    before = 0
    for stage, r in enumerate(replicas):
        predicted = model.in_flight(workers_from=world - before, replicas=r)
        measured = max(actual[rank][0] for rank in ranks[stage])
        if schedule == "pipedream" or all(x == 1 for x in replicas):
            assert predicted == measured, (stage, predicted, measured)
        else:  # the planner's bound (it does not know the stages that follow)
            assert predicted >= measured, (stage, predicted, measured)
        if schedule == "pipedream":  # weight stashing: one version per minibatch in flight
            stashed = max(actual[rank][1] for rank in ranks[stage])
            assert model.weight_versions(workers_from=world - before, replicas=r) >= stashed
        before += r


def test_memory_context_of_an_inner_pipeline() -> None:
    # a stage with 1 of a unit's 2 workers, the unit pipeline replicated 2x and followed by 4
    # workers: R = 2, W_from = 2 * 2 + 4 = 8, in flight ceil(8 / 2) = 4
    context = Context(mult=2, after=4)
    assert MemoryModel("pipedream").in_flight(workers_from=2, replicas=1, context=context) == 4
    # 1f1b: stages from here <= (2 - 1 + 1) + 4 = 6, capped by m
    assert MemoryModel("1f1b", 5).in_flight(workers_from=2, replicas=1, context=context) == 5
    assert MemoryModel("2bw", 8).in_flight(workers_from=2, replicas=1, context=context) == 6
    inner = Context().inner(replicas=2, after_units=1, unit_workers=4)
    assert inner == Context(mult=2, after=4)


def profile_of(compute: list[float], params: list[int], outputs: list[int], acts=None) -> Profile:
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            type="Linear",
            forward_ms=ms / 2,
            backward_ms=ms / 2,
            output_bytes=out,
            parameter_bytes=p,
            saved_bytes=None if acts is None else acts[i],
        )
        for i, (ms, p, out) in enumerate(zip(compute, params, outputs))
    )
    return Profile("toy", 1, "cpu", "float32", layers)


# Two layers of 10 ms with 2000 B of parameters each, nothing between them, 2 workers at
# 1e6 B/s: allreduce(4000 B, 2) = 4 * 1 * 4000 / (1e6 * 2) s = 8 ms.
#   straight:       10 ms per microbatch
#   data parallel:  (20 + 8 / m) / 2 per microbatch
TWO = profile_of([10, 10], [2000, 2000], [0, 0])
CLUSTER = Topology.single_level(2, 1e6)


@pytest.mark.parametrize(
    ("schedule", "m", "stages", "expected"),
    [
        ("pipedream", 1, 2, 10.0),  # straight 10 < data parallel 14
        ("2bw", 2, 2, 20.0),  # 2 x 10 < 2 x (20 + 4) / 2 = 24
        ("1f1b", 2, 1, 24.0),  # flush: (2 + 1) x 10 = 30 > data parallel 24
        ("gpipe", 2, 1, 24.0),
        ("1f1b", 8, 1, 84.0),  # 8 x (20 + 1) / 2 = 84 < (8 + 1) x 10 = 90
    ],
)
def test_predictions_depend_on_the_schedule(schedule, m, stages, expected) -> None:
    plan = make_plan(TWO, topology=CLUSTER, options=PlanOptions(schedule=schedule, microbatches=m))
    assert plan.prediction is not None and plan.num_stages == stages
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(expected)
    assert plan.prediction.throughput_samples_per_s == pytest.approx(m * 1e3 / expected)


def test_auto_picks_the_fastest_schedule_and_microbatches() -> None:
    # per microbatch: pipedream and 2bw (straight) 10 ms; 1f1b/gpipe at best (m + 1) x 10 / m
    # or (20 + 8 / m) / 2: slower for every m. 2bw ties pipedream and comes first, smallest m.
    result = plan_profile(TWO, topology=CLUSTER, options=PlanOptions(schedule="auto"))
    assert (result.plan.schedule, result.plan.microbatches) == ("2bw", 2)
    assert result.plan.prediction is not None
    assert result.plan.prediction.time_per_minibatch_ms == pytest.approx(20.0)
    tried = {(o.schedule, o.microbatches) for o in result.candidates}
    assert ("pipedream", 1) in tried and ("gpipe", 32) in tried and ("zb-h1", 8) in tried
    # pipedream, pipedream-vs, then 5 m each for 2bw 1f1b gpipe zb-h1 interleaved-1f1b zbv
    assert ("interleaved-1f1b", 2) in tried and ("zbv", 32) in tried and len(tried) == 32
    # with the minibatch pinned, only schedules that take it
    pinned = plan_profile(
        TWO, topology=CLUSTER, options=PlanOptions(schedule="auto", microbatches=4)
    )
    assert {o.microbatches for o in pinned.candidates} == {4}
    assert pinned.plan.schedule == "2bw"


def test_auto_solves_each_dynamic_program_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a memory limit the schedules of one m pose one problem (2bw, 1f1b, gpipe and
    zb-h1 counted by stages; pipedream and pipedream-vs at m = 1): solved once, each
    schedule's answer as if solved alone. With a limit the schedules' memory differs, and
    each is solved on its own."""
    calls: list[tuple[int, bool, bool]] = []
    real = search.solve_cluster

    def counted(costs, cluster, **options):  # type: ignore[no-untyped-def]
        calls.append((cluster.microbatches, options["by_stage_count"], options["straight"]))
        return real(costs, cluster, **options)

    def request(memory_limit: float | None = None) -> search.Request:
        costs = LayerCosts.from_profile(TWO)
        return search.Request(costs, CLUSTER, "symmetric", memory_limit=memory_limit)

    monkeypatch.setattr(search, "solve_cluster", counted)
    outcomes = search.solve_auto(request(), microbatches=None)
    assert sorted(calls) == [(1, False, False)] + [(m, True, False) for m in (2, 4, 8, 16, 32)]
    assert len(outcomes) == 2 + 4 * 5
    for outcome in outcomes:
        alone = search.solve_schedule(
            request(), schedule=outcome.schedule, microbatches=outcome.microbatches
        )
        assert alone == outcome
    calls.clear()
    search.solve_auto(request(memory_limit=1e9), microbatches=None)
    assert len(calls) == 2 + 4 * 5


def test_auto_respects_memory() -> None:
    # 20 ms of compute, 1 MB saved per microbatch, no parameters, one worker: every schedule
    # takes 20 ms per microbatch; gpipe holds all m microbatches, 1f1b/2bw only one
    profile = profile_of([20], [0], [0], acts=[1_000_000])
    topology = Topology.single_level(1, 1e9, memory=2.5e6)
    result = plan_profile(profile, topology=topology, options=PlanOptions(schedule="auto"))
    fits = {(o.schedule, o.microbatches) for o in result.candidates if o.tree is not None}
    assert ("gpipe", 2) in fits and ("gpipe", 4) not in fits and ("1f1b", 32) in fits
    assert result.plan.schedule == "1f1b" and result.plan.microbatches == 2  # ties: 1f1b, small m


def test_memory_limit_excludes_plans_and_is_reported() -> None:
    # 2 layers, 1 MB of parameters each, 2 workers. Straight pipedream: stage 0 keeps 2
    # minibatches in flight (2 versions + gradients = 3 MB), stage 1 one (2 MB).
    profile = profile_of([10, 10], [1_000_000, 1_000_000], [0, 0], acts=[0, 0])
    loose = make_plan(
        profile, topology=Topology.single_level(2, 1e12, memory=3e6), options=PlanOptions()
    )
    assert loose.num_stages == 2 and loose.prediction is not None
    assert loose.prediction.memory_bytes == (3e6, 2e6)
    # 2.5 MB: straight needs 3 MB at stage 0 and data parallelism 4 MB (one version and the
    # gradients of both layers): nothing fits
    with pytest.raises(PlanningError, match="fits in 2.4 MiB"):
        make_plan(
            profile, topology=Topology.single_level(2, 1e12), options=PlanOptions(memory=2.5e6)
        )
    # --memory overrides the topology's memory
    assert (
        make_plan(
            profile,
            topology=Topology.single_level(2, 1e12, memory=1e3),
            options=PlanOptions(memory=3e6),
        ).prediction
        is not None
    )


def test_2bw_with_given_microbatches_keeps_at_most_that_many_stages() -> None:
    profile = profile_of([10] * 6, [0] * 6, [0] * 6)
    plan = make_plan(
        profile,
        topology=Topology.single_level(6, 1e9),
        options=PlanOptions(schedule="2bw", microbatches=3, straight=True, use_fewer_workers=True),
    )
    assert plan.num_stages == 3 and plan.microbatches == 3
    assert plan.prediction is not None
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(3 * 20.0)


# ---------------------------------------------------------------- why nothing is feasible

MB = 1_000_000
# 2 layers of 1 MB of parameters, nothing else, on 2 workers. 2bw keeps 2 weight versions and
# the gradients: a stage of one layer needs 3 MB, a stage of both (data parallelism) 6 MB.
TWO_MB = profile_of([10, 10], [MB, MB], [0, 0], acts=[0, 0])
ONE_PER_STAGE = "2bw needs at least one microbatch per stage"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # the memory alone: 2bw's default microbatches follow the stages, and 2 microbatches
        # allow both plans (it blamed the microbatches: "every plan has more than 4 stages")
        (
            {"memory": 1000.0},
            "no partition of 2 layers over 2 workers fits in 1000 B per worker (schedule 2bw, "
            "estimated memory); raise --memory or add workers",
        ),
        (
            {"memory": 1000.0, "microbatches": 2},
            "no partition of 2 layers over 2 workers fits in 1000 B per worker (schedule 2bw, "
            "estimated memory); raise --memory or add workers",
        ),
        # the microbatches alone: --straight on 2 workers is 2 stages
        (
            {"microbatches": 1, "straight": True},
            f"--microbatches 1 with schedule 2bw: every plan has at least 2 stages and "
            f"{ONE_PER_STAGE}; use --microbatches 2 or more",
        ),
        # both, each ruling out every plan
        (
            {"microbatches": 1, "straight": True, "memory": 1000.0},
            f"--microbatches 1 with schedule 2bw: every plan has at least 2 stages and "
            f"{ONE_PER_STAGE}, and none fits in 1000 B per worker (estimated memory); use "
            "--microbatches 2 or more, and raise --memory or add workers",
        ),
        # both together: data parallelism (1 stage) needs 6 MB, the 2 stages that fit are
        # more than 1 microbatch
        (
            {"microbatches": 1, "memory": 4e6},
            f"--microbatches 1 with schedule 2bw: the plans of at most 1 stage ({ONE_PER_STAGE})"
            " do not fit in 3.8 MiB per worker (estimated memory), and those that fit have 2 or "
            "more; use --microbatches 2 or more, or raise --memory",
        ),
    ],
)
def test_2bw_says_what_rules_its_plans_out(options: dict, message: str) -> None:
    with pytest.raises(PlanningError) as error:
        make_plan(
            TWO_MB,
            topology=Topology.single_level(2, 1e12),
            options=PlanOptions(schedule="2bw", **options),
        )
    assert str(error.value) == message
    # the limit is what was checked: without it (or with room) there is a plan
    if "memory" in options and "straight" not in options:
        roomy = PlanOptions(schedule="2bw", **{**options, "memory": 6e6})
        assert make_plan(TWO_MB, topology=Topology.single_level(2, 1e12), options=roomy)


FOUR_MB = profile_of([10] * 4, [MB] * 4, [0] * 4, acts=[0] * 4)
EIGHT_MB = profile_of([10] * 8, [MB] * 8, [0] * 8, acts=[0] * 8)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # every schedule, every microbatch count: one reason, named once (it was repeated for
        # each schedule and count, and 2bw's blamed the microbatches)
        (
            {"memory": 1000.0},
            "--schedule auto: no schedule has a feasible plan: no plan fits in 1000 B per worker "
            "(1f1b, gpipe, 2bw, pipedream, pipedream-vs, interleaved-1f1b, zb-h1, zbv); raise "
            "--memory or add workers",
        ),
        # 2bw is ruled out twice over (4 straight stages, 1 microbatch); each reason once, with
        # the schedules it rules out
        (
            {"memory": 1000.0, "microbatches": 1, "straight": True},
            "--schedule auto: no schedule has a feasible plan: no plan fits in 1000 B per worker "
            "(1f1b, gpipe, 2bw, pipedream, pipedream-vs, zb-h1, zbv); every plan has more stages "
            "than microbatches (2bw); raise --memory or add workers; use --microbatches 4 or more",
        ),
        # where a reason rules out only some of the counts tried, it says which (and its fix,
        # more microbatches, is no fix: the others failed too)
        (
            {"memory": 1000.0, "straight": True},
            "--schedule auto: no schedule has a feasible plan: no plan fits in 1000 B per worker "
            "(1f1b, gpipe, 2bw, pipedream, pipedream-vs, interleaved-1f1b, zb-h1, zbv); every "
            "plan has more stages than microbatches (2bw at 2 microbatches); raise --memory or "
            "add workers",
        ),
    ],
)
def test_auto_names_each_reason_once(options: dict, message: str) -> None:
    with pytest.raises(PlanningError) as error:
        plan_profile(
            EIGHT_MB,
            topology=Topology.single_level(4, 1e12),
            options=PlanOptions("auto", **options),
        )
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("workers", "options", "expected"),
    [
        (4, {}, ""),  # every schedule at every count
        (
            3,
            {"microbatches": 4},
            "pipedream, pipedream-vs (one microbatch per minibatch, not 4); interleaved-1f1b "
            "(microbatches not a multiple of a pipeline copy's workers, 3)",
        ),
        (
            4,
            {"straight": True},
            "interleaved-1f1b at 2 microbatches (microbatches not a multiple of a pipeline "
            "copy's workers, 4)",
        ),
        # too big to simulate (below, at most 16 actions simulated): the closed forms
        # compare, without the schedules that only a simulation predicts
        (
            2,
            {"microbatches": 8},
            "pipedream, pipedream-vs (one microbatch per minibatch, not 8); "
            "interleaved-1f1b, zbv (compared only by simulation, and the other plans are too "
            "big to simulate)",
        ),
    ],
)
def test_auto_says_which_schedules_it_did_not_compare(
    workers: int, options: dict, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "too big" in expected:  # as 16384 microbatches are, in a twentieth of the time
        monkeypatch.setattr(verify, "MAX_SIMULATED_ACTIONS", 16)
    result = plan_profile(
        FOUR_MB,
        topology=Topology.single_level(workers, 1e9),
        options=PlanOptions("auto", **options),
    )
    assert result.not_compared == expected
    tried = {outcome.schedule for outcome in result.candidates}
    left_out = {"pipedream", "pipedream-vs", "interleaved-1f1b", "zbv"} - tried
    assert all(name in expected for name in left_out)
