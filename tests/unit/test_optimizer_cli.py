"""``pipedream plan`` (topologies, auto, compare, cost models) and ``pipedream simulate``."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipedream.cli import main
from pipedream.errors import FormatError
from pipedream.formats import (
    LayerProfile,
    Level,
    Plan,
    Profile,
    StagePlan,
    Topology,
    load_plan,
    load_profile,
    save_plan,
    save_profile,
    save_topology,
)

MB = 1_000_000
PROFILE = Profile(
    "toy",
    8,
    "cpu",
    "float32",
    tuple(
        LayerProfile(f"l{i}", "Linear", ms / 2, ms / 2, out, p)
        for i, (ms, p, out) in enumerate(
            zip([40, 10, 10, 20, 5, 5], [0, MB, MB, 2 * MB, 0, MB], [MB] * 6)
        )
    ),
)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    profile = tmp_path / "data" / "profile.yaml"
    save_profile(PROFILE, profile)
    topology = tmp_path / "topo.yaml"
    save_topology(Topology((Level("server", 2, 1e10), Level("rack", 2, 1e9))), topology)
    return {"profile": profile, "topology": topology, "plan": tmp_path / "out" / "plan.yaml"}


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_on_a_topology_records_profile_and_cluster(files, capsys) -> None:
    plan_file = files["plan"]
    argv = ["plan", str(files["profile"]), "--topology", str(files["topology"]), "--compare"]
    code, out, _ = run_cli([*argv, "-o", str(plan_file)], capsys)
    assert code == 0
    plan = load_plan(plan_file)
    assert plan.world_size == 4 and plan.topology is not None
    assert plan.topology.levels[1] == Level("rack", 2, 1e9)
    assert plan.profile == "../data/profile.yaml"  # relative to the plan file
    for row in ("data parallel", "straight pipeline", "uniform split", "parameter split"):
        assert row in out
    assert "optimizer (pipedream)" in out and "2 x server @ 10 GB/s within 2 x rack" in out
    # the simulator needs nothing else
    code, out, _ = run_cli(["simulate", str(plan_file), "--width", "12"], capsys)
    assert code == 0
    assert "simulated time per minibatch" in out and "plan's prediction" in out
    assert "with every action and message 5% longer or shorter at random (seeded): " in out
    assert "rank (stage) | 0" in out


@pytest.mark.parametrize(
    ("device", "concurrent", "workers", "expected"),
    [
        ("cpu", 1, 2, "by 1 process training at once, but up to 2 ranks share a host (server)"),
        ("cpu", 2, 2, ""),
        ("cpu", 2, 4, "by 2 processes training at once, but up to 3 ranks share a host"),
        ("cuda:0", 1, 4, ""),  # every rank has its own device
    ],
)
def test_simulate_says_when_a_cpu_profile_misses_the_ranks_of_a_host(
    device: str, concurrent: int, workers: int, expected: str
) -> None:
    from dataclasses import replace

    from pipedream.optimizer.simulate_command import concurrency_note

    profile = replace(PROFILE, device=device, concurrent=concurrent)
    topology = Topology((Level("server", workers, 1e10),))
    stages = (
        StagePlan("l0", "l1", 1, (0,)),
        StagePlan("l2", "l3", 1, (1,)),
        StagePlan("l4", "l5", 1, (2,)),
    )
    plan = Plan("toy", "pipedream", 8, 1, 3, stages)
    note = concurrency_note(profile, plan, topology)
    assert (expected in note) if expected else note == ""
    if expected:
        per_host = min(workers, 3)
        assert note.endswith(f"profile with --concurrent {per_host}")


def test_one_of_a_thing_is_said_in_the_singular(files, tmp_path, capsys) -> None:
    """A one-stage plan of one microbatch simulated for one minibatch said "1 stages",
    "1 microbatch(es)", "1 minibatches" and "1 process(es)"."""
    plan = Plan("toy", "1f1b", 8, 1, 2, (StagePlan("l0", "l5", 2, (0, 1)),), PROFILE.layer_names)
    plan_file = tmp_path / "one.yaml"
    save_plan(replace(plan, profile=str(files["profile"])), plan_file)
    assert plan_file.read_text().startswith(
        "# pipedream plan for toy: 1 stage (replicas 2), schedule 1f1b, 2 workers\n"
    )
    straight = replace(
        plan, world_size=1, stages=(StagePlan("l0", "l5", 1, (0,)),), profile=str(files["profile"])
    )
    save_plan(straight, plan_file)
    code, out, err = run_cli(["simulate", str(plan_file), "--steps", "1", "--width", "12"], capsys)
    assert code == 0, err
    assert out.startswith("toy: schedule 1f1b, 1 stage on 1 rank, 1 microbatch per minibatch, ")
    assert ", 1 minibatch on " in out
    assert "(the average over 1 minibatch from the start, fill and drain included)" in out
    assert "no steady state: 1 minibatch is too few for the pipeline's fill" in out


def test_plan_auto_prints_what_it_tried(files, capsys) -> None:
    code, out, _ = run_cli(
        [
            "plan",
            str(files["profile"]),
            "--workers",
            "3",
            "--schedule",
            "auto",
            "-o",
            str(files["plan"]),
        ],
        capsys,
    )
    assert code == 0 and "--schedule auto tried:" in out and "chosen" in out
    assert load_plan(files["plan"]).schedule in (
        "pipedream",
        "pipedream-vs",
        "2bw",
        "1f1b",
        "gpipe",
    )


def test_plan_auto_says_what_it_left_out(files, capsys) -> None:
    argv = ["plan", str(files["profile"]), "--workers", "3", "--schedule", "auto"]
    code, out, _ = run_cli([*argv, "--microbatches", "4", "-o", str(files["plan"])], capsys)
    assert code == 0
    lines = out.splitlines()
    table = lines[lines.index("--schedule auto tried:") + 2 :]
    rows = table[: next(i for i, line in enumerate(table) if line.startswith("not compared"))]
    assert {row.split()[0] for row in rows} == {"1f1b", "gpipe", "2bw", "zb-h1", "zbv"}
    assert table[len(rows)] == (
        "not compared: pipedream, pipedream-vs (one microbatch per minibatch, not 4); "
        "interleaved-1f1b (microbatches not a multiple of a pipeline copy's workers, 3)"
    )


def test_plan_auto_says_in_full_why_a_schedule_was_not_planned(files, capsys) -> None:
    """The reasons were cut to 60 characters in the table's last column, mid-sentence ("...
    fits in 30.0 MiB per")."""
    argv = ["plan", str(files["profile"]), "--workers", "3", "--schedule", "auto"]
    argv += ["--microbatches", "4", "--memory", "12 MB", "-o", str(files["plan"])]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0
    lines = out.splitlines()
    table = lines[lines.index("--schedule auto tried:") + 1 :]
    assert [row.split()[0] for row in table[1:6]] == ["1f1b", "2bw", "gpipe", "zb-h1", "zbv"]
    assert [row.split(maxsplit=4)[4] for row in table[3:6]] == ["not planned"] * 3
    fixes = "raise --memory or add workers"
    assert table[6:9] == [
        "gpipe x 4: no partition of 6 layers over 3 workers fits in 11.4 MiB per worker "
        f"(schedule gpipe, estimated memory); {fixes}",
        "zb-h1 x 4: no partition of 6 layers over 3 workers fits in 11.4 MiB per worker "
        f"(schedule zb-h1, estimated memory); {fixes}",
        "zbv x 4: schedule 'zbv' does not fit: its leanest plan needs 12.4 MiB on one worker, "
        "the limit is 11.4 MiB; use fewer microbatches, more memory, or another schedule",
    ]
    assert table[9].startswith("not compared: ")


def test_plan_auto_with_nothing_that_fits_says_why_once(files, capsys) -> None:
    argv = ["plan", str(files["profile"]), "--workers", "2", "--schedule", "auto"]
    code, out, err = run_cli([*argv, "--memory", "1 KiB", "-o", str(files["plan"])], capsys)
    assert (code, out) == (2, "")
    assert err == (
        "pipedream plan: error: --schedule auto: no schedule has a feasible plan: no plan fits "
        "in 1.0 KiB per worker (1f1b, gpipe, 2bw, pipedream, pipedream-vs, interleaved-1f1b, "
        "zb-h1, zbv); raise --memory or add workers\n"
    )


def test_cost_models_differ_only_where_the_original_skips_a_transfer(files, capsys) -> None:
    predictions = {}
    for name in ("symmetric", "pipedream"):
        out = files["plan"].with_name(f"{name}.yaml")
        argv = ["plan", str(files["profile"]), "--workers", "4", "--cost-model", name]
        assert run_cli([*argv, "-o", str(out)], capsys)[0] == 0
        prediction = load_plan(out).prediction
        assert prediction is not None and prediction.cost_model == name
        predictions[name] = prediction.time_per_minibatch_ms
    assert predictions["pipedream"] <= predictions["symmetric"]


def test_simulate_draws_a_png(files, capsys) -> None:
    pytest.importorskip("matplotlib")
    argv = ["plan", str(files["profile"]), "--workers", "2", "--schedule", "gpipe"]
    assert run_cli([*argv, "-o", str(files["plan"])], capsys)[0] == 0
    png = files["plan"].with_name("timeline.png")
    code, out, _ = run_cli(["simulate", str(files["plan"]), "--png", str(png)], capsys)
    assert code == 0 and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_with_a_shared_host_bandwidth_is_slower(files, capsys) -> None:
    argv = ["plan", str(files["profile"]), "--workers", "4", "--schedule", "gpipe"]
    assert run_cli([*argv, "--straight", "-o", str(files["plan"])], capsys)[0] == 0
    times = []
    for extra in ([], ["--host-bandwidth", "1 kB/s"]):
        code, out, _ = run_cli(["simulate", str(files["plan"]), *extra], capsys)
        assert code == 0
        times.append(float(out.split("simulated time per minibatch: ")[1].split(" ms")[0]))
    assert times[1] > times[0]


def test_simulate_charges_the_send_overhead(files, capsys) -> None:
    argv = ["plan", str(files["profile"]), "--workers", "2", "--schedule", "pipedream"]
    assert run_cli([*argv, "--straight", "-o", str(files["plan"])], capsys)[0] == 0
    times = []
    for extra in ([], ["--send-overhead", "5"], ["--send-overhead-per-mib", "1e6"]):
        code, out, _ = run_cli(["simulate", str(files["plan"]), *extra], capsys)
        assert code == 0
        times.append(float(out.split("simulated time per minibatch: ")[1].split(" ms")[0]))
    # pipedream on 2 stages: each stage posts one message per minibatch (activations or
    # gradients) and is the bottleneck of its own loop; a fixed 5 ms is 5 ms more per minibatch
    assert times[1] > times[0] + 4.0
    assert times[2] > times[0]


def test_simulate_duplex_links_let_activations_and_gradients_pass(files, capsys) -> None:
    # pipedream on 2 stages with 1 MB messages at 4e7 bytes/s (25 ms each): activations and
    # gradients cross the one link at the same time, so a full-duplex link (2) is faster than
    # one that carries one message at a time (the default) or shares itself (1)
    argv = ["plan", str(files["profile"]), "--workers", "2", "--schedule", "pipedream"]
    assert run_cli([*argv, "--straight", "-o", str(files["plan"])], capsys)[0] == 0
    times = {}
    for duplex in (None, "1", "2"):
        extra = ["--bandwidth", "4e7"] + ([] if duplex is None else ["--duplex", duplex])
        code, out, _ = run_cli(["simulate", str(files["plan"]), *extra], capsys)
        assert code == 0
        times[duplex] = float(out.split("simulated time per minibatch: ")[1].split(" ms")[0])
    assert times["2"] < times[None] and times["2"] < times["1"]


def test_simulate_draws_messages_from_a_message_spread(files, capsys) -> None:
    # gpipe on 2 stages, 4 microbatches, 1 MB messages at 4e7 bytes/s (25 ms each): every
    # message drawn at 2x takes 50 ms, so at least the last activation and the last gradient
    # of a minibatch arrive 25 ms later each; the report says what was drawn
    argv = ["plan", str(files["profile"]), "--workers", "2", "--schedule", "gpipe"]
    assert run_cli([*argv, "--straight", "-o", str(files["plan"])], capsys)[0] == 0
    times, outs = [], []
    for extra in ([], ["--message-spread", "2"], ["--message-spread", "2,2"]):
        code, out, _ = run_cli(
            ["simulate", str(files["plan"]), "--bandwidth", "4e7", *extra], capsys
        )
        assert code == 0
        times.append(float(out.split("simulated time per minibatch: ")[1].split(" ms")[0]))
        outs.append(out)
    assert times[1] >= times[0] + 2 * 25
    assert times[2] == pytest.approx(times[1])
    assert (
        "every message's transfer time from 2 ratio(s), 2.00x-2.00x (--message-spread)" in (outs[2])
    )


def test_simulate_per_rank_makes_a_middle_stage_carry_its_messages_one_at_a_time(
    files, capsys
) -> None:
    # gpipe on 3 stages, 1 MB messages at 4e7 bytes/s (25 ms each, slower than the compute):
    # the middle rank receives activations and sends its own on at once; with --per-rank 1 the
    # two share one link's worth, and the messages, the critical path, take longer
    argv = ["plan", str(files["profile"]), "--workers", "3", "--schedule", "gpipe"]
    assert run_cli([*argv, "--straight", "-o", str(files["plan"])], capsys)[0] == 0
    times = []
    for extra in ([], ["--per-rank", "1"], ["--per-rank", "3"]):
        argv = ["simulate", str(files["plan"]), "--bandwidth", "4e7", "--duplex", "2", *extra]
        code, out, _ = run_cli(argv, capsys)
        assert code == 0
        times.append(float(out.split("simulated time per minibatch: ")[1].split(" ms")[0]))
    assert times[1] > times[0] * 1.1
    assert times[2] == pytest.approx(times[0])  # 3 links' worth: never the limit here


def test_simulate_without_matplotlib_says_how_to_install(files, capsys, monkeypatch) -> None:
    argv = ["plan", str(files["profile"]), "--workers", "2", "-o", str(files["plan"])]
    assert run_cli(argv, capsys)[0] == 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    code, _, err = run_cli(["simulate", str(files["plan"]), "--png", "x.png"], capsys)
    assert code == 2 and err.count("\n") == 1 and "pip install -e '.[plot]'" in err


def _planned_with_another_profile(files: dict[str, Path], capsys, **changes: Any) -> Path:
    """Plan from the toy profile, then save a profile with ``changes`` beside it."""
    argv = ["plan", str(files["profile"]), "--workers", "2", "-o", str(files["plan"])]
    assert run_cli(argv, capsys)[0] == 0
    other = files["profile"].with_name("other.yaml")
    save_profile(replace(PROFILE, **changes), other)
    return other


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"microbatch_size": 32},
            "--profile {other}: measured microbatches of 32 samples, but {plan} trains "
            "microbatches of 8; pass the profile the plan was made from, or profile again with "
            "--microbatch-size 8",
        ),
        (
            {"workload": "mlp"},
            "--profile {other}: measured the workload mlp, but {plan} trains toy; pass --profile "
            "with a profile of toy",
        ),
    ],
    ids=["microbatch_size", "workload"],
)
def test_simulate_refuses_a_profile_of_another_microbatch_or_workload(
    files, capsys, changes: dict[str, Any], message: str
) -> None:
    """A profile of microbatches of 32 simulated a plan of microbatches of 8 without a word,
    reporting simulated / predicted ratios of nothing."""
    other = _planned_with_another_profile(files, capsys, **changes)
    argv = ["simulate", str(files["plan"]), "--profile", str(other)]
    code, out, err = run_cli(argv, capsys)
    expected = message.format(other=other, plan=files["plan"])
    assert (code, out, err) == (2, "", f"pipedream simulate: error: {expected}\n")


def test_simulate_refuses_the_recorded_profile_of_another_microbatch(files, capsys) -> None:
    """The profile the plan records, profiled again with another microbatch size."""
    _planned_with_another_profile(files, capsys)
    save_profile(replace(PROFILE, microbatch_size=4), files["profile"])
    code, _, err = run_cli(["simulate", str(files["plan"])], capsys)
    recorded = files["plan"].parent / ".." / "data" / "profile.yaml"  # as the plan records it
    assert (code, err) == (
        2,
        f"pipedream simulate: error: the profile {recorded}: measured microbatches of 4 samples, "
        f"but {files['plan']} trains microbatches of 8; profile again with --microbatch-size 8 "
        "and pass that with --profile\n",
    )


def test_simulate_notes_a_profile_of_other_workload_args(files, capsys) -> None:
    """Other options (``lr`` here) need not change a layer's costs: a note, not a refusal."""
    other = _planned_with_another_profile(files, capsys, workload_args={"lr": "0.1"})
    argv = ["simulate", str(files["plan"]), "--profile", str(other)]
    code, out, err = run_cli(argv, capsys)
    assert (code, err) == (0, "")
    assert out.splitlines()[1] == (
        f"note: --profile {other} was measured with other workload_args than {files['plan']} "
        "records (lr: 0.1 in the profile, its default in the plan); the times below are right "
        "only if these options leave the layers as they are (as lr or seed do, unlike sizes): "
        "else profile with the plan's"
    )
    argv = ["simulate", str(files["plan"]), "--profile", str(files["profile"])]
    assert "workload_args" not in run_cli(argv, capsys)[1]  # the same options: no note


def hand_written(tmp_path: Path, replicas: tuple[int, ...] = (1, 1)) -> Path:
    stages, rank = [], 0
    names = [("l0", "l2"), ("l3", "l5")]
    for (first, last), r in zip(names, replicas):
        stages.append(StagePlan(first, last, r, tuple(range(rank, rank + r))))
        rank += r
    path = tmp_path / "hand.yaml"
    save_plan(Plan("toy", "pipedream", 8, 1, rank, tuple(stages)), path)
    return path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "{profile}", "--workers", "2", "--cost-model", "alpa"], "unknown cost model"),
        (["plan", "{profile}", "--workers", "2", "--schedule", "fast"], "or auto"),
        (
            ["plan", "{profile}", "--workers", "2", "--schedule", "auto", "--microbatches", "0"],
            "--microbatches 0",
        ),
        (["plan", "{profile}", "--topology", "{topology}", "--bandwidth", "1e9"], "does not apply"),
        (["simulate", "{hand}"], "pass --profile"),
        (["simulate", "{hand2}", "--profile", "{profile}", "--steps", "3"], "use --steps 4"),
        (["simulate", "{hand}", "--profile", "{profile}", "--latency", "-1"], "--latency -1"),
        (
            ["simulate", "{hand}", "--profile", "{profile}", "--send-overhead", "-0.5"],
            "--send-overhead -0.5: must be >= 0",
        ),
        (
            ["simulate", "{hand}", "--profile", "{profile}", "--send-overhead-per-mib", "nan"],
            "--send-overhead-per-mib nan",
        ),
        (
            ["simulate", "{hand}", "--profile", "{profile}", "--recv-overhead", "-1"],
            "--recv-overhead -1.0: must be >= 0",
        ),
        (
            ["simulate", "{hand}", "--profile", "{profile}", "--spread"],
            "--spread: the profile of toy records no pass_spread",
        ),
        (
            ["simulate", "{hand}", "--profile", "{profile}", "--message-spread", "1,0"],
            "--message-spread '1,0': '0' is not a positive ratio",
        ),
        (
            ["simulate", "{hand}", "--profile", "{profile}", "--message-spread", "1,x"],
            "'x' is not a positive ratio",
        ),
        (["simulate", "{hand}", "--profile", "{profile}", "--width", "0"], "--width 0"),
        (
            ["simulate", "{hand}", "--profile", "{profile}", "--duplex", "0.5"],
            "--duplex 0.5: must be between 1",
        ),
        (["simulate", "{hand}", "--profile", "{profile}", "--duplex", "nan"], "--duplex nan"),
        (
            ["simulate", "{hand}", "--profile", "{profile}", "--per-rank", "0"],
            "--per-rank 0.0: must be a positive multiple",
        ),
        (
            ["simulate", "{hand}", "--profile", "{profile}", "--host-bandwidth", "0"],
            "--host-bandwidth '0': must be at least 1 byte/s, e.g. 2e9",
        ),
        (  # simulated forever
            ["simulate", "{hand}", "--profile", "{profile}", "--host-bandwidth", "1e-300"],
            "--host-bandwidth '1e-300': must be at least 1 byte/s, e.g. 2e9",
        ),
        (  # transfer times overflowed
            ["simulate", "{hand}", "--profile", "{profile}", "--bandwidth", "1e-300"],
            "--bandwidth '1e-300': must be at least 1 byte/s, e.g. 1e9",
        ),
        (
            ["simulate", "{hand}", "--profile", "{profile}", "--host-bandwidth", "lots"],
            "--host-bandwidth: cannot parse",
        ),
        (
            [
                "simulate",
                "{hand}",
                "--profile",
                "{profile}",
                "--topology",
                "{topology}",
                "--bandwidth",
                "1",
            ],
            "use one",
        ),
        (["simulate", "{hand}", "--profile", "{profile}", "--bandwidth", "fast"], "cannot parse"),
        (["simulate", "{hand}", "--profile", "{other}"], "does not have"),
        (["simulate", "{missing}"], "not found"),
    ],
)
def test_new_options_fail_in_one_line_with_exit_2(files, tmp_path, capsys, argv, message) -> None:
    other = tmp_path / "other.yaml"
    save_profile(
        Profile("toy", 8, "cpu", "float32", (LayerProfile("x", "Linear", 1, 1, 1, 1),)), other
    )
    names = {
        "profile": files["profile"],
        "topology": files["topology"],
        "hand": hand_written(tmp_path),
        "hand2": hand_written(tmp_path, (2, 2)),
        "other": other,
        "missing": tmp_path / "nope.yaml",
    }
    argv = [a.format(**{k: str(v) for k, v in names.items()}) for a in argv]
    if argv[0] == "plan":
        argv += ["-o", str(files["plan"])]
    code, _, err = run_cli(argv, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and message in err, err


def test_simulate_finds_a_moved_profile_missing(files, tmp_path, capsys) -> None:
    argv = ["plan", str(files["profile"]), "--workers", "2", "-o", str(files["plan"])]
    assert run_cli(argv, capsys)[0] == 0
    files["profile"].unlink()
    code, _, err = run_cli(["simulate", str(files["plan"])], capsys)
    assert code == 2 and "was made from the profile ../data/profile.yaml" in err


def test_plan_and_simulate_never_import_torch(files) -> None:
    profile, topology, plan = (str(files[key]) for key in ("profile", "topology", "plan"))
    code = (
        "import sys\n"
        "from pipedream.cli import main\n"
        f"assert main(['plan', {profile!r}, '--topology', {topology!r},\n"
        f"             '--schedule', 'auto', '--compare', '-o', {plan!r}]) == 0\n"
        f"assert main(['simulate', {plan!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'planning or simulating imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_plan_keys_profile_and_topology_round_trip_and_are_validated() -> None:
    topology = Topology((Level("server", 2, 1e10), Level("rack", 2, 1e9)), memory=2**30)
    plan = Plan(
        "toy",
        "pipedream",
        8,
        1,
        2,
        (StagePlan("l0", "l2", 1, (0,)), StagePlan("l3", "l5", 1, (1,))),
        profile="profile.yaml",
        topology=topology,
    )
    data = plan.to_dict()
    assert data["profile"] == "profile.yaml" and "format" not in data["topology"]
    assert Plan.from_dict(data) == plan
    bad = dict(data, topology={"levels": [{"name": "s", "workers": "two", "bandwidth": 1e9}]})
    with pytest.raises(FormatError, match=r"topology\.levels\[0\]\.workers"):
        Plan.from_dict(bad, source="p.yaml")
    small = dict(data, topology={"levels": [{"name": "s", "workers": 1, "bandwidth": 1e9}]})
    with pytest.raises(FormatError, match="has 1 workers but world_size is 2"):
        Plan.from_dict(small, source="p.yaml")
    assert Plan.from_dict({k: v for k, v in data.items() if k not in ("profile", "topology")}) == (
        Plan("toy", "pipedream", 8, 1, 2, plan.stages)
    )


def test_a_profile_measured_on_a_gpu_limits_each_worker_to_its_memory(tmp_path, capsys) -> None:
    """Without --memory (or a topology's memory), a plan fits the GPU the profile ran on: one
    worker would need 15.3 MiB of a 11.4 MiB GPU. Without --bandwidth, a note says that the
    default 1 GB/s is not a GPU's."""
    path = tmp_path / "gpu-profile.yaml"
    save_profile(replace(PROFILE, device="cuda:0", device_memory=12_000_000), path)
    assert load_profile(path).device_memory == 12_000_000
    plan = str(tmp_path / "plan.yaml")
    code, out, err = run_cli(["plan", str(path), "--workers", "1", "-o", plan], capsys)
    assert (code, out) == (2, "")
    assert err == (
        "pipedream plan: error: no partition of 6 layers over 1 workers fits in 11.4 MiB per "
        "worker (schedule pipedream, estimated memory); raise --memory or add workers, or use a "
        "schedule that keeps fewer weight versions (2bw, 1f1b) (the limit per worker is the "
        "memory of cuda:0, where the profile was measured)\n"
    )
    code, out, _ = run_cli(["plan", str(path), "--workers", "4", "-o", plan], capsys)
    assert code == 0
    assert (
        "note: no --bandwidth given, so the plan assumes 1 GB/s between workers, while the "
        "profile was measured on cuda:0: GPUs of one node exchange at tens to hundreds of GB/s "
        "(NVLink, PCIe); give --bandwidth, or --topology for several nodes\n"
    ) in out
    argv = ["plan", str(path), "--workers", "4", "--bandwidth", "100 GB/s", "-o", plan]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0 and "note: no --bandwidth" not in out
    assert (
        "memory limit per worker: 11.4 MiB (the memory of cuda:0, where the profile was "
        "measured; --memory sets another), checked against the estimate"
    ) in out
    code, out, _ = run_cli(
        ["plan", str(path), "--workers", "1", "--memory", "1 GiB", "-o", plan], capsys
    )
    assert code == 0 and "memory limit per worker: 1.0 GiB (checked against" in out
