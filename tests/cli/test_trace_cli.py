"""``pipedream trace``: a Chrome trace (and a PNG) from a run's traces; bad input exits 2 with
one line. Uses hand-written trace files, so no training run is needed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pipedream.runtime.trace_plot import matplotlib_available

from launching import run_cli

START = 1_700_000_000.0


def _events(stage: int, *names: str) -> list[dict[str, Any]]:
    out, clock = [], START + stage * 0.01
    for name in names:
        out.append({"action": name, "start": clock, "end": clock + 0.005})
        clock += 0.006
    return out


def _write_run(run_dir: Path, ranks: dict[int, list[dict[str, Any]]], world_size: int = 2) -> None:
    (run_dir / "traces").mkdir(parents=True)
    for rank, events in ranks.items():
        payload = {
            "format": "pipedream/trace@1",
            "rank": rank,
            "stage": rank,
            "world_size": world_size,
            "clock": "unix seconds",
            "events": events,
        }
        (run_dir / "traces" / f"rank-{rank:03d}.json").write_text(json.dumps(payload))


def _good_run(run_dir: Path) -> None:
    _write_run(
        run_dir,
        {
            0: _events(0, "0F0", "0SF0", "0RB0", "0B0", "0U0"),
            1: _events(1, "1RF0", "1F0", "1B0", "1SB0", "1U0"),
        },
    )


def _one_line(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pipedream trace: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_writes_chrome_trace_and_png(tmp_path: Path) -> None:
    _good_run(tmp_path / "run")
    result = run_cli("trace", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    chrome = json.loads((tmp_path / "run" / "trace.json").read_text())
    complete = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 10
    first = next(e for e in complete if e["name"] == "1F0")
    assert first["cat"] == "forward" and first["pid"] == 1 and first["tid"] == 0
    assert first["args"] == {"stage": 1, "microbatch": 0}
    assert first["ts"] == pytest.approx((0.01 + 0.006) * 1e6, abs=1)
    assert first["dur"] == pytest.approx(5000, abs=1)
    wait = next(e for e in complete if e["name"] == "0RB0")
    assert wait["cat"] == "receive-wait"
    update = next(e for e in complete if e["name"] == "0U0")
    assert update["cat"] == "update" and update["args"] == {"stage": 0, "minibatch": 0}
    meta = [e for e in chrome["traceEvents"] if e["name"] == "process_name"]
    assert {e["pid"]: e["args"]["name"] for e in meta} == {
        0: "rank 0 (stage 0)",
        1: "rank 1 (stage 1)",
    }
    png = tmp_path / "run" / "timeline.png"
    if matplotlib_available():
        assert png.read_bytes()[:4] == b"\x89PNG"
    else:
        assert not png.exists() and "matplotlib" in result.stderr


def test_output_paths(tmp_path: Path) -> None:
    _good_run(tmp_path / "run")
    out = tmp_path / "elsewhere" / "t.json"
    result = run_cli(
        "trace", str(tmp_path / "run"), "-o", str(out), "--png", str(tmp_path / "g.png")
    )
    if not matplotlib_available():
        _one_line(result, "matplotlib")
        return
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["traceEvents"]
    assert (tmp_path / "g.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("setup", "needles"),
    [
        ("missing-dir", ("no such run directory",)),
        ("no-traces", ("no traces/rank-NNN.json", "--trace")),
        ("bad-json", ("rank-001.json", "not readable JSON")),
        ("wrong-format", ("rank-000.json", "format", "pipedream/trace@1")),
        ("bad-action", ("rank-001.json", "events[1]")),
        ("backwards-time", ("rank-000.json", "events[0]", "ends before it starts")),
        ("negative-posting", ("rank-000.json", "events[0]", "posting -0.001")),
        ("missing-rank", ("missing [1]",)),
        ("bad-rank-type", ("rank-000.json", "rank", "expected int")),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, setup: str, needles: tuple[str]) -> None:
    run_dir = tmp_path / "run"
    if setup != "missing-dir":
        _good_run(run_dir)
    traces = run_dir / "traces"
    if setup == "no-traces":
        for path in traces.iterdir():
            path.unlink()
    elif setup == "bad-json":
        (traces / "rank-001.json").write_text("{not json")
    elif setup in ("wrong-format", "bad-rank-type", "backwards-time", "negative-posting"):
        data = json.loads((traces / "rank-000.json").read_text())
        if setup == "wrong-format":
            data["format"] = "something/else@1"
        elif setup == "bad-rank-type":
            data["rank"] = "zero"
        elif setup == "negative-posting":
            data["events"][0]["posting"] = -0.001
        else:
            data["events"][0]["end"] = data["events"][0]["start"] - 1
        (traces / "rank-000.json").write_text(json.dumps(data))
    elif setup == "bad-action":
        data = json.loads((traces / "rank-001.json").read_text())
        data["events"][1]["action"] = "1X0"
        (traces / "rank-001.json").write_text(json.dumps(data))
    elif setup == "missing-rank":
        (traces / "rank-001.json").unlink()
    _one_line(run_cli("trace", str(run_dir)), *needles)
