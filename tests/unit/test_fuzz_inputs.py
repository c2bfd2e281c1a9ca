"""Property-based fuzzing of every file the tool reads: mutated profiles, topologies, plans and
checkpoint manifests end in a clean error (a PipedreamError, i.e. one line and exit 2 in the CLI)
or load fine — never another exception, never a hang. The number of cases is reported."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipedream.errors import PipedreamError
from pipedream.formats import load_plan, load_profile, load_topology
from pipedream.runtime.checkpoint import load_manifest

from fuzz_cases import CASES

PROFILE = {
    "format": "pipedream/profile@1",
    "workload": "mlp",
    "microbatch_size": 8,
    "device": "cpu",
    "dtype": "float32",
    "layers": [
        {
            "name": "0",
            "type": "Linear",
            "forward_ms": 0.1,
            "backward_ms": 0.2,
            "output_bytes": 2048,
            "parameter_bytes": 4096,
            "saved_bytes": 1024,
        },
        {
            "name": "1",
            "type": "Linear",
            "forward_ms": 0.3,
            "backward_ms": 0.4,
            "output_bytes": 128,
            "parameter_bytes": 512,
        },
    ],
    "cut_bytes": [2048],
}
TOPOLOGY = {
    "format": "pipedream/topology@1",
    "levels": [
        {"name": "server", "workers": 4, "bandwidth": "10 GB/s"},
        {"name": "cluster", "workers": 2, "bandwidth": 1.25e9},
    ],
    "memory": "16 GiB",
}
PLAN = {
    "format": "pipedream/plan@1",
    "workload": "mlp",
    "workload_args": {"layers": "1"},
    "schedule": "pipedream",
    "microbatch_size": 8,
    "microbatches": 1,
    "world_size": 3,
    "stages": [
        {"first_layer": "0", "last_layer": "0", "replicas": 2, "ranks": [0, 1]},
        {"first_layer": "1", "last_layer": "1", "replicas": 1, "ranks": [2]},
    ],
    "layers": ["0", "1"],
    "prediction": {
        "time_per_minibatch_ms": 1.0,
        "throughput_samples_per_s": 8000.0,
        "bottleneck": 0,
        "stage_ms": [1.0, 0.5],
        "memory_bytes": [100, 200],
        "data_parallel_time_per_minibatch_ms": 2.0,
    },
}
MANIFEST = {
    "format": "pipedream/checkpoint@1",
    "step": 4,
    "stages": [{"file": "stage-00.pt", "sha256": "ab" * 32}],
}

ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.just("10 GB/s"),
    st.just("-1 GiB"),
    st.just("unknown-layer"),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    st.just(math.inf),
    st.sampled_from([-1, 0, 1, 2, 3, 7, 10**12]),
)


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside nested dicts and lists."""
    out = [prefix] if prefix else []
    if isinstance(data, dict):
        for key, value in data.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            out += _paths(value, prefix + (index,))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        action = draw(st.sampled_from(["replace", "delete", "extra", "duplicate"]))
        if action == "replace":
            parent[last] = draw(ODD_VALUES)
        elif action == "delete":
            del parent[last]
        elif action == "extra" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(ODD_VALUES)
        elif action == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[last]))
    return data


def _check(tmp: Path, name: str, data: Any, loader) -> None:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    CASES[name] += 1
    try:
        loader(path)
    except PipedreamError as exc:
        assert "\n" not in str(exc), str(exc)  # one clear line
        assert str(path) in str(exc)  # names the file


SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(data=mutated(PROFILE))
def test_fuzz_profile(tmp_path: Path, data: dict[str, Any]) -> None:
    _check(tmp_path, "profile", data, load_profile)


@SETTINGS
@given(data=mutated(TOPOLOGY))
def test_fuzz_topology(tmp_path: Path, data: dict[str, Any]) -> None:
    _check(tmp_path, "topology", data, load_topology)


@SETTINGS
@given(data=mutated(PLAN))
def test_fuzz_plan(tmp_path: Path, data: dict[str, Any]) -> None:
    _check(tmp_path, "plan", data, load_plan)


@SETTINGS
@given(data=mutated(MANIFEST))
def test_fuzz_manifest(tmp_path: Path, data: dict[str, Any]) -> None:
    (tmp_path / "manifest.yaml").write_text(yaml.safe_dump(data, allow_unicode=True))
    CASES["manifest"] += 1
    try:
        load_manifest(tmp_path)
    except PipedreamError as exc:
        assert "\n" not in str(exc)
