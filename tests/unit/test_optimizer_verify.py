"""The planner simulates plans whose formula is not exact (replicated stages in a pipeline,
m > 1, split backwards)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipedream.cli import main
from pipedream.formats import LayerProfile, Plan, Profile, StagePlan, Topology, save_profile
from pipedream.formats.plan import Prediction
from pipedream.formats.profile import ActionOverhead
from pipedream.formats.topology import Level
from pipedream.optimizer import verify
from pipedream.optimizer.planner import PlanOptions, make_plan, plan_profile
from pipedream.optimizer.simulator import Event, Timeline, default_steps
from pipedream.optimizer.verify import (
    needs_simulation,
    one_stage_ms,
    planner_network,
    simulated_ms,
    simulation_work,
)
from pipedream.profiler.pipedream_import import import_pipedream_graph

VGG16 = Path(__file__).resolve().parents[1] / "data" / "pipedream-profiles" / "vgg16.txt"


@pytest.fixture(scope="module")
def vgg16() -> Profile:
    return import_pipedream_graph(VGG16)


def _plan(schedule: str, m: int, stages: tuple[StagePlan, ...]) -> Plan:
    world = sum(stage.replicas for stage in stages)
    return Plan("vgg16", schedule, 128, m, world, stages)


def test_pipelines_replicas_under_microbatches_and_split_backwards_are_simulated() -> None:
    straight = (StagePlan("a", "b", 1, (0,)), StagePlan("c", "d", 1, (1,)))
    replicated = (StagePlan("a", "b", 2, (0, 1)), StagePlan("c", "d", 1, (2,)))
    data_parallel = (StagePlan("a", "d", 3, (0, 1, 2)),)
    one = (StagePlan("a", "d", 1, (0,)),)
    # the default cost model (a plan without a prediction has it)
    for schedule, m in (("pipedream", 1), ("1f1b", 4), ("2bw", 2), ("zb-h1", 1)):
        assert needs_simulation(_plan(schedule, m, straight))
        assert needs_simulation(_plan(schedule, m, replicated))
    assert not needs_simulation(_plan("pipedream", 1, data_parallel))
    assert not needs_simulation(_plan("1f1b", 4, one))
    assert needs_simulation(_plan("1f1b", 4, data_parallel))
    # the original optimizer's arithmetic keeps its formula, but for replicas under several
    # microbatches and split backwards (one microbatch of zb-h1 was left to the formula once)
    original = Prediction(1.0, 1.0, 0, (1.0, 1.0), (1.0, 1.0), 1.0, cost_model="pipedream")

    def under_original(schedule: str, m: int, stages: tuple[StagePlan, ...]) -> bool:
        return needs_simulation(replace(_plan(schedule, m, stages), prediction=original))

    assert not under_original("pipedream", 1, replicated)
    assert not under_original("1f1b", 4, straight)
    assert under_original("1f1b", 4, replicated)
    assert under_original("zb-h1", 1, straight)


def test_the_formula_is_wrong_for_a_replicated_stage_under_a_flush(vgg16: Profile) -> None:
    # what the dynamic program picks by formula for 1f1b, m = 4 on 4 workers: a 3-1 split
    # predicted at 1027.6 ms per minibatch; the runtime's tables take 1846.7 ms
    split = (
        StagePlan("node1", "node18", 3, (0, 1, 2)),
        StagePlan("node19", "node41", 1, (3,)),
    )
    simulated = simulated_ms(_plan("1f1b", 4, split), vgg16, Topology.single_level(4, 1e9))
    assert simulated == pytest.approx(1846.676, abs=1e-3)


def test_the_planner_keeps_the_fastest_simulated_plan(vgg16: Profile) -> None:
    topology = Topology.single_level(4, 1e9)
    plan = make_plan(vgg16, topology=topology, options=PlanOptions(schedule="1f1b"))
    assert plan.prediction is not None
    # data parallelism (simulated 1087.6 ms) beats both the 3-1 split and a straight pipeline
    assert [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages] == [
        ("node1", "node41", 4)
    ]
    assert plan.prediction.method == "simulated"
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(1087.608, abs=1e-3)
    assert plan.prediction.data_parallel_time_per_minibatch_ms == pytest.approx(1087.608, abs=1e-3)
    assert plan.to_dict()["prediction"]["method"] == "simulated"
    assert Plan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()
    # PipeDream's own schedule: its 3-1 split stays the fastest; the original optimizer's
    # arithmetic keeps the formula's time
    for cost_model, method, ms in (
        ("symmetric", "simulated", 202.194),
        ("pipedream", "closed-form", 205.521),
    ):
        options = PlanOptions(schedule="pipedream", cost_model=cost_model)
        async_plan = make_plan(vgg16, topology=topology, options=options)
        assert [s.replicas for s in async_plan.stages] == [3, 1]
        assert async_plan.prediction is not None
        assert async_plan.prediction.method == method
        assert async_plan.prediction.time_per_minibatch_ms == pytest.approx(ms, abs=1e-3)


def test_a_straight_pipeline_of_equal_stages_simulates_to_the_formula() -> None:
    """Equal stages, free transfers: the formula's (m + S - 1) slots of 3 ms are exact."""
    layers = tuple(LayerProfile(f"l{i}", "Linear", 1.0, 2.0, 1000, 1000) for i in range(4))
    profile = Profile("toy", 8, "cpu", "float32", layers)
    for cost_model, method in (("symmetric", "simulated"), ("pipedream", "closed-form")):
        plan = make_plan(
            profile,
            topology=Topology.single_level(4, 1e12),
            options=PlanOptions("gpipe", microbatches=4, straight=True, cost_model=cost_model),
        )
        assert plan.prediction is not None and plan.prediction.method == method
        assert plan.prediction.time_per_minibatch_ms == pytest.approx((4 + 4 - 1) * 3.0)


def _busy(num_layers: int = 2, *, activation_bytes: int = 10**8, params: int = 2**20) -> Profile:
    """Layers of 1 ms forward, 2 ms backward and 0.5 ms update, with the runtime's costs per
    action: what the formula leaves out and the simulation charges."""
    layers = tuple(
        LayerProfile(f"l{i}", "Linear", 1.0, 2.0, activation_bytes, params, update_ms=0.5)
        for i in range(num_layers)
    )
    overhead = ActionOverhead(
        forward_ms=0.1,
        backward_ms=0.2,
        update_ms=0.3,
        copy_ms_per_mib=0.25,
        accumulate_ms_per_mib=0.125,
        inputs_ms=0.05,
        targets_ms=0.04,
        loss_forward_ms=0.03,
        loss_backward_ms=0.06,
    )
    return Profile("toy", 8, "cpu", "float32", layers, overhead=overhead)


THREE_LEVELS = Topology((Level("gpu", 2, 1e10), Level("host", 2, 1e9), Level("rack", 2, 1e8)))


@pytest.mark.parametrize(
    ("schedule", "m"),
    [
        ("pipedream", 1),
        ("pipedream-vs", 1),
        ("2bw", 1),
        ("2bw", 3),
        ("1f1b", 1),
        ("1f1b", 3),
        ("gpipe", 4),
        ("zb-h1", 3),
    ],
)
def test_one_stage_formula_is_its_simulation(vgg16: Profile, schedule: str, m: int) -> None:
    # every replica alone but for the allreduce: the sum of its actions, whatever the
    # schedule (2bw copies its weights at every update), the levels or the ranks
    cases = [
        (Topology.single_level(1, 1e9), (0,)),
        (Topology.single_level(4, 1e9), (0, 1, 2, 3)),
        (Topology.single_level(4, 1e9), (0, 1, 2)),  # --fewer-workers
        (THREE_LEVELS, tuple(range(8))),
        (THREE_LEVELS, (0, 1, 2, 3, 4, 5)),
    ]
    for profile in (_busy(), vgg16):
        names = profile.layer_names
        for topology, ranks in cases:
            stage = StagePlan(names[0], names[-1], len(ranks), ranks)
            plan = Plan("toy", schedule, 8, m, topology.num_workers, (stage,), layers=names)
            expected = simulated_ms(plan, profile, topology)
            assert expected is not None
            got = one_stage_ms(plan, profile, planner_network(topology))
            assert got == pytest.approx(expected, rel=1e-9), (profile.workload, topology, ranks)


def test_single_stage_plans_predict_what_they_simulate() -> None:
    profile = _busy()
    one = Topology.single_level(1, 1e9)
    # F 2 + 0.1 + 0.05 inputs + 0.04 targets + 0.03 loss, B 4 + 0.2 + 0.06 loss, U 1 + 0.3:
    # the formula said 6.0 (the layers' forward and backward alone)
    expected = {
        ("pipedream", 1): 7.78,
        ("1f1b", 2): 2 * 6.48 + 0.25 + 1.3,  # one gradient added into .grad (2 MiB)
        ("gpipe", 2): 2 * 6.48 + 0.25 + 1.3,
        ("2bw", 2): 2 * 6.48 + 0.25 + 1.3 + 0.5,  # and a stashed copy of the 2 MiB weights
    }
    for (schedule, m), time_ms in expected.items():
        plan = make_plan(profile, topology=one, options=PlanOptions(schedule, microbatches=m))
        assert plan.prediction is not None and plan.prediction.method == "closed-form"
        assert plan.prediction.time_per_minibatch_ms == pytest.approx(time_ms, abs=1e-9)
        assert plan.prediction.data_parallel_time_per_minibatch_ms == pytest.approx(time_ms)
        assert simulated_ms(plan, profile, one) == pytest.approx(time_ms, abs=1e-9)
    # data parallelism beats pipelines whose 100 MB activations take 200 ms: 4 replicas,
    # the allreduce of 2 MiB 6.291 ms (the formula said (6 + 6.291) / 4 = 3.073)
    four = Topology.single_level(4, 1e9)
    allreduce = 4 * 3 / 4 * 2 * 2**20 / 1e9 * 1e3
    for options in (
        PlanOptions("pipedream"),
        PlanOptions("pipedream-vs"),
        PlanOptions("pipedream", cost_model="pipedream"),
    ):
        plan = make_plan(profile, topology=four, options=options)
        assert plan.prediction is not None and plan.prediction.method == "closed-form"
        assert [stage.replicas for stage in plan.stages] == [4]
        assert plan.prediction.time_per_minibatch_ms == pytest.approx((7.78 + allreduce) / 4)
        assert plan.prediction.data_parallel_time_per_minibatch_ms == pytest.approx(
            (7.78 + allreduce) / 4
        )
        assert simulated_ms(plan, profile, four) == pytest.approx((7.78 + allreduce) / 4)
    # a costly allreduce: one worker of four (--fewer-workers), and three levels
    heavy = _busy(params=2**27)
    fewer = make_plan(heavy, topology=four, options=PlanOptions(use_fewer_workers=True))
    assert fewer.world_size == 1 and fewer.prediction is not None
    assert fewer.prediction.time_per_minibatch_ms == pytest.approx(
        simulated_ms(fewer, heavy, four), rel=1e-9
    )
    plan = make_plan(profile, topology=THREE_LEVELS, options=PlanOptions("pipedream"))
    assert plan.num_stages == 1 and plan.prediction is not None
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(
        simulated_ms(plan, profile, THREE_LEVELS), rel=1e-9
    )


def test_auto_ranks_single_stage_candidates_by_their_exact_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # too big to simulate (none is simulated), one layer on one worker: every candidate is
    # one stage, whose formula is exact; more microbatches per update are faster per sample
    monkeypatch.setattr(verify, "MAX_SIMULATED_ACTIONS", 0)
    profile = _busy(1)
    result = plan_profile(
        profile, topology=Topology.single_level(1, 1e9), options=PlanOptions(schedule="auto")
    )
    prediction = result.plan.prediction
    assert prediction is not None and prediction.method == "closed-form"
    chosen = result.candidates[0]
    assert chosen.microbatches == 32 and chosen.schedule in ("1f1b", "gpipe", "zb-h1")
    assert chosen.time_per_minibatch_ms == prediction.time_per_minibatch_ms
    # F 1 + 0.1 + 0.12, B 2 + 0.26, 31 gradients added (1 MiB), U 0.5 + 0.3
    assert prediction.time_per_minibatch_ms == pytest.approx(32 * 3.48 + 31 * 0.125 + 0.8)
    pipedream = next(c for c in result.candidates if c.schedule == "pipedream")
    assert pipedream.time_per_minibatch_ms == pytest.approx(3.48 + 0.8)


def test_auto_compares_simulated_candidates_only(vgg16: Profile) -> None:
    result = plan_profile(
        vgg16, topology=Topology.single_level(4, 1e9), options=PlanOptions(schedule="auto")
    )
    prediction = result.plan.prediction
    assert prediction is not None and prediction.method == "simulated"
    # the chosen row is the plan, and the asynchronous candidates are charged like the rest:
    # pipedream's formula says 205.521 ms per minibatch for its 3-1 split, its simulation
    # 202.194 (a window of 3 minibatches right after the fill once measured 182.877)
    assert result.candidates[0].time_per_minibatch_ms == prediction.time_per_minibatch_ms
    pipedream = next(c for c in result.candidates if c.schedule == "pipedream")
    assert pipedream.time_per_minibatch_ms == pytest.approx(202.194, abs=1e-3)


def test_compare_simulates_the_baselines_of_a_simulated_plan(
    vgg16: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The straight pipeline's row used to show its formula (411.0 ms) next to the plan's
    simulated time (202.2 ms); simulated like the plan, it takes 586.6 ms."""
    profile = tmp_path / "vgg16.yaml"
    save_profile(vgg16, profile)
    rows = {}
    for cost_model in ("symmetric", "pipedream"):
        argv = ["plan", str(profile), "--workers", "4", "--compare", "--cost-model", cost_model]
        assert main([*argv, "-o", str(tmp_path / "plan.yaml")]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert (
            "runs of this plan: --steps and --checkpoint-every multiples of 3 (the replica "
            "counts 3: each replica updates in turn)" in lines
        )
        title = next(line for line in lines if line.startswith("comparison"))
        assert ("every time simulated" in title) == (cost_model == "symmetric")
        rows[cost_model] = {
            line[:22].strip(): line.split()[-5] for line in lines[lines.index(title) + 2 :][:5]
        }
    assert rows["symmetric"] == {
        "data parallel": "583.206",
        "straight pipeline": "586.584",
        "uniform split": "583.206",
        "parameter split": "583.206",
        "optimizer (pipedream)": "202.194",
    }
    assert rows["pipedream"]["straight pipeline"] == "411.042"
    assert rows["pipedream"]["optimizer (pipedream)"] == "205.521"


def test_fewer_workers_are_compared_by_simulation_too(
    vgg16: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under a 20 GiB limit the 4 workers' plan simulates at 318.1 ms, and its local search
    finds nothing faster; the 3 workers' plan that --fewer-workers finds simulates at 389.1
    ms (its formula called it as fast), and the search takes it to the first one's 3-1
    split on 4 workers."""
    profile = tmp_path / "vgg16.yaml"
    save_profile(vgg16, profile)
    argv = ["plan", str(profile), "--workers", "4", "--memory", "20 GiB"]
    assert main([*argv, "-o", str(tmp_path / "plan.yaml")]) == 0
    out = capsys.readouterr().out
    assert "predicted time per minibatch: 318.073 ms" in out
    assert (
        "local search by simulation: 10 plans tried (0 simulated, 10 ruled out by a lower "
        "bound), none faster" in out
    )
    assert "note:" not in out
    assert main([*argv, "--fewer-workers", "-o", str(tmp_path / "fewer.yaml")]) == 0
    out = capsys.readouterr().out
    assert "predicted time per minibatch: 318.073 ms" in out
    assert "from 389.121 ms (the fastest of" in out
    # the data-parallel time is that of the 4 workers, and the line says so (it said 3)
    assert "data parallel on 4 workers: 583.206 ms per minibatch" in out


def test_simulate_charges_a_workers_interface_as_the_planner_does(
    vgg16: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The prediction is the default simulation's, with a network interface per worker (the
    3-1 split on 4 workers: 202.2 ms); --no-interface gives every link its own (211.8 ms: the
    messages then take the links in the order they were posted, with no window left to a
    later one, and the pipeline settles into another cycle)."""
    profile = tmp_path / "vgg16.yaml"
    save_profile(vgg16, profile)
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(profile), "--workers", "4", "-o", str(plan)]) == 0
    capsys.readouterr()
    outs = []
    for extra in ([], ["--interface"], ["--no-interface"]):
        assert main(["simulate", str(plan), *extra]) == 0
        outs.append(capsys.readouterr().out)
    times = [out.split("simulated time per minibatch: ")[1].split(" ms")[0] for out in outs]
    assert times == ["202.194", "202.194", "211.837"]
    assert "(simulated / predicted = 1.000)" in outs[0]


@pytest.mark.parametrize(("doublings", "work"), [(0, 100), (1, 150), (2, 175)])
def test_a_simulations_work_counts_the_shorter_runs_it_doubled_from(
    doublings: int, work: int
) -> None:
    # 100 events and messages in the last run; before it, runs of half, a quarter, ...
    plan = _plan("pipedream", 1, (StagePlan("a", "b", 1, (0,)), StagePlan("c", "d", 1, (1,))))
    longest = default_steps(plan) * 2**doublings
    events = tuple(Event(0, 0, "F", 0, 0.0, 1.0) for _ in range(60))
    messages = (None,) * 40  # only counted
    timeline = Timeline(events, longest, (), 1.0, (0, longest), messages=messages)  # type: ignore[arg-type]
    assert simulation_work(timeline, plan) == work
    assert simulation_work(None, plan) == 0
