"""Skip connections outside the runtime: the profile's ``values``, the simulator sending a skip
straight to its consumer's stage, and the trace reader rebuilding the tables the run ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipedream.errors import FormatError
from pipedream.formats import LayerProfile, Plan, Profile, ProfileValue, StagePlan
from pipedream.formats.trace import RankTrace, TraceEvent, load_traces, write_trace
from pipedream.optimizer.measured import message_times
from pipedream.optimizer.simulator import Network, pipeline_edges, simulate, stage_work
from pipedream.schedules import build_tables, spec_from_plan

LAYERS = tuple(LayerProfile(name, name, 1.0, 1.0, 2000, 0) for name in "abc")
# a feeds b and, past it, c (a skip connection); b feeds c; c's output goes to the loss
VALUES = (
    ProfileValue("y", 1000, "a", ("b",)),
    ProfileValue("x", 1000, "a", ("c",)),
    ProfileValue("z", 1000, "b", ("c",)),
    ProfileValue("out", 8, "c", (), loss=True),
)
WIRED = Profile("toy", 1, "cpu", "float32", LAYERS, (2000, 2000), values=VALUES)
CHAIN = Profile("toy", 1, "cpu", "float32", LAYERS, (2000, 2000))
PLAN = Plan(
    "toy",
    "gpipe",
    1,
    1,
    3,
    tuple(StagePlan(name, name, 1, (rank,)) for rank, name in enumerate("abc")),
)
NETWORK = Network((4,), (2e6,))  # 1000 bytes take 0.5 ms, 2000 bytes 1 ms


def test_values_round_trip_through_the_file() -> None:
    loaded = Profile.from_dict(yaml.safe_load(yaml.safe_dump(WIRED.to_dict())))
    assert loaded == WIRED
    assert WIRED.to_dict()["values"][1] == {
        "name": "x",
        "bytes": 1000,
        "made_by": "a",
        "used_by": ["c"],
    }
    assert "values" not in CHAIN.to_dict()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"name": "v", "bytes": 4, "made_by": "q", "used_by": ["b"]}, "values[0].made_by"),
        ({"name": "v", "bytes": 4, "made_by": "b", "used_by": ["a"]}, "does not come after"),
        ({"name": "v", "bytes": 4, "made_by": "b", "used_by": ["b"]}, "does not come after"),
        ({"name": "v", "bytes": 4, "used_by": ["zz"]}, "values[0].used_by[0]"),
        ({"name": "v", "bytes": 4, "made_by": "a", "used_by": []}, "loss does not use"),
        ({"name": "v", "bytes": -4, "used_by": ["a"]}, "values[0].bytes"),
        ({"name": "v", "bytes": 4, "used_by": ["a"], "grad": "no"}, "values[0].grad"),
    ],
)
def test_a_bad_value_names_its_field(value: dict, message: str) -> None:
    data = CHAIN.to_dict() | {"values": [value]}
    with pytest.raises(FormatError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Profile.from_dict(data, source="p.yaml")


def test_an_empty_list_of_values_is_not_a_chain() -> None:
    with pytest.raises(FormatError, match="p.yaml: values: is empty, but the profile's 3 layers"):
        Profile.from_dict(CHAIN.to_dict() | {"values": []}, source="p.yaml")


def test_the_simulator_sends_a_skip_connection_straight_to_its_consumer() -> None:
    # wired: F0 (1 ms); y to stage 1 and x to stage 2 at once (0.5 ms each, two links); F1;
    # z (0.5); F2, B2; the gradients of z and x back at once (0.5); B1; y's (0.5); B0: 8 ms.
    # A chain relays x through stage 1: 2000 bytes on every link, 1 ms each way: 10 ms.
    wired = stage_work(PLAN, WIRED)
    assert [w.sends for w in wired] == [
        {1: (1000.0, 1000.0), 2: (1000.0, 1000.0)},
        {2: (1000.0, 1000.0)},
        {},
    ]
    assert pipeline_edges(wired) == ((0, 1), (0, 2), (1, 2))
    timeline = simulate(PLAN, wired, NETWORK, num_minibatches=6)
    assert timeline.time_per_minibatch_ms == pytest.approx(8.0)
    links = {(m.source, m.destination, m.kind) for m in timeline.messages}
    assert links == {
        (0, 1, "activations"),
        (0, 2, "activations"),
        (1, 2, "activations"),
        (2, 1, "gradients"),
        (2, 0, "gradients"),
        (1, 0, "gradients"),
    }
    chain = stage_work(PLAN, CHAIN)
    assert pipeline_edges(chain) is None
    assert simulate(PLAN, chain, NETWORK, num_minibatches=6).time_per_minibatch_ms == (
        pytest.approx(10.0)
    )


def test_a_value_without_a_gradient_sends_no_gradient_bytes_back() -> None:
    values = (ProfileValue("ids", 1000, None, ("c",), grad=False), *VALUES[:1], VALUES[2])
    profile = Profile("toy", 1, "cpu", "float32", LAYERS, (2000, 2000), values=values)
    assert stage_work(PLAN, profile)[0].sends == {1: (1000.0, 1000.0), 2: (1000.0, 0.0)}


def _traces_running(tables: dict, edges: tuple | None) -> list[RankTrace]:
    """Traces whose ranks ran ``tables``, one action per millisecond."""
    traces = []
    for rank, table in sorted(tables.items()):
        events = tuple(
            TraceEvent(str(a), a.op, a.stage, a.index, i / 1000, (i + 1) / 1000)
            for i, a in enumerate(table)
        )
        traces.append(RankTrace(rank, rank, 3, events, f"rank-{rank}", edges))
    return traces


def test_the_trace_reader_rebuilds_the_tables_of_a_run_with_a_skip(tmp_path: Path) -> None:
    edges = ((0, 1), (0, 2), (1, 2))
    tables = build_tables(spec_from_plan(PLAN, 0, 4, edges))
    for trace in _traces_running(tables, edges):
        write_trace(
            tmp_path,
            [(e.action, e.start, e.end, 0.0, 0.0) for e in trace.events],
            rank=trace.rank,
            stage=trace.stage,
            world_size=3,
            edges=edges,
        )
    traces = load_traces(tmp_path)
    assert [t.edges for t in traces] == [edges] * 3
    messages = message_times(traces, PLAN)
    assert {(m.source, m.destination) for m in messages} == {
        (0, 1),
        (0, 2),
        (1, 2),
        (2, 1),
        (2, 0),
        (1, 0),
    }
    assert len(messages) == 6 * 4
    # read as a chain (what it did before traces carried their wiring), no table matches
    assert message_times(_traces_running(tables, None), PLAN) == []


@pytest.mark.parametrize("edges", ["oops", [[0, 1, 2]], [[0, -1]], [[0, True]]])
def test_a_trace_with_damaged_wiring_names_the_field(tmp_path: Path, edges: object) -> None:
    path = write_trace(tmp_path, [("0F0", 0.0, 1.0, 0.0, 0.0)], rank=0, stage=0, world_size=1)
    payload = json.loads(path.read_text())
    path.write_text(json.dumps(payload | {"edges": edges}))
    with pytest.raises(FormatError, match="rank-000.json: edges: expected a list of"):
        load_traces(tmp_path)


def test_a_trace_without_wiring_reads_as_a_chain(tmp_path: Path) -> None:
    path = write_trace(tmp_path, [("0F0", 0.0, 1.0, 0.0, 0.0)], rank=0, stage=0, world_size=1)
    payload = json.loads(path.read_text())
    del payload["edges"], payload["tied"]  # as traces written before they were recorded
    path.write_text(json.dumps(payload))
    (trace,) = load_traces(tmp_path)
    assert (trace.edges, trace.tied) == (None, ())
