"""Shared pieces of the benchmark scripts: launching runs, reading their timelines, and keeping
one markdown results file whose sections each script refreshes.

Every script is run from the repository root as ``python benchmarks/NAME.py`` and rewrites only
its own section of ``benchmarks/RESULTS.md`` (between ``<!-- BEGIN name -->`` and
``<!-- END name -->``), headed by the machine, the versions, the date and the exact commands.
"""

from __future__ import annotations

import datetime
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipedream.formats.trace import RankTrace
from pipedream.schedules import Op

__all__ = [
    "REPO",
    "RESULTS",
    "RUNS",
    "WARM_MESSAGES",
    "Command",
    "machine_lines",
    "plan_dict",
    "profile_workload",
    "run_command",
    "steady_period_ms",
    "update_intervals_ms",
    "write_plan",
    "write_section",
]

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
RUNS = REPO / "runs" / "benchmarks"
"""Plans, run directories and traces of the benchmarks (ignored by git)."""
WARM_MESSAGES = 48
"""32 MiB messages a gloo link carries before its times settle, left out of every calibration
and measurement: the first messages on a fresh link take several times as long as later ones
(loopback TCP growing its buffers, memory touched for the first time)."""


@dataclass(frozen=True)
class Command:
    """A finished subprocess: what ran, how it ended and how long it took."""

    argv: tuple[str, ...]
    """The command line, as run from the repository root."""
    returncode: int
    """Exit status (-9 after a timeout)."""
    seconds: float
    """Wall-clock time including process start-up."""
    output: str
    """stdout and stderr together (for error messages)."""

    def shell(self) -> str:
        """The command as one line for the results file, relative to the repository root."""
        parts = [
            str(Path(a).relative_to(REPO)) if a.startswith(str(REPO)) else a for a in self.argv
        ]
        if parts and parts[0] == sys.executable:
            parts[0] = "python"
        return " ".join(parts)


def run_command(
    argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None
) -> Command:
    """Run ``argv`` from the repository root in its own session; kill the group on timeout."""
    merged = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, **(env or {}))
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(argv),
        cwd=REPO,
        env=merged,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[benchmark: killed after {timeout:.0f} s]"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # no orphans, whatever happened
        except ProcessLookupError:
            pass
    return Command(tuple(argv), proc.returncode, time.perf_counter() - start, out)


def plan_dict(
    workload: str,
    workload_args: dict[str, Any],
    stages: Sequence[tuple[str, str]],
    *,
    schedule: str,
    microbatch_size: int,
    microbatches: int,
    placement: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A hand-written plan, layers ``(first, last)`` per stage: one rank per stage, or stage
    ``s`` on rank ``placement[s]`` (schedules that run several stages per rank)."""
    ranks = list(placement) if placement is not None else list(range(len(stages)))
    return {
        "format": "pipedream/plan@1",
        "workload": workload,
        "workload_args": {k: str(v) for k, v in workload_args.items()},
        "schedule": schedule,
        "microbatch_size": microbatch_size,
        "microbatches": microbatches,
        "world_size": len(set(ranks)),
        "stages": [
            {"first_layer": first, "last_layer": last, "replicas": 1, "ranks": [rank]}
            for rank, (first, last) in zip(ranks, stages)
        ],
    }


def write_plan(plan: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def profile_workload(
    workload: str,
    args: dict[str, Any],
    microbatch_size: int,
    out: Path,
    *,
    concurrent: int = 1,
    repeats: int | None = None,
) -> Command:
    """``pipedream profile`` of a workload into ``out``, beside ``concurrent - 1`` co-runners
    (``--concurrent``: the other ranks of this host), with ``repeats`` timed passes (``None``:
    the CLI's default, 3 warm-up passes and medians of 10)."""
    argv = [sys.executable, "-m", "pipedream.cli", "profile", workload]
    argv += ["--microbatch-size", str(microbatch_size)]
    if concurrent != 1:
        argv += ["--concurrent", str(concurrent)]
    if repeats is not None:
        argv += ["--repeats", str(repeats)]
    for name, value in args.items():
        argv += ["--workload-arg", f"{name}={value}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    return run_command([*argv, "-o", str(out)], timeout=300)


def steady_period_ms(traces: Sequence[RankTrace], *, skip: int) -> tuple[float, int]:
    """Mean time between consecutive optimizer updates of the last stage, after ``skip``.

    Returns (milliseconds per update, number of intervals averaged). The updates of the last
    stage are the minibatches leaving the pipeline; the first ``skip`` updates (the fill of an
    asynchronous pipeline, process start-up) are left out.
    """
    intervals = update_intervals_ms(traces, skip=skip)
    return sum(intervals) / len(intervals), len(intervals)


def update_intervals_ms(traces: Sequence[RankTrace], *, skip: int) -> list[float]:
    """The intervals between consecutive optimizer updates of the last stage after ``skip``
    (milliseconds; their mean is :func:`steady_period_ms`)."""
    stage = max(e.stage for t in traces for e in t.events)  # ranks may run several stages
    last = next(t for t in traces if any(e.stage == stage for e in t.events))
    ends = [e.end for e in last.events if e.op is Op.UPDATE and e.stage == stage][skip:]
    if len(ends) < 2:
        raise RuntimeError(f"{last.path}: only {len(ends)} updates after skipping {skip}")
    return [(b - a) * 1000 for a, b in zip(ends, ends[1:])]


def machine_lines() -> list[str]:
    """Machine, versions and date, as markdown bullet lines."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory = float("nan")
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"- machine: {cpu}, {os.cpu_count()} cores, {memory:.0f} GiB, {platform.system()} "
        f"{platform.release()}; load average (1, 5, 15 min) when the results were written: "
        f"{load} (the machine is shared with other work)",
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}, "
        f"pipedream at git {commit or 'unknown'}",
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
    ]


def write_section(name: str, body: str) -> None:
    """Replace (or append) section ``name`` of ``benchmarks/RESULTS.md``."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    text = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmark results\n"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text, encoding="utf-8")
