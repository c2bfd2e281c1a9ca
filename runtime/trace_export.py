"""``pipedream trace``: a run's action timelines merged into one Chrome trace.

The ranks' trace files (:mod:`pipedream.formats.trace`) become one Chrome trace JSON that
Perfetto (https://ui.perfetto.dev) and ``chrome://tracing`` open: one process per rank, named
``rank R (stage S)``, one complete event (``"ph": "X"``, microseconds) per action, in the
categories of :data:`CATEGORIES`. Idle time is what lies between events. ``trace_plot.py`` draws
the same data as a PNG Gantt chart. With ``--plan`` the command also prints the run's
critical-path accounting (:mod:`~pipedream.runtime.trace_account`). Pure Python: no torch
import (except to read a ``sleep`` plan's ideal times), so ``pipedream trace`` starts fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipedream.errors import TraceError
from pipedream.formats.trace import CATEGORIES, TRACE_FORMAT, RankTrace, load_traces
from pipedream.schedules import Op

__all__ = ["CATEGORIES", "chrome_trace", "run_command", "write_chrome_trace"]


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
            unit = "minibatch" if event.op in (Op.UPDATE, Op.ALLREDUCE, Op.CLIP) else "microbatch"
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
    """``pipedream trace RUN_DIR [-o FILE] [--png FILE] [--plan PLAN [--skip N]]``: the
    accounting (which can refuse the run) is computed before anything is written."""
    from pipedream.runtime import trace_plot

    if args.skip is not None and args.plan is None:  # before anything is written
        raise TraceError("--skip applies to the accounting: give the run's plan with --plan")
    if args.skip is not None and args.skip < 0:
        raise TraceError(f"--skip {args.skip}: must be >= 0 minibatches")
    traces = load_traces(args.run_dir)
    accounting = None
    if args.plan is not None:
        from pipedream.formats.plan import load_plan
        from pipedream.optimizer.critical_path import format_accounting
        from pipedream.runtime.trace_account import account_run

        plan = load_plan(args.plan)
        accounting = format_accounting(account_run(traces, plan, source=args.plan, skip=args.skip))
    output = write_chrome_trace(traces, args.output or Path(args.run_dir) / "trace.json")
    count = sum(len(t.events) for t in traces)
    print(
        f"wrote {output}: {len(traces)} ranks, {count} actions "
        "(open it in https://ui.perfetto.dev or chrome://tracing)"
    )
    stopped = [trace.rank for trace in traces if not trace.complete]
    if stopped:
        print(
            f"note: rank(s) {stopped} stopped before the end of the run (it failed or was "
            "interrupted): their timelines end with the last action that ran",
            file=sys.stderr,
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
    if accounting is not None:
        print(accounting)
    return 0
