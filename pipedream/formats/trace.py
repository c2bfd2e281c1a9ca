"""The trace file (``format: pipedream/trace@1``): one rank's action timeline (``--trace``).

With ``--trace`` every rank of ``pipedream train`` writes ``RUN_DIR/traces/rank-NNN.json``:
its rank, stage and the world size, and one event per action of its table, in table order:
``action`` (the compact form, ``"1F3"``), ``start`` and ``end`` in Unix seconds (one clock for
all ranks of a node), and what the executor did right before it, between the previous action
and this one: ``posting`` (seconds spent posting receives ahead,
:mod:`~pipedream.schedules.posting`) and ``reclaiming`` (seconds spent waiting for earlier
sends to complete). Traces written before those two were recorded lack them. The wiring the
tables were built for goes beside them: ``edges``, the stage pairs that exchange tensors (null
for a chain; skip connections add pairs), ``tied``, the (owner, copy) stage pairs of tied
parameters, and ``stretches``, the minibatches of each stretch between checkpoints (one table
each), so that a reader rebuilds the very tables the run executed. ``plan`` names what the run
trained (workload, schedule, microbatches, stages), so that a reader can refuse another plan's
run; ``complete`` is false where the rank stopped before the end of its tables (a failure, an
interrupt): its events are then the actions that ran. ``run`` says how the run trained
beyond its plan (``precision``, ``recompute``), which ``pipedream simulate --trace`` sets beside
the simulation's. Traces written before these keys lack them.

:func:`write_trace` writes a rank's file, :func:`load_traces` reads and validates a run's
(``pipedream trace`` merges them into a Chrome trace; ``pipedream simulate --trace`` sets them
beside a simulation). Pure Python: no torch.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedream.errors import FormatError, TraceError
from pipedream.formats.plan import Plan
from pipedream.precision import PRECISIONS
from pipedream.schedules import Op, parse_action

__all__ = [
    "CATEGORIES",
    "TRACE_FORMAT",
    "RankTrace",
    "RunSettings",
    "TraceEvent",
    "TracedAction",
    "load_traces",
    "plan_identity",
    "remove_traces",
    "write_trace",
]

CATEGORIES: dict[Op, str] = {
    Op.FORWARD: "forward",
    Op.BACKWARD: "backward",
    Op.BACKWARD_INPUT: "backward-input",
    Op.BACKWARD_WEIGHT: "backward-weight",
    Op.UPDATE: "update",
    Op.ALLREDUCE: "allreduce",
    Op.CLIP: "allreduce",
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

TRACE_FORMAT = "pipedream/trace@1"

TracedAction = tuple[str, float, float, float, float]
"""What the executor records per action: its compact form, start and end
(``time.perf_counter()``), and the seconds it spent right before it posting receives ahead and
reclaiming sends."""


def plan_identity(plan: Plan) -> dict[str, Any]:
    """What a trace records of the plan its run trained (JSON values): enough to tell another
    plan's run, whose times say nothing about this plan."""
    return {
        "workload": plan.workload,
        "workload_args": dict(sorted(plan.workload_args.items())),
        "schedule": plan.schedule,
        "microbatch_size": plan.microbatch_size,
        "microbatches": plan.microbatches,
        "stages": [[s.first_layer, s.last_layer, s.replicas] for s in plan.stages],
    }


@dataclass(frozen=True)
class RunSettings:
    """How a run trained beyond what its plan says: ``train --precision`` and ``--recompute``
    (or the plan's own), which a simulation of the plan must share to predict the run."""

    precision: str
    """What the forwards ran in (:mod:`pipedream.precision`)."""
    recompute: bool
    """Whether backwards recomputed their stage's forward."""

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "recompute": self.recompute}

    @classmethod
    def from_payload(cls, source: str, raw: Any) -> RunSettings:
        if (
            not isinstance(raw, dict)
            or raw.get("precision") not in PRECISIONS
            or not isinstance(raw.get("recompute"), bool)
        ):
            raise FormatError(
                source,
                "run",
                f"expected precision ({' or '.join(PRECISIONS)}) and recompute (true or "
                f"false), got {raw!r:.60}",
                "the file is damaged; re-run the training with --trace",
            )
        return cls(raw["precision"], raw["recompute"])


def write_trace(
    run_dir: Path,
    trace: list[TracedAction],
    *,
    rank: int,
    stage: int,
    world_size: int,
    edges: tuple[tuple[int, int], ...] | None = None,
    tied: tuple[tuple[int, int], ...] = (),
    stretches: Sequence[tuple[int, int]] | None = None,
    plan: Plan | None = None,
    complete: bool = True,
    run: RunSettings | None = None,
) -> Path:
    """Every action's start and end, on a clock shared by all ranks.

    The executor records ``time.perf_counter()`` (cheap, monotonic); it is converted to Unix
    seconds with one offset per rank so that the ranks' timelines line up when merged.
    ``stretches``: the (first minibatch, minibatches) of each table the events ran, in order;
    ``complete``: whether the rank ran its tables to the end; ``run``: how it trained.
    """
    offset = time.time() - time.perf_counter()
    payload = {
        "format": TRACE_FORMAT,
        "rank": rank,
        "stage": stage,
        "world_size": world_size,
        "edges": None if edges is None else [list(pair) for pair in edges],
        "tied": [list(pair) for pair in tied],
        "stretches": None if stretches is None else [list(pair) for pair in stretches],
        "plan": None if plan is None else plan_identity(plan),
        "complete": complete,
        "run": None if run is None else run.to_dict(),
        "clock": "unix seconds",
        "events": [
            {
                "action": name,
                "start": start + offset,
                "end": end + offset,
                "posting": posting,
                "reclaiming": reclaiming,
            }
            for name, start, end, posting, reclaiming in trace
        ],
    }
    directory = run_dir / "traces"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{rank:03d}.json"
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(payload))
    temporary.replace(path)  # a rank killed while writing leaves no half a file
    return path


def remove_traces(run_dir: Path, *, rank: int | None = None) -> int:
    """Delete the traces an earlier run left in ``run_dir`` (``rank``: only that rank's file;
    None: every rank's); returns how many were deleted. A run starts with this, so that
    ``traces/`` never mixes its timelines with an earlier run's."""
    directory = run_dir / "traces"
    if rank is not None:
        files = [directory / f"rank-{rank:03d}.json"]
    else:
        files = [p for p in directory.glob("rank-*.json") if _FILE_NAME.match(p.name)]
    removed = 0
    for path in files:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed += 1
    return removed


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
    edges: tuple[tuple[int, int], ...] | None = None
    """(producer, consumer) stage pairs that exchanged tensors; None: a chain."""
    tied: tuple[tuple[int, int], ...] = ()
    """(owner, copy) stage pairs of tied parameters."""
    stretches: tuple[tuple[int, int], ...] | None = None
    """(first minibatch, minibatches) of each table the events ran, in order; None: a trace
    written before they were recorded (one table, from minibatch 0)."""
    plan: dict[str, Any] | None = None
    """:func:`plan_identity` of the plan the run trained (None: not recorded)."""
    complete: bool = True
    """False where the rank stopped before the end of its tables (failed, interrupted)."""
    run: RunSettings | None = None
    """How the run trained beyond its plan (None: not recorded)."""


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


def _pairs(source: str, payload: dict[str, Any], key: str) -> tuple[tuple[int, int], ...] | None:
    """A list of stage pairs (None where the trace has none: a chain, or an older trace)."""
    raw = payload.get(key)
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(
        isinstance(pair, list)
        and len(pair) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)
        for pair in raw
    ):
        raise FormatError(
            source,
            key,
            f"expected a list of [stage, stage] pairs, got {raw!r:.60}",
            "the file is damaged; re-run the training with --trace",
        )
    return tuple((a, b) for a, b in raw)


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
    edges = _pairs(source, payload, "edges")
    tied = _pairs(source, payload, "tied") or ()
    stretches = _pairs(source, payload, "stretches")
    if stretches is not None:
        _check_stretches(source, stretches)
    plan = payload.get("plan")
    if plan is not None and not isinstance(plan, dict):
        raise FormatError(
            source,
            "plan",
            f"expected a mapping, got {type(plan).__name__}",
            "the file is damaged; re-run the training with --trace",
        )
    complete = payload.get("complete", True)
    if not isinstance(complete, bool):
        raise FormatError(
            source,
            "complete",
            f"expected true or false, got {complete!r:.40}",
            "the file is damaged; re-run the training with --trace",
        )
    raw_run = payload.get("run")
    run = None if raw_run is None else RunSettings.from_payload(source, raw_run)
    return RankTrace(
        rank, stage, world_size, tuple(events), source, edges, tied, stretches, plan, complete, run
    )


def _check_stretches(source: str, stretches: tuple[tuple[int, int], ...]) -> None:
    """Stretches are not empty and follow each other (each starts where the one before
    ended)."""
    for number, (first, count) in enumerate(stretches):
        if count < 1:
            problem = f"[{first}, {count}] holds no minibatch"
        elif number and first != sum(stretches[number - 1]):
            problem = f"[{first}, {count}] does not start where {list(stretches[number - 1])} ends"
        else:
            continue
        raise FormatError(
            source,
            f"stretches[{number}]",
            problem,
            "the file is damaged; re-run the training with --trace",
        )


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
