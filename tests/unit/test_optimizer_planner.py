"""The planner and ``pipedream plan``: ranks, prediction block, defaults, user errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipedream.cli import main
from pipedream.errors import PlanningError
from pipedream.formats import (
    LayerProfile,
    Level,
    Plan,
    Profile,
    Topology,
    load_plan,
    save_profile,
    save_topology,
)
from pipedream.optimizer.planner import PlanOptions, make_plan
from pipedream.optimizer.verify import simulated_ms

MB = 1_000_000


def toy_profile(compute: list[float], params: list[int], outputs: list[int]) -> Profile:
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            type="Linear",
            forward_ms=ms / 2,
            backward_ms=ms / 2,
            output_bytes=out,
            parameter_bytes=p,
        )
        for i, (ms, p, out) in enumerate(zip(compute, params, outputs))
    )
    return Profile(
        workload="mlp",
        microbatch_size=8,
        device="cpu",
        dtype="float32",
        layers=layers,
        workload_args={"hidden": "64"},
    )


# At 1e9 B/s, 1 MB of boundary costs 2 ms per minibatch.
PROFILE = toy_profile([40, 10, 10, 20], [0, 1 * MB, 1 * MB, 2 * MB], [1 * MB] * 4)


def plan_for(workers: int, **options) -> Plan:
    return make_plan(
        PROFILE, topology=Topology.single_level(workers), options=PlanOptions(**options)
    )


def test_plan_fields_ranks_and_prediction() -> None:
    plan = plan_for(4)
    assert plan.workload == "mlp" and plan.workload_args == {"hidden": "64"}
    assert plan.microbatch_size == 8 and plan.microbatches == 1 and plan.world_size == 4
    assert plan.layers == ("l0", "l1", "l2", "l3")
    rank = 0
    for stage in plan.stages:  # replicas of a stage get consecutive ranks
        assert stage.ranks == tuple(range(rank, rank + stage.replicas))
        rank += stage.replicas
    pred = plan.prediction
    assert pred is not None and pred.cost_model == "symmetric"
    assert pred.time_per_minibatch_ms == pytest.approx(max(pred.stage_ms))
    assert pred.bottleneck == pred.stage_ms.index(max(pred.stage_ms))
    assert pred.throughput_samples_per_s == pytest.approx(8 * 1000 / pred.time_per_minibatch_ms)
    # data parallel: (80 ms + 4 * 3 * 4 MB / (1e9 * 4) s) / 4 = (80 + 12) / 4
    assert pred.data_parallel_time_per_minibatch_ms == pytest.approx(23.0)
    assert len(pred.memory_bytes) == plan.num_stages
    # the plan survives a round trip through its own strict loader
    loaded = Plan.from_dict(plan.to_dict())
    assert loaded.stages == plan.stages and loaded.prediction is not None
    assert loaded.prediction.stage_ms == pytest.approx(pred.stage_ms)


def test_straight_plan_gives_stage_s_rank_s() -> None:
    plan = plan_for(4, straight=True)
    assert plan.is_straight and plan.num_stages == 4
    assert [stage.ranks for stage in plan.stages] == [(0,), (1,), (2,), (3,)]
    assert plan.prediction is not None
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(40.0)


def test_sync_schedules_default_microbatches_and_bubble() -> None:
    """The formula, as the original optimizer's arithmetic keeps it (the default cost model
    simulates pipelines)."""
    for schedule in ("2bw", "1f1b", "gpipe"):
        plan = plan_for(4, schedule=schedule, straight=True, cost_model="pipedream")
        assert plan.microbatches == 4  # max(4, number of stages)
        assert plan.prediction is not None
        slowest = max(plan.prediction.stage_ms)
        slots = 4 if schedule == "2bw" else 4 + plan.num_stages - 1
        assert plan.prediction.time_per_minibatch_ms == pytest.approx(slots * slowest)
        assert plan.prediction.throughput_samples_per_s == pytest.approx(
            8 * 4 * 1000 / plan.prediction.time_per_minibatch_ms
        )
    many = make_plan(
        toy_profile([10] * 6, [0] * 6, [0] * 6),
        topology=Topology.single_level(6),
        options=PlanOptions(schedule="2bw", straight=True),
    )
    assert many.num_stages == 6 and many.microbatches == 6


@pytest.mark.parametrize("schedule", ["pipedream", "2bw", "1f1b", "gpipe"])
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 6])
def test_never_predicted_slower_than_data_parallel(schedule: str, workers: int) -> None:
    # data parallelism is one of the candidates (one stage, all replicas), also for the flush
    # schedules, whose bubble makes deep pipelines lose on this small model
    plan = plan_for(workers, schedule=schedule)
    assert plan.prediction is not None
    pred = plan.prediction
    assert pred.time_per_minibatch_ms <= pred.data_parallel_time_per_minibatch_ms * (1 + 1e-12)


def test_flush_schedule_picks_the_stage_count_with_its_bubble() -> None:
    # 1f1b, m = 4: three stages of 20 ms cost (4 + 2) x 20 = 120 ms; data parallel costs
    # 4 x (80 + 12 / 4) / 4 = 83 ms; PipeDream (no flush) keeps the three stages by its
    # formula (20 ms), which the default cost model checks by simulation: PipeDream's warm-up
    # keeps 2 minibatches in flight on each replica of the first stage, too few to hide the
    # round trip, 31 ms, so it starts from data parallelism (23 ms), and its local search
    # finds a 3-1 split beside it: 21.8 ms
    original = plan_for(4, schedule="pipedream", cost_model="pipedream")
    assert [stage.replicas for stage in original.stages] == [2, 1, 1]
    assert original.prediction is not None
    assert original.prediction.time_per_minibatch_ms == pytest.approx(20.0)
    assert simulated_ms(original, PROFILE, Topology.single_level(4)) == pytest.approx(31.0)
    simulated = plan_for(4, schedule="pipedream")
    assert [(s.first_layer, s.last_layer, s.replicas) for s in simulated.stages] == [
        ("l0", "l2", 3),
        ("l3", "l3", 1),
    ]
    assert simulated.prediction is not None
    assert simulated.prediction.time_per_minibatch_ms == pytest.approx(21.778, abs=1e-3)
    assert simulated.prediction.data_parallel_time_per_minibatch_ms == pytest.approx(23.0)
    plan = plan_for(4, schedule="1f1b")
    assert plan.num_stages == 1 and plan.stages[0].replicas == 4
    assert plan.prediction is not None
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(83.0)


@pytest.mark.parametrize(
    ("options", "workers", "message"),
    [
        ({"schedule": "pipe"}, 2, "unknown schedule 'pipe'"),
        ({"schedule": "interleaved-1f1b", "microbatches": 3}, 2, "use a multiple of 2"),
        ({"schedule": "1f1b", "virtual_stages": 2}, 2, "--virtual-stages 2 with schedule '1f1b'"),
        ({"schedule": "zbv", "virtual_stages": 3}, 2, "exactly 2 stages on every worker"),
        ({"schedule": "interleaved-1f1b", "virtual_stages": 1}, 2, "at least 2 stages per"),
        ({"schedule": "zbv"}, 3, "needs at least 6 layers"),
        ({"cost_model": "alpa"}, 2, "unknown cost model 'alpa'"),
        ({"microbatches": 4}, 2, "--microbatches 4 with schedule 'pipedream'"),
        ({"microbatches": 2, "schedule": "pipedream-vs"}, 2, "must be 1"),
        ({"microbatches": 0, "schedule": "gpipe"}, 2, "--microbatches 0"),
        ({"straight": True}, 5, "--straight with 5 workers needs at least 5 layers"),
        ({"memory": 1000.0}, 2, "fits in 1000 B per worker"),
        ({"schedule": "2bw", "microbatches": 2, "straight": True}, 4, "use --microbatches 4"),
    ],
)
def test_user_errors(options: dict, workers: int, message: str) -> None:
    with pytest.raises(PlanningError, match=message.replace("(", r"\(")):
        plan_for(workers, **options)


def test_levels_of_one_unit_change_nothing() -> None:
    # a level of one unit is no level: this is one level of 4 workers
    flat = Topology((Level("server", 4, 1e10), Level("cluster", 1, 1e9)))
    one = Topology.single_level(4, 1e10)
    assert make_plan(PROFILE, topology=flat, options=PlanOptions()).stages == (
        make_plan(PROFILE, topology=one, options=PlanOptions()).stages
    )


# ---------------------------------------------------------------- the command line


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.yaml"
    save_profile(PROFILE, path)
    return path


def test_cli_writes_plan_and_prints_table(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.yaml"
    argv = ["plan", str(profile_file), "--workers", "4", "--bandwidth", "1 GB/s", "--compare"]
    assert main([*argv, "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.stages == plan_for(4).stages
    text = capsys.readouterr().out
    for expected in (
        "stage",
        "replicas",
        "ranks",
        "predicted time per minibatch",
        "data parallel",
        "straight pipeline",
        "uniform split",
        "parameter split",
        f"wrote {out}",
    ):
        assert expected in text
    assert "comparison (schedule pipedream, 1 microbatch, cost model " in text  # "1 microbatches"


def test_cli_topology_file(profile_file: Path, tmp_path: Path) -> None:
    topo = tmp_path / "topo.yaml"
    save_topology(Topology.single_level(3, 1e9, memory=2**40), topo)
    out = tmp_path / "plan.yaml"
    assert main(["plan", str(profile_file), "--topology", str(topo), "-o", str(out)]) == 0
    assert load_plan(out).world_size == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "no cluster given"),
        (["--workers", "2", "--topology", "t.yaml"], "not both"),
        (["--workers", "0"], "--workers 0"),
        (["--workers", "1000000000000"], "one level holds at most 4096 workers"),
        (["--workers", "4097"], "describe a larger cluster in levels with --topology"),
        (["--workers", "2", "--bandwidth", "fast"], "cannot parse 'fast'"),
        (["--workers", "2", "--bandwidth", "0"], "must be at least 1 byte/s"),
        (  # planned into an AssertionError
            ["--workers", "2", "--bandwidth", "1e-300"],
            "--bandwidth '1e-300': must be at least 1 byte/s, e.g. 1e9 or '10 GB/s'",
        ),
        (["--workers", "2", "--memory", "lots"], "--memory"),
        (["--workers", "2", "--schedule", "zb"], "unknown schedule 'zb'"),
        (["--workers", "2", "--microbatches", "3"], "must be 1"),
        (
            ["--workers", "2", "--schedule", "zb-h1", "--microbatches", "1000000"],
            "--microbatches 1000000: at most 16384 supported; use fewer, larger microbatches",
        ),
        (["--workers", "9", "--straight"], "use --workers 4 or fewer"),
    ],
)
def test_cli_errors_are_one_line_exit_2(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra, message
) -> None:
    out = tmp_path / "plan.yaml"
    assert main(["plan", str(profile_file), *extra, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert not out.exists()


def test_planning_never_imports_torch(profile_file: Path, tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import pipedream.optimizer, pipedream.optimizer.command, pipedream.optimizer.report\n"
        "from pipedream.cli import main\n"
        f"assert main(['plan', {str(profile_file)!r}, '--workers', '3', '--compare',\n"
        f"             '-o', {str(tmp_path / 'p.yaml')!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'planning imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
