"""Reading a run's action timelines and merging them into one Chrome trace (``pipedream trace``).

With ``--trace`` every rank of ``pipedream train`` writes ``RUN_DIR/traces/rank-NNN.json``
(``pipedream/trace@1``: the start and end of each action of its table, in Unix seconds, see
``tracing.py``). This module validates those files and merges them into one Chrome trace JSON
that Perfetto (https://ui.perfetto.dev) and ``chrome://tracing`` open: one process per rank,
named ``rank R (stage S)``, one complete event (``"ph": "X"``, microseconds) per action, in the
categories of :data:`CATEGORIES`. Idle time is what lies between events. ``trace_plot.py`` draws
the same data as a PNG Gantt chart.

Pure Python: no torch import, so ``pipedream trace`` starts fast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedream.errors import FormatError, TraceError
from pipedream.runtime.tracing import TRACE_FORMAT
from pipedream.schedules import Op, parse_action

__all__ = [
    "CATEGORIES",
    "RankTrace",
    "TraceEvent",
    "chrome_trace",
    "load_traces",
    "run_command",
    "write_chrome_trace",
]

CATEGORIES: dict[Op, str] = {
    Op.FORWARD: "forward",
    Op.BACKWARD: "backward",
    Op.UPDATE: "update",
    Op.ALLREDUCE: "allreduce",
    Op.SEND_ACT: "send",
    Op.SEND_GRAD: "send",
    Op.RECV_ACT: "receive-wait",
    Op.RECV_GRAD: "receive-wait",
    Op.SEND_TIED_GRAD: "send",
    Op.SEND_WEIGHTS: "send",
    Op.RECV_TIED_GRAD: "receive-wait",
    Op.RECV_WEIGHTS: "receive-wait",
}
"""Chrome trace category of each kind of action (a receive's time is the wait for its data)."""

_FILE_NAME = re.compile(r"^rank-(\d+)\.json$")


@dataclass(frozen=True)
class TraceEvent:
    """One action of one rank, as it ran."""

    action: str
    """Compact form of the action (``"1F3"``, see ``actions.py``)."""
    op: Op
    """What the action did."""
    stage: int
    """Stage the action belongs to."""
    index: int
    """Microbatch (F, B, sends, receives) or minibatch (U, A) index."""
    start: float
    """Start, Unix seconds (one clock for all ranks of a node)."""
    end: float
    """End, Unix seconds."""
    posting: float | None = None
    """Seconds the executor spent posting receives ahead right before the action (None: a
    trace written before it was recorded)."""
    reclaiming: float | None = None
    """Seconds it spent right before the action waiting for earlier sends to complete (None:
    not recorded)."""

    @property
    def category(self) -> str:
        return CATEGORIES[self.op]


@dataclass(frozen=True)
class RankTrace:
    """The timeline of one rank."""

    rank: int
    """Global rank."""
    stage: int
    """Stage this rank runs."""
    world_size: int
    """Number of ranks of the run."""
    events: tuple[TraceEvent, ...]
    """Every action of the rank's table, in execution order."""
    path: str
    """File it was read from (for messages)."""


def _field(source: str, payload: dict[str, Any], key: str, kind: type) -> Any:
    value = payload.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FormatError(
            source,
            key,
            f"expected {kind.__name__}, got {type(value).__name__} ({value!r:.40})",
            "the file is damaged; re-run the training with --trace",
        )
    return value


def _read_rank(path: Path) -> RankTrace:
    source = str(path)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(
            source, "", f"is not readable JSON ({exc})", "re-run the training with --trace"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != TRACE_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise FormatError(
            source,
            "format",
            f"expected {TRACE_FORMAT!r}, got {found!r}",
            "pass the run directory of `pipedream train --trace`",
        )
    rank = _field(source, payload, "rank", int)
    stage = _field(source, payload, "stage", int)
    world_size = _field(source, payload, "world_size", int)
    raw = _field(source, payload, "events", list)
    events = []
    for number, item in enumerate(raw):
        where = f"events[{number}]"
        try:
            action = parse_action(item["action"])
            start, end = float(item["start"]), float(item["end"])
            posting, reclaiming = (
                None if item.get(key) is None else float(item[key])
                for key in ("posting", "reclaiming")
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise FormatError(
                source,
                where,
                f"is not an action with start and end ({exc})",
                "the file is damaged; re-run the training with --trace",
            ) from None
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise FormatError(source, where, f"ends before it starts ({start} > {end})")
        spent = [s for s in (posting, reclaiming) if s is not None]
        if not all(math.isfinite(s) and s >= 0 for s in spent):
            raise FormatError(
                source,
                where,
                f"spent a negative or non-finite time before it (posting {posting}, "
                f"reclaiming {reclaiming})",
                "the file is damaged; re-run the training with --trace",
            )
        events.append(
            TraceEvent(
                str(action),
                action.op,
                action.stage,
                action.index,
                start,
                end,
                posting,
                reclaiming,
            )
        )
    return RankTrace(rank, stage, world_size, tuple(events), source)


def load_traces(run_dir: str | os.PathLike[str]) -> list[RankTrace]:
    """Read and validate every rank's trace of a run, sorted by rank.

    Raises :class:`TraceError` when the directory or its traces are missing and
    :class:`FormatError` naming the file and field when a trace file is malformed.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise TraceError(f"{root}: no such run directory; pass the --run-dir of a training run")
    directory = root / "traces"
    files = sorted(p for p in directory.glob("rank-*.json") if _FILE_NAME.match(p.name))
    if not files:
        raise TraceError(
            f"{root}: no traces/rank-NNN.json files; run the training with --trace "
            "(`./launch.sh PLAN --trace --run-dir DIR`)"
        )
    traces = [_read_rank(path) for path in files]
    for trace, path in zip(traces, files):
        if int(_FILE_NAME.match(path.name).group(1)) != trace.rank:  # type: ignore[union-attr]
            raise FormatError(str(path), "rank", f"is {trace.rank}, the file name says otherwise")
    world_size = traces[0].world_size
    found = sorted(t.rank for t in traces)
    missing = sorted(set(range(world_size)) - set(found))
    if missing or any(t.world_size != world_size for t in traces):
        raise TraceError(
            f"{directory}: the run had {world_size} ranks but traces of ranks {found} were found "
            f"(missing {missing}); did a rank fail before writing its trace? re-run with --trace"
        )
    return traces


def chrome_trace(traces: Sequence[RankTrace]) -> dict[str, Any]:
    """The merged Chrome trace: one process per rank, one complete event per action (its
    arguments say what the executor spent right before it posting receives and waiting for
    sends, where the trace recorded it).

    Times are microseconds since the earliest action of the run.
    """
    origin = min((e.start for t in traces for e in t.events), default=0.0)
    events: list[dict[str, Any]] = []
    for trace in traces:
        name = f"rank {trace.rank} (stage {trace.stage})"
        events.append(
            {"name": "process_name", "ph": "M", "pid": trace.rank, "args": {"name": name}}
        )
        events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": trace.rank,
                "args": {"sort_index": trace.rank},
            }
        )
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": trace.rank,
                "tid": 0,
                "args": {"name": "actions"},
            }
        )
        for event in trace.events:
            unit = "minibatch" if event.op in (Op.UPDATE, Op.ALLREDUCE) else "microbatch"
            args: dict[str, Any] = {"stage": event.stage, unit: event.index}
            if event.posting is not None and event.reclaiming is not None:  # right before it
                args["posting receives ms"] = round(event.posting * 1e3, 4)
                args["waiting for sends ms"] = round(event.reclaiming * 1e3, 4)
            events.append(
                {
                    "name": event.action,
                    "cat": event.category,
                    "ph": "X",
                    "ts": round((event.start - origin) * 1e6, 3),
                    "dur": round((event.end - event.start) * 1e6, 3),
                    "pid": trace.rank,
                    "tid": 0,
                    "args": args,
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"format": TRACE_FORMAT, "world_size": len(traces), "origin_unix_s": origin},
    }


def write_chrome_trace(traces: Sequence[RankTrace], path: str | os.PathLike[str]) -> Path:
    """Write :func:`chrome_trace` to ``path`` atomically (temp file + rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text(json.dumps(chrome_trace(traces)), encoding="utf-8")
    temporary.replace(target)
    return target


def run_command(args: argparse.Namespace) -> int:
    """``pipedream trace RUN_DIR [-o FILE] [--png FILE]``."""
    from pipedream.runtime import trace_plot

    traces = load_traces(args.run_dir)
    output = write_chrome_trace(traces, args.output or Path(args.run_dir) / "trace.json")
    count = sum(len(t.events) for t in traces)
    print(
        f"wrote {output}: {len(traces)} ranks, {count} actions "
        "(open it in https://ui.perfetto.dev or chrome://tracing)"
    )
    if args.png is not None or trace_plot.matplotlib_available():
        png = trace_plot.plot_timeline(traces, args.png or Path(args.run_dir) / "timeline.png")
        print(f"wrote {png}: Gantt chart of the ranks over time")
    else:
        print(
            "note: matplotlib is not installed, so no timeline.png was drawn "
            "(pip install matplotlib, or pip install -e '.[plot]')",
            file=sys.stderr,
        )
    return 0
