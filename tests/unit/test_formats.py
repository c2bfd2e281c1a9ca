"""The file formats (docs/formats.md): literal round trips, units, and every error path.

Every malformed file must raise one ``FormatError`` whose message is one line of the form
``FILE: FIELD: PROBLEM; FIX`` — it names the file, the dotted field path and how to fix it.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipedream.errors import FormatError, PipedreamError
from pipedream.formats import (
    ActionOverhead,
    Level,
    PassSpread,
    Plan,
    Prediction,
    Profile,
    StagePlan,
    TiedParameter,
    Topology,
    load_plan,
    load_profile,
    load_topology,
    save_plan,
    save_profile,
    save_topology,
)
from pipedream.formats.units import format_bytes, parse_bandwidth, parse_bytes
from pipedream.formats.yamlio import atomic_write_text

from launching import REPO

# ---------------------------------------------------------------------------------------------
# Literal files

PROFILE: dict[str, Any] = {
    "format": "pipedream/profile@1",
    "workload": "mlp",
    "workload_args": {"layers": "2"},
    "microbatch_size": 4,
    "device": "cpu",
    "dtype": "float32",
    "layers": [
        {
            "name": "0",
            "type": "Linear(16, 64)+ReLU",
            "forward_ms": 0.5,
            "backward_ms": 1.25,
            "output_bytes": 1024,
            "parameter_bytes": 4352,
            "saved_bytes": 2048,
            "optimizer_state_bytes": 0,
            "update_ms": 0.0625,
        },
        {
            "name": "1",
            "type": "Linear(64, 64)+ReLU",
            "forward_ms": 0.75,
            "backward_ms": 1.5,
            "output_bytes": 1024,
            "parameter_bytes": 16640,
        },
        {
            "name": "2",
            "type": "Linear(64, 4)",
            "forward_ms": 0.125,
            "backward_ms": 0.25,
            "output_bytes": 64,
            "parameter_bytes": 1040,
        },
    ],
    "cut_bytes": [1024, 2048],
    "overhead_ms": {
        "forward_ms": 0.25,
        "backward_ms": 0.125,
        "update_ms": 0.5,
        "copy_ms_per_mib": 0.0625,
        "accumulate_ms_per_mib": 0.09375,
        "inputs_ms": 0.03125,
        "targets_ms": 0.015625,
        "loss_forward_ms": 0.375,
        "loss_backward_ms": 0.1875,
    },
}

TOPOLOGY: dict[str, Any] = {
    "format": "pipedream/topology@1",
    "levels": [
        {"name": "server", "workers": 4, "bandwidth": "100 GB/s"},
        {"name": "cluster", "workers": 2, "bandwidth": "25 Gbit/s"},
    ],
    "memory": "16 GiB",
}

PLAN: dict[str, Any] = {
    "format": "pipedream/plan@1",
    "workload": "mlp",
    "workload_args": {"layers": "2"},
    "schedule": "pipedream",
    "microbatch_size": 4,
    "microbatches": 1,
    "world_size": 3,
    "stages": [
        {"first_layer": "0", "last_layer": "1", "replicas": 2, "ranks": [0, 1]},
        {"first_layer": "2", "last_layer": "2", "replicas": 1, "ranks": [2]},
    ],
    "layers": ["0", "1", "2"],
    "prediction": {
        "time_per_minibatch_ms": 2.5,
        "throughput_samples_per_s": 1600.0,
        "bottleneck": 1,
        "stage_ms": [2.0, 2.5],
        "memory_bytes": [40960, 8192],
        "data_parallel_time_per_minibatch_ms": 3.75,
        "cost_model": "pipedream",
    },
}

LOADERS: dict[str, Callable[[Path], object]] = {
    "profile": load_profile,
    "topology": load_topology,
    "plan": load_plan,
}
BASES: dict[str, dict[str, Any]] = {"profile": PROFILE, "topology": TOPOLOGY, "plan": PLAN}


def _write(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _check_message(err: FormatError, *, source: str, field: str, problem: str, fix: str) -> None:
    """The one-line ``FILE: FIELD: PROBLEM; FIX`` contract."""
    assert isinstance(err, PipedreamError) and isinstance(err, ValueError)
    assert err.source == source
    assert err.field == field
    assert problem in err.problem
    assert err.fix, "every error must say how to fix it"
    assert fix in err.fix
    where = f"{source}: {field}" if field else source
    assert str(err) == f"{where}: {err.problem}; {err.fix}"
    assert "\n" not in str(err)


# ---------------------------------------------------------------------------------------------
# Round trips


def test_profile_from_literal_dict() -> None:
    profile = Profile.from_dict(PROFILE)
    assert profile.workload == "mlp"
    assert profile.workload_args == {"layers": "2"}
    assert profile.microbatch_size == 4
    assert profile.layer_names == ["0", "1", "2"]
    assert profile.layers[0].compute_ms == 1.75
    assert profile.layers[0].saved_bytes == 2048
    assert profile.layers[0].optimizer_state_bytes == 0
    assert profile.layers[1].saved_bytes is None
    assert profile.layers[0].update_ms == 0.0625
    assert profile.layers[1].update_ms is None
    assert profile.overhead == ActionOverhead(
        forward_ms=0.25,
        backward_ms=0.125,
        update_ms=0.5,
        copy_ms_per_mib=0.0625,
        accumulate_ms_per_mib=0.09375,
        inputs_ms=0.03125,
        targets_ms=0.015625,
        loss_forward_ms=0.375,
        loss_backward_ms=0.1875,
    )
    assert profile.cut_bytes == (1024, 2048)
    assert [profile.boundary_bytes(i) for i in range(2)] == [1024, 2048]
    assert profile.index_of("2") == 2
    assert profile.to_dict() == PROFILE


def test_profile_without_cut_bytes_uses_output_bytes() -> None:
    data = copy.deepcopy(PROFILE)
    del data["cut_bytes"]
    profile = Profile.from_dict(data)
    assert profile.cut_bytes is None
    assert [profile.boundary_bytes(i) for i in range(3)] == [1024, 1024, 64]
    assert profile.to_dict() == data


def test_profile_concurrent_defaults_to_one_and_round_trips() -> None:
    assert Profile.from_dict(PROFILE).concurrent == 1
    assert "concurrent" not in Profile.from_dict(PROFILE).to_dict()
    data = {**copy.deepcopy(PROFILE), "concurrent": 2}
    profile = Profile.from_dict(data)
    assert profile.concurrent == 2
    assert profile.to_dict() == data


def test_profile_pass_spread_is_optional_and_round_trips() -> None:
    assert Profile.from_dict(PROFILE).spread is None
    data = {**copy.deepcopy(PROFILE), "pass_spread": {"forward": [1.0, 1.25], "backward": [0.5]}}
    profile = Profile.from_dict(data)
    assert profile.spread == PassSpread((1.0, 1.25), (0.5,))
    assert profile.to_dict() == data


def test_profile_tied_parameters_are_optional_and_round_trip() -> None:
    assert Profile.from_dict(PROFILE).tied == ()
    assert "tied" not in Profile.from_dict(PROFILE).to_dict()
    tied = [{"name": "0.weight", "layers": ["0", "2"], "bytes": 4096}]
    data = {**copy.deepcopy(PROFILE), "tied": tied}
    profile = Profile.from_dict(data)
    assert profile.tied == (TiedParameter("0.weight", ("0", "2"), 4096),)
    assert profile.to_dict() == data


def test_pass_spread_from_passes_divides_by_the_medians() -> None:
    spread = PassSpread.from_passes([(2.0, 4.0), (3.0, 8.0), (4.0, 6.0)])
    assert spread == PassSpread((2 / 3, 1.0, 4 / 3), (4 / 6, 8 / 6, 1.0))
    assert PassSpread.from_passes([]) is None
    assert PassSpread.from_passes([(0.0, 1.0)]) is None  # too fast for the clock


def test_profile_save_load(tmp_path: Path) -> None:
    profile = Profile.from_dict(PROFILE)
    path = tmp_path / "profile.yaml"
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert path.read_text().startswith("# pipedream profile of mlp: 3 layers\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.yaml"]  # no temp file left


def test_integer_layer_names_are_strings(tmp_path: Path) -> None:
    text = yaml.safe_dump(PROFILE, sort_keys=False).replace("name: '1'", "name: 1")
    assert "name: 1\n" in text
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert load_profile(path).layer_names == ["0", "1", "2"]


def test_topology_from_literal_dict() -> None:
    topology = Topology.from_dict(TOPOLOGY)
    assert topology == Topology(
        levels=(Level("server", 4, 1e11), Level("cluster", 2, 3.125e9)),
        memory=17179869184.0,
    )
    assert topology.num_workers == 8
    assert topology.describe() == (
        "4 x server @ 100 GB/s within 2 x cluster @ 3.125 GB/s = 8 workers, 16.0 GiB per worker"
    )
    assert topology.to_dict() == {
        "format": "pipedream/topology@1",
        "levels": [
            {"name": "server", "workers": 4, "bandwidth": 1e11},
            {"name": "cluster", "workers": 2, "bandwidth": 3.125e9},
        ],
        "memory": 17179869184.0,
    }
    assert Topology.from_dict(topology.to_dict()) == topology


def test_topology_defaults() -> None:
    topology = Topology.from_dict(
        {"format": "pipedream/topology@1", "levels": [{"workers": 3, "bandwidth": 1e9}]}
    )
    assert topology == Topology(levels=(Level("level0", 3, 1e9),), memory=None)
    assert Topology.single_level(3) == Topology(levels=(Level("workers", 3, 1e9),))
    assert "memory" not in topology.to_dict()


def test_topology_save_load(tmp_path: Path) -> None:
    topology = Topology.from_dict(TOPOLOGY)
    path = tmp_path / "topo.yaml"
    save_topology(topology, path)
    assert load_topology(path) == topology
    assert path.read_text().startswith(f"# cluster: {topology.describe()}\n")


def test_plan_from_literal_dict() -> None:
    plan = Plan.from_dict(PLAN)
    assert plan == Plan(
        workload="mlp",
        schedule="pipedream",
        microbatch_size=4,
        microbatches=1,
        world_size=3,
        stages=(StagePlan("0", "1", 2, (0, 1)), StagePlan("2", "2", 1, (2,))),
        workload_args={"layers": "2"},
        layers=("0", "1", "2"),
        recompute=False,
        prediction=Prediction(
            time_per_minibatch_ms=2.5,
            throughput_samples_per_s=1600.0,
            bottleneck=1,
            stage_ms=(2.0, 2.5),
            memory_bytes=(40960.0, 8192.0),
            data_parallel_time_per_minibatch_ms=3.75,
            cost_model="pipedream",
        ),
    )
    assert plan.num_stages == 2
    assert not plan.is_straight
    assert [plan.stage_of_rank(rank) for rank in range(3)] == [0, 0, 1]
    assert plan.to_dict() == PLAN


def test_hand_written_plan_gets_defaults() -> None:
    data = {
        "format": "pipedream/plan@1",
        "workload": "mlp",
        "schedule": "1f1b",
        "microbatch_size": 8,
        "world_size": 2,
        "stages": [
            {"first_layer": "0", "last_layer": "3", "ranks": [0]},
            {"first_layer": "4", "last_layer": "8", "ranks": [1]},
        ],
    }
    plan = Plan.from_dict(data)
    assert plan.microbatches == 1
    assert [stage.replicas for stage in plan.stages] == [1, 1]
    assert plan.workload_args == {}
    assert plan.layers is None and plan.prediction is None and plan.is_straight
    assert plan.to_dict() == {
        **data,
        "microbatches": 1,
        "stages": [
            {"first_layer": "0", "last_layer": "3", "replicas": 1, "ranks": [0]},
            {"first_layer": "4", "last_layer": "8", "replicas": 1, "ranks": [1]},
        ],
    }


def test_plan_workload_args_become_strings() -> None:
    data = copy.deepcopy(PLAN)
    data["workload_args"] = {"layers": 2, "lr": 0.5, "flag": True, "optimizer": "adam"}
    plan = Plan.from_dict(data)
    assert plan.workload_args == {"layers": "2", "lr": "0.5", "flag": "True", "optimizer": "adam"}


def test_plan_save_load(tmp_path: Path) -> None:
    plan = Plan.from_dict(PLAN)
    path = tmp_path / "sub" / "dir" / "plan.yaml"  # folders are created
    save_plan(plan, path)
    assert load_plan(path) == plan
    assert path.read_text().startswith(
        "# pipedream plan for mlp: 2 stages (replicas 2-1), schedule pipedream, 3 workers\n"
    )
    save_plan(Plan.from_dict({**PLAN, "recompute": True}), path)  # overwrite in place
    assert load_plan(path).recompute is True
    assert [p.name for p in path.parent.iterdir()] == ["plan.yaml"]


def test_shipped_config_plan_loads() -> None:
    plan = load_plan(REPO / "configs" / "mlp-4stage.yaml")
    assert plan.world_size == 4
    assert [(s.first_layer, s.last_layer) for s in plan.stages] == [
        ("0", "1"),
        ("2", "3"),
        ("4", "5"),
        ("6", "8"),
    ]


def test_atomic_write_keeps_the_old_file_when_the_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("old\n")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "new\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


# ---------------------------------------------------------------------------------------------
# Units


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10 GB/s", 1e10),
        ("100 Gbit/s", 1.25e10),
        ("100 Gbps", 1.25e10),
        ("10GBps", 1e10),
        (" 2.5 MB/s ", 2.5e6),
        ("1 KiB/s", 1024.0),
        ("1e9", 1e9),
        ("1.5e9 B/s", 1.5e9),
        (1e9, 1e9),
        (25, 25.0),
    ],
)
def test_parse_bandwidth(text: str | float, expected: float) -> None:
    assert parse_bandwidth(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16 GiB", 17179869184.0),
        ("512 MB", 5.12e8),
        ("100 kB", 1e5),
        ("1 KiB", 1024.0),
        ("2 TiB", 2.0 * 2**40),
        ("8 bit", 1.0),
        ("1e9", 1e9),
        ("4096", 4096.0),
        (4096, 4096.0),
    ],
)
def test_parse_bytes(text: str | int, expected: float) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["", "lots", "16 GB/s", "-1 GB", "16 kiB", "16 gB", "1.2.3 GB", "GB", "1e999 B"]
)
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"; write a ") as info:
        parse_bytes(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("text", ["fast", "10 GB/h", "-5 GB/s", "10 GiB/s/s", "nan"])
def test_parse_bandwidth_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"write a bandwidth such as '10 GB/s'"):
        parse_bandwidth(text)


def test_format_bytes() -> None:
    assert format_bytes(17179869184) == "16.0 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**20) == "3.0 MiB"
    assert format_bytes(2**60) == "1.0 EiB"  # it said 1073741824.0 GiB
    assert format_bytes(1.5 * 2**40) == "1.5 TiB"
    assert format_bytes(100) == "100 B"


# ---------------------------------------------------------------------------------------------
# Validation: (file kind, edit of the literal dict, field, problem, fix)

Edit = Callable[[dict[str, Any]], None]


def _set(*path: str | int, value: Any) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        target: Any = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _delete(*path: str | int) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        target: Any = data
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return edit


def _rename(old: str, new: str) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        data[new] = data.pop(old)

    return edit


def _stages(*ranges: tuple[str, str]) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        data["world_size"] = len(ranges)
        data["stages"] = [
            {"first_layer": first, "last_layer": last, "replicas": 1, "ranks": [i]}
            for i, (first, last) in enumerate(ranges)
        ]
        del data["prediction"]

    return edit


# fmt: off
CASES: list[tuple[str, str, Edit, str, str, str]] = [
    # id, kind, edit, field, problem, fix
    ("profile-missing-key", "profile", _delete("device"), "device",
     "required field is missing", "add 'device: ...'"),
    ("profile-missing-layer-key", "profile", _delete("layers", 1, "forward_ms"),
     "layers[1].forward_ms", "required field is missing", "add 'forward_ms: ...'"),
    ("profile-unknown-key", "profile", _rename("workload_args", "workload_arg"), "workload_arg",
     "unknown key", "did you mean 'workload_args'?"),
    ("profile-unknown-layer-key", "profile", _set("layers", 0, "saved_byte", value=5),
     "layers[0].saved_byte", "unknown key", "did you mean 'saved_bytes'?"),
    ("profile-unrelated-key", "profile", _set("colour", value="red"), "colour",
     "unknown key", "remove it or use one of: concurrent, cut_bytes, device, device_memory, dtype"),
    ("profile-int-is-string", "profile", _set("microbatch_size", value="four"),
     "microbatch_size", "expected an integer, got str 'four'", "write a whole number"),
    ("profile-int-is-bool", "profile", _set("microbatch_size", value=True),
     "microbatch_size", "expected an integer, got bool True", "write a whole number"),
    ("profile-int-is-fraction", "profile", _set("layers", 0, "output_bytes", value=1.5),
     "layers[0].output_bytes", "expected an integer, got float 1.5", "write a whole number"),
    ("profile-number-is-string", "profile", _set("layers", 2, "forward_ms", value="fast"),
     "layers[2].forward_ms", "expected a number, got str 'fast'", "write a number"),
    ("profile-int-is-null", "profile", _set("layers", 1, "parameter_bytes", value=None),
     "layers[1].parameter_bytes", "expected an integer, got nothing (null)",
     "write a whole number"),
    ("profile-negative-bytes", "profile", _set("layers", 2, "parameter_bytes", value=-4),
     "layers[2].parameter_bytes", "must be >= 0, got -4", "use 0 or more"),
    ("profile-negative-ms", "profile", _set("layers", 1, "backward_ms", value=-0.5),
     "layers[1].backward_ms", "must be >= 0, got -0.5", "use 0 or more"),
    ("profile-nan", "profile", _set("layers", 0, "forward_ms", value=math.nan),
     "layers[0].forward_ms", "must be a finite number, got nan", "write a finite number"),
    ("profile-inf", "profile", _set("layers", 0, "backward_ms", value=math.inf),
     "layers[0].backward_ms", "must be a finite number, got inf", "write a finite number"),
    # the planner's tables of every range ran out of memory (at 20000 layers)
    ("profile-too-many-layers", "profile", _set("layers", value=[{}] * 4097), "layers",
     "4097 layers, at most 4096 supported (planning grows with the square of the layers)",
     "profile coarser layers: a smaller --depth, or --layers patterns"),
    # float() of it raised OverflowError
    ("profile-huge-integer", "profile", _set("layers", 0, "forward_ms", value=10**400),
     "layers[0].forward_ms", "must be a finite number, got an integer of about 10^400",
     "write a finite number such as 1.5"),
    ("profile-huge-negative-integer", "profile", _set("layers", 0, "forward_ms", value=-10**400),
     "layers[0].forward_ms", "must be a finite number, got an integer of about -10^400",
     "write a finite number such as 1.5"),
    ("profile-tied-unknown-layer", "profile",
     _set("tied", value=[{"name": "w", "layers": ["0", "9"], "bytes": 8}]), "tied[0].layers",
     "names '9', which is not a layer of the profile", "list the names of the layers"),
    ("profile-tied-one-layer", "profile",
     _set("tied", value=[{"name": "w", "layers": ["1", "1"], "bytes": 8}]), "tied[0].layers",
     "lists 1 distinct layer(s)", "a tied parameter is used by two or more layers"),
    ("profile-tied-no-bytes", "profile",
     _set("tied", value=[{"name": "w", "layers": ["0", "1"]}]), "tied[0].bytes",
     "required field is missing", "add 'bytes: ...'"),
    ("profile-zero-microbatch", "profile", _set("microbatch_size", value=0),
     "microbatch_size", "must be >= 1, got 0", "use 1 or more"),
    ("profile-wrong-format", "profile", _set("format", value="pipedream/plan@1"), "format",
     "expected 'pipedream/profile@1', got 'pipedream/plan@1'", "is this a profile file?"),
    ("profile-no-format", "profile", _delete("format"), "format",
     "required field is missing", "add 'format: ...'"),
    ("profile-duplicate-layer", "profile", _set("layers", 2, "name", value="0"),
     "layers[2].name", "duplicate layer name '0'", "layer names must be unique"),
    ("profile-empty-name", "profile", _set("layers", 1, "name", value=""),
     "layers[1].name", "expected a non-empty string, got str ''", "write a non-empty string"),
    ("profile-concurrent-zero", "profile", _set("concurrent", value=0),
     "concurrent", "must be >= 1, got 0", "use 1 or more"),
    ("profile-update-negative", "profile", _set("layers", 0, "update_ms", value=-1),
     "layers[0].update_ms", "must be >= 0, got -1", "use 0 or more"),
    ("profile-overhead-missing", "profile", _delete("overhead_ms", "update_ms"),
     "overhead_ms.update_ms", "required field is missing", "add 'update_ms: ...'"),
    ("profile-overhead-unknown", "profile", _set("overhead_ms", "fwd_ms", value=1.0),
     "overhead_ms.fwd_ms", "unknown key", "remove it or use one of: accumulate_ms_per_mib"),
    ("profile-overhead-type", "profile", _set("overhead_ms", value=[1, 2]),
     "overhead_ms", "expected a mapping, got list", "write it as 'key: value' lines"),
    ("profile-spread-zero", "profile",
     _set("pass_spread", value={"forward": [1, 0], "backward": [1]}),
     "pass_spread.forward[1]", "must be > 0, got 0", "use a positive value"),
    ("profile-spread-missing", "profile", _set("pass_spread", value={"forward": [1]}),
     "pass_spread.backward", "required field is missing", "add 'backward: ...'"),
    ("profile-cut-bytes-length", "profile", _set("cut_bytes", value=[1024]), "cut_bytes",
     "has 1 entries but the profile has 3 layers", "number of layers - 1"),
    ("profile-cut-bytes-negative", "profile", _set("cut_bytes", value=[1024, -1]),
     "cut_bytes[1]", "must be >= 0, got -1", "use 0 or more"),
    ("profile-cut-bytes-type", "profile", _set("cut_bytes", value=["1 kB", 2]),
     "cut_bytes[0]", "expected an integer, got str '1 kB'", "write a whole number"),
    ("profile-no-layers", "profile", _set("layers", value=[]), "layers",
     "must not be empty", "give at least one entry"),
    ("profile-layers-not-list", "profile", _set("layers", value={"0": 1}), "layers",
     "expected a list, got dict", "'- item' lines"),
    ("profile-layer-not-mapping", "profile", _set("layers", 1, value=["1", "Linear"]),
     "layers[1]", "expected a mapping, got list", "'key: value' lines"),
    ("profile-workload-arg-list", "profile", _set("workload_args", "layers", value=[1, 2]),
     "workload_args.layers", "expected a string or number, got list [1, 2]",
     "one value per option"),
    ("profile-workload-args-string", "profile", _set("workload_args", value="layers=2"),
     "workload_args", "expected a mapping, got str 'layers=2'", "'key: value' lines"),
    ("topology-missing-levels", "topology", _delete("levels"), "levels",
     "required field is missing", "add 'levels: ...'"),
    ("topology-unknown-key", "topology", _rename("memory", "memroy"), "memroy",
     "unknown key", "did you mean 'memory'?"),
    ("topology-unknown-level-key", "topology",
     _set("levels", 1, "bandwith", value="1 GB/s"),
     "levels[1].bandwith", "unknown key", "did you mean 'bandwidth'?"),
    ("topology-zero-workers", "topology", _set("levels", 0, "workers", value=0),
     "levels[0].workers", "must be >= 1, got 0", "use 1 or more"),
    ("topology-workers-string", "topology", _set("levels", 0, "workers", value="4"),
     "levels[0].workers", "expected an integer, got str '4'", "write a whole number"),
    ("topology-bad-bandwidth", "topology", _set("levels", 1, "bandwidth", value="fast"),
     "levels[1].bandwidth", "cannot parse 'fast'", "write a bandwidth such as '10 GB/s'"),
    ("topology-zero-bandwidth", "topology", _set("levels", 0, "bandwidth", value=0),
     "levels[0].bandwidth", "must be > 0, got 0", "use a positive value"),
    ("topology-negative-bandwidth", "topology", _set("levels", 0, "bandwidth", value=-1e9),
     "levels[0].bandwidth", "must be > 0, got -1e+09", "use a positive value"),
    ("topology-memory-as-bandwidth", "topology", _set("memory", value="16 GB/s"), "memory",
     "cannot parse '16 GB/s'", "write a size such as '16 GiB'"),
    ("topology-memory-inf", "topology", _set("memory", value=math.inf), "memory",
     "must be a finite number, got inf", "write a finite number"),
    ("topology-wrong-format", "topology", _set("format", value="pipedream/topology@2"),
     "format", "expected 'pipedream/topology@1', got 'pipedream/topology@2'",
     "is this a topology file?"),
    ("topology-too-many-workers", "topology",
     _set("levels", value=[{"workers": 1024, "bandwidth": 1}, {"workers": 2048, "bandwidth": 1}]),
     "levels", "describes 2097152 workers", "at most 1048576 supported"),
    ("topology-bandwidth-tiny", "topology",
     _set("levels", value=[{"workers": 2, "bandwidth": 1e-300}]),
     "levels[0].bandwidth", "1e-300 bytes/s is below 1 byte/s",
     "write the link's bandwidth, e.g. 1e9 or '10 GB/s'"),
    ("topology-level-too-large", "topology",
     _set("levels", value=[{"workers": 2, "bandwidth": 1}, {"workers": 4097, "bandwidth": 1}]),
     "levels[1].workers", "4097 units in one level, at most 4096 supported",
     "split the level in two (e.g. GPUs per server, then servers)"),
    ("plan-missing-world-size", "plan", _delete("world_size"), "world_size",
     "required field is missing", "add 'world_size: ...'"),
    ("plan-missing-stage-key", "plan", _delete("stages", 1, "first_layer"),
     "stages[1].first_layer", "required field is missing", "add 'first_layer: ...'"),
    ("plan-unknown-key", "plan", _set("recompte", value=True), "recompte",
     "unknown key", "did you mean 'recompute'?"),
    ("plan-unknown-stage-key", "plan", _set("stages", 1, "replica", value=1),
     "stages[1].replica", "unknown key", "did you mean 'replicas'?"),
    ("plan-unknown-prediction-key", "plan", _set("prediction", "speedup", value=2.0),
     "prediction.speedup", "unknown key", "remove it or use one of: bottleneck"),
    ("plan-world-size-string", "plan", _set("world_size", value="two"), "world_size",
     "expected an integer, got str 'two'", "write a whole number"),
    ("plan-world-size-zero", "plan", _set("world_size", value=0), "world_size",
     "must be >= 1, got 0", "use 1 or more"),
    ("plan-recompute-string", "plan", _set("recompute", value="yes"), "recompute",
     "expected true or false, got str 'yes'", "write true or false"),
    ("plan-unknown-schedule", "plan", _set("schedule", value="pipedream2"), "schedule",
     "unknown schedule 'pipedream2'",
     "use one of pipedream, pipedream-vs, 2bw, 1f1b, gpipe, interleaved-"
     "1f1b, zb-h1, zbv"),
    ("plan-several-stages-misplaced", "plan", _set("schedule", value="interleaved-1f1b"),
     "stages", "schedule 'interleaved-1f1b' replicates whole pipelines: give every stage the "
     "same number of replicas; got [2, 1]",
     "place the stages as the schedule does"),
    # stages placed right, microbatches not in the schedule's groups: not the stages' fault
    ("plan-several-stages-microbatches", "plan",
     lambda d: d.update(
         schedule="interleaved-1f1b", microbatches=3, world_size=2, layers=["0", "1", "2", "3"],
         prediction=None, workload_args={"layers": "3"},
         stages=[{"first_layer": str(s), "last_layer": str(s), "ranks": [s % 2]} for s in range(4)],
     ),
     "microbatches", "schedule 'interleaved-1f1b' needs microbatches in groups of the 2 ranks; "
     "got 3 (use a multiple of 2)", "e.g. microbatches: 4"),
    ("plan-microbatches-pipedream", "plan", _set("microbatches", value=4), "microbatches",
     "must be 1 for schedule 'pipedream', got 4", "use schedule '2bw'"),
    ("plan-microbatches-pipedream-vs", "plan",
     lambda d: d.update(schedule="pipedream-vs", microbatches=2), "microbatches",
     "must be 1 for schedule 'pipedream-vs', got 2", "use schedule '2bw'"),
    # tables of 10^12 microbatches: every rank ran out of memory building them
    ("plan-microbatches-huge", "plan",
     lambda d: d.update(schedule="1f1b", microbatches=10**12), "microbatches",
     "must be <= 16384, got 1000000000000",
     "split each minibatch into fewer, larger microbatches"),
    ("plan-rank-out-of-range", "plan", _set("stages", 1, "ranks", value=[3]),
     "stages[1].ranks", "rank 3 is out of range for world_size 3", "use ranks 0..2"),
    ("plan-rank-duplicated", "plan", _set("stages", 1, "ranks", value=[1]),
     "stages[1].ranks", "rank 1 is already used by stage 0",
     "each rank runs exactly one stage replica"),
    ("plan-rank-missing", "plan", _set("world_size", value=5), "world_size",
     "is 5 but ranks [3, 4] run no stage", "set world_size to 3 or assign those ranks"),
    # a huge world_size is named, not enumerated (which took all the host's memory)
    ("plan-world-size-huge", "plan", _set("world_size", value=10**12), "world_size",
     "is 1000000000000 but ranks [3, 4, 5, 6, 7, 8, 9, 10] and 999999999989 more run no stage",
     "set world_size to 3 or assign those ranks"),
    ("plan-rank-negative", "plan", _set("stages", 0, "ranks", value=[-1, 1]),
     "stages[0].ranks[0]", "must be >= 0, got -1", "use 0 or more"),
    ("plan-rank-string", "plan", _set("stages", 0, "ranks", value=[0, "one"]),
     "stages[0].ranks[1]", "expected an integer, got str 'one'", "write a whole number"),
    ("plan-replicas-vs-ranks", "plan", _set("stages", 0, "replicas", value=3),
     "stages[0].ranks", "lists 2 ranks for 3 replicas", "give exactly one rank per replica"),
    ("plan-replicas-zero", "plan", _set("stages", 0, "replicas", value=0),
     "stages[0].replicas", "must be >= 1, got 0", "use 1 or more"),
    ("plan-no-stages", "plan", _set("stages", value=[]), "stages",
     "must not be empty", "give at least one entry"),
    ("plan-stage-gap", "plan", _stages(("0", "0"), ("2", "2")), "stages[1]",
     "covers layers '2'..'2', but the stage must start at '1'",
     "stages must be contiguous, in order, and cover every layer once"),
    ("plan-stage-overlap", "plan", _stages(("0", "1"), ("1", "2")), "stages[1]",
     "must start at '2'", "stages must be contiguous, in order, and cover every layer once"),
    ("plan-stage-not-first", "plan", _stages(("1", "2"),), "stages[0]",
     "must start at '0'", "stages must be contiguous"),
    ("plan-stage-reversed", "plan", _stages(("0", "0"), ("2", "1")), "stages[1].last_layer",
     "layer '1' comes before first_layer '2'", "first_layer..last_layer in the order"),
    ("plan-stages-uncovered", "plan", _stages(("0", "0"), ("1", "1")), "stages",
     "end at layer '1', leaving '2'.. uncovered", "extend the last stage"),
    ("plan-stage-unknown-layer", "plan", _set("stages", 1, "last_layer", value="7"),
     "stages[1].last_layer", "unknown layer '7'", "use a name from 'layers' ('0' .. '2')"),
    ("plan-duplicate-layers", "plan", _set("layers", value=["0", "1", "0"]), "layers[2]",
     "layer '0' is listed twice (first at layers[0])", "list each layer once"),
    ("plan-layer-name-mapping", "plan", _set("layers", 1, value={"name": "1"}), "layers[1]",
     "expected a non-empty string, got dict", "write a non-empty string"),
    ("plan-workload-arg-null", "plan", _set("workload_args", "layers", value=None),
     "workload_args.layers", "expected a string or number, got nothing (null)",
     "one value per option"),
    ("plan-prediction-method", "plan", _set("prediction", "method", value="guess"),
     "prediction.method", "unknown prediction method 'guess'",
     "use one of closed-form, simulated (or leave it out)"),
    ("plan-stage-ms-length", "plan", _set("prediction", "stage_ms", value=[2.0]),
     "prediction.stage_ms", "has 1 entries for 2 stages", "one per stage"),
    ("plan-memory-bytes-length", "plan", _set("prediction", "memory_bytes", value=[1, 2, 3]),
     "prediction.memory_bytes", "has 3 entries for 2 stages", "one per stage"),
    ("plan-stage-ms-negative", "plan", _set("prediction", "stage_ms", value=[2.0, -1.0]),
     "prediction.stage_ms[1]", "must be >= 0, got -1", "use 0 or more"),
    ("plan-bottleneck-range", "plan", _set("prediction", "bottleneck", value=2),
     "prediction.bottleneck", "stage 2 does not exist", "use 0..1"),
    ("plan-prediction-missing-key", "plan", _delete("prediction", "time_per_minibatch_ms"),
     "prediction.time_per_minibatch_ms", "required field is missing",
     "add 'time_per_minibatch_ms: ...'"),
    ("plan-prediction-not-mapping", "plan", _set("prediction", value=[2.5]), "prediction",
     "expected a mapping, got list [2.5]", "'key: value' lines"),
]
# fmt: on


@pytest.mark.parametrize(
    ("kind", "edit", "field", "problem", "fix"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_malformed_file_names_file_field_and_fix(
    tmp_path: Path, kind: str, edit: Edit, field: str, problem: str, fix: str
) -> None:
    data = copy.deepcopy(BASES[kind])
    edit(data)
    path = _write(tmp_path / f"{kind}.yaml", data)
    with pytest.raises(FormatError) as info:
        LOADERS[kind](path)
    _check_message(info.value, source=str(path), field=field, problem=problem, fix=fix)


def test_case_ids_are_unique() -> None:
    ids = [case[0] for case in CASES]
    assert len(ids) == len(set(ids))


def test_from_dict_of_a_non_mapping_names_the_default_source() -> None:
    with pytest.raises(FormatError) as info:
        Plan.from_dict(["stages"])
    _check_message(
        info.value,
        source="<plan>",
        field="(top level)",
        problem="expected a mapping, got list ['stages']",
        fix="'key: value' lines",
    )


# ---------------------------------------------------------------------------------------------
# Files that are not YAML mappings at all


def _syntax_error(path: Path) -> None:
    path.write_text("format: pipedream/plan@1\nstages: [1, 2\n")


def _empty(path: Path) -> None:
    path.write_text("")


def _comments_only(path: Path) -> None:
    path.write_text("# nothing here\n")


def _top_level_list(path: Path) -> None:
    path.write_text("- format: pipedream/plan@1\n")


def _top_level_scalar(path: Path) -> None:
    path.write_text("hello\n")


def _not_utf8(path: Path) -> None:
    path.write_bytes(b"format: \xff\xfe\n")


def _directory(path: Path) -> None:
    path.mkdir()


def _long_integer(path: Path) -> None:
    path.write_text("format: x\nsize: " + "9" * 5000 + "\n")


def _pythons_own_words(make: Callable[[], object]) -> str:
    """What this Python says when ``make`` fails (its wording changes between versions)."""
    try:
        make()
    except ValueError as exc:
        return str(exc)
    raise AssertionError("expected a ValueError")


LONG_INTEGER = _pythons_own_words(lambda: int("9" * 5000)).split(";")[0]
"""'Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits' (from
3.11; 3.10 says '(4300)'), without Python's hint after ';', which the message leaves out."""


def _impossible_date(path: Path) -> None:
    path.write_text("format: x\nwhen: 2026-13-45\n")


def _missing(path: Path) -> None:
    pass


# fmt: off
@pytest.mark.parametrize("kind", ["profile", "topology", "plan"])
@pytest.mark.parametrize(
    ("make", "problem", "fix"),
    [
        (_syntax_error, "not valid YAML at line 3, column 1", "fix the syntax of this {kind} file"),
        (_empty, "the {kind} file is empty", "is this a {kind} file?"),
        (_comments_only, "the {kind} file is empty", "is this a {kind} file?"),
        (_top_level_list, "expected a YAML mapping at the top level, got list",
         "is this a {kind} file?"),
        (_top_level_scalar, "expected a YAML mapping at the top level, got str",
         "is this a {kind} file?"),
        (_not_utf8, "cannot read {kind} file", "check its permissions and that it is UTF-8"),
        (_directory, "is a directory", "pass a {kind} YAML file"),
        (_missing, "{kind} file not found", "check the path"),
        # both raised ValueError from inside the YAML reader
        (_long_integer, f"holds a value YAML cannot read: {LONG_INTEGER}", "correct or remove it"),
        (_impossible_date, "holds a value YAML cannot read: month must be in 1..12",
         "correct or remove it"),
    ],
    ids=["syntax", "empty", "comments-only", "list", "scalar", "not-utf8", "directory", "missing",
         "long-integer", "impossible-date"],
)
# fmt: on
def test_unreadable_file(
    tmp_path: Path, kind: str, make: Callable[[Path], None], problem: str, fix: str
) -> None:
    path = tmp_path / "input.yaml"
    make(path)
    with pytest.raises(FormatError) as info:
        LOADERS[kind](path)
    _check_message(
        info.value,
        source=str(path),
        field="",
        problem=problem.format(kind=kind),
        fix=fix.format(kind=kind),
    )


def test_stage_after_all_layers_are_covered_is_a_clean_error(tmp_path) -> None:
    """Found by fuzzing: a stage after one that already ends at the last layer."""
    from pipedream.errors import FormatError
    from pipedream.formats.plan import Plan

    data = {
        "format": "pipedream/plan@1",
        "workload": "mlp",
        "schedule": "pipedream",
        "microbatch_size": 8,
        "world_size": 2,
        "layers": ["0", "1"],
        "stages": [
            {"first_layer": "0", "last_layer": "1", "ranks": [0]},
            {"first_layer": "1", "last_layer": "1", "ranks": [1]},
        ],
    }
    with pytest.raises(FormatError, match="earlier stages already cover every layer"):
        Plan.from_dict(data, source="plan.yaml")
