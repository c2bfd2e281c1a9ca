"""``--trace`` on a real run: every action of every rank's table appears exactly once, in table
order; ``pipedream trace`` merges the ranks into a valid Chrome trace (and a PNG)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from pipedream.formats.plan import load_plan
from pipedream.optimizer.measured import message_times
from pipedream.runtime.trace import CATEGORIES, load_traces
from pipedream.runtime.trace_plot import matplotlib_available
from pipedream.schedules import build_tables, spec_from_plan

from launching import launch, run_cli, straight_plan, write_plan

SLEEP_ARGS = {"layers": "3", "forward_ms": "1", "backward_ms": "1", "activation_bytes": "1024"}


@pytest.mark.parametrize(
    ("schedule", "microbatches", "replicas", "steps"),
    [
        ("pipedream", 1, [1, 1, 1], 5),  # async: warm-up forwards, stashed versions
        ("1f1b", 2, [1, 2], 4),  # replicated stage 1: allreduces
    ],
)
def test_trace_has_every_action_once(
    tmp_path: Path, schedule: str, microbatches: int, replicas: list[int], steps: int
) -> None:
    stages = [["0"], ["1"], ["2"]] if len(replicas) == 3 else [["0"], ["1", "2"]]
    plan = straight_plan(
        "sleep",
        stages,
        schedule=schedule,
        microbatch_size=4,
        microbatches=microbatches,
        workload_args=SLEEP_ARGS,
        replicas=replicas,
    )
    path = write_plan(plan, tmp_path / "plan.yaml")
    run_dir = tmp_path / "run"
    result = launch(
        path, "--steps", str(steps), "--run-dir", str(run_dir), "--trace", "--no-progress",
        "--timeout", "60",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]

    tables = build_tables(spec_from_plan(load_plan(path), 0, steps))
    traces = load_traces(run_dir)
    assert [t.rank for t in traces] == sorted(tables)
    for trace in traces:
        expected = [str(action) for action in tables[trace.rank]]
        recorded = [event.action for event in trace.events]
        assert recorded == expected, f"rank {trace.rank}"
        assert max(Counter(recorded).values()) == 1  # exactly once
        starts = [event.start for event in trace.events]
        assert starts == sorted(starts)
        assert all(event.end >= event.start for event in trace.events)
        # what the executor did right before each action lies between it and the one before
        for previous, event in zip(trace.events, trace.events[1:]):
            assert event.posting is not None and event.reclaiming is not None
            spent = event.posting + event.reclaiming
            assert 0 <= spent <= event.start - previous.end + 1e-6, (previous, event)
        if any(event.op.value in ("RF", "RB") for event in trace.events):  # posted ahead
            assert sum(event.posting or 0.0 for event in trace.events) > 0
    assert any(event.op.value == "A" for t in traces for event in t.events) == (max(replicas) > 1)
    # every message is paired with its receive (replicas included: the tables give the peers),
    # and none arrives before its send was posted (one clock on one node)
    sends = [a for table in tables.values() for a in table if a.op.value in ("SF", "SB")]
    messages = message_times(traces, load_plan(path))
    assert len(messages) == len(sends)
    assert all(m.sent_ms <= m.received_ms for m in messages)

    png = tmp_path / "timeline.png"
    merged = run_cli("trace", str(run_dir), "-o", str(tmp_path / "merged.json"), "--png", str(png))
    if not matplotlib_available():
        assert merged.returncode == 2 and "matplotlib" in merged.stderr
        merged = run_cli("trace", str(run_dir), "-o", str(tmp_path / "merged.json"))
    assert merged.returncode == 0, merged.stderr
    chrome = json.loads((tmp_path / "merged.json").read_text())
    events = chrome["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(len(table) for table in tables.values())
    assert {e["cat"] for e in complete} <= set(CATEGORIES.values())
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {t.rank: f"rank {t.rank} (stage {t.stage})" for t in traces}
    for trace in traces:
        mine = [e["name"] for e in complete if e["pid"] == trace.rank]
        assert mine == [event.action for event in trace.events]
    if matplotlib_available():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
