"""Where a run's time goes: its critical path, every millisecond of it put in one category.

A run's time per minibatch is longer than its ideal (the schedule's length in pure compute)
by the runtime's own costs and the messages' travel. Which of them count is what the
minibatch waited for: a slow action that another rank waits for costs time, one that overlaps
another rank's compute costs nothing. :func:`account` follows the wait chain backwards through
the ``--trace`` timelines of all ranks, from the end of a minibatch's last update on the last
stage to the end of the previous one:

- inside an action, the path stays on its rank: the action's time goes to its category
  (compute, with the part beyond its ideal length split off where that is known, an update,
  an allreduce, posting a send, taking a message);
- between two actions of a rank, the gap is the executor's own work: posting receives ahead,
  reclaiming finished sends (both recorded by the trace) and the rest (bookkeeping, Python);
- a receive whose message was sent only after the receiver reached it waited for the sender:
  the time from the end of the send's post to the end of the receive is the message's
  *delivery* (transfer, the receiving thread waking up, decoding the header), and the path
  jumps to the sender, at the end of that post.

The segments tile the interval between the two completions exactly, so the categories add up
to the measured time per minibatch. Every rank's clock must be the same (one node).

Pure Python: no torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipedream.errors import TraceError
from pipedream.formats.plan import Plan
from pipedream.formats.trace import RankTrace, TraceEvent
from pipedream.optimizer.measured import check_matches, steady_window, tables_of_run
from pipedream.schedules import Op
from pipedream.schedules.validate import Message, message_of

__all__ = [
    "COMPUTE_OPS",
    "Accounting",
    "PathAction",
    "Segment",
    "account",
    "format_accounting",
    "walk",
]

COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)

CATEGORIES = (
    "compute",
    "compute overrun",
    "update",
    "allreduce",
    "send",
    "receive",
    "delivery",
    "posting receives",
    "reclaiming sends",
    "between actions",
)
"""The categories of the critical path, in report order:

- ``compute``: forwards and backwards (up to their ideal length, where one is given);
- ``compute overrun``: their time beyond the ideal length;
- ``update``, ``allreduce``: optimizer steps; waiting for the replicas' gradient average;
- ``send``: posting a send;
- ``receive``: a receive whose message was sent before the receiver reached it (taking it, or
  waiting for the rest of its travel);
- ``delivery``: a message the receiver waited for, from the end of its send's post to the end
  of the receive;
- ``posting receives``, ``reclaiming sends``, ``between actions``: the executor's work between
  two actions (the first two as the trace recorded them, the rest the remainder).
"""


@dataclass(frozen=True)
class Segment:
    """A stretch of the critical path, in milliseconds on the shared clock."""

    rank: int
    start_ms: float
    end_ms: float
    category: str
    action: str
    """The action it belongs to (for a gap: the action after it)."""

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class PathAction:
    """One kind of compute action on the critical path, per minibatch."""

    op: Op
    count: float
    """How many of them lie on the path per minibatch (a mean over the window)."""
    mean_ms: float
    """Their mean time (the whole action, also where it starts before the window)."""
    ideal_ms: float | None
    """Their mean ideal time (None: not known)."""


@dataclass(frozen=True)
class Accounting:
    """A run's critical path over its measured window, per minibatch."""

    time_per_minibatch_ms: float
    minibatches: int
    """Minibatch intervals averaged."""
    categories: dict[str, float]
    """Milliseconds per minibatch in each category (they add up to the time per minibatch)."""
    actions: tuple[PathAction, ...]
    """The compute actions on the path, by kind."""
    hops: float
    """Messages the path waited for (jumps between ranks), per minibatch."""
    hop_ms: float | None
    """Their mean delivery."""
    ideal_ms: float | None
    """The path's compute at its ideal length, per minibatch (None: no ideal given)."""


def _is_wait_for(event: TraceEvent, send: TraceEvent) -> bool:
    """Whether a receive waited for its sender: the send was posted after the receive began."""
    return send.start >= event.start


def walk(
    traces: Sequence[RankTrace],
    sends: Mapping[Message, tuple[int, int]],
    receives: Mapping[tuple[int, int], Message],
    *,
    rank: int,
    position: int,
    until: float,
    ideal_ms: Mapping[tuple[int, Op], float] | None = None,
) -> list[Segment]:
    """The critical path backwards from the end of event ``position`` of ``rank`` to the time
    ``until`` (seconds), as segments in backward order.

    ``sends`` maps a message to its send's (rank, position); ``receives`` maps a receive's
    (rank, position) to its message. ``ideal_ms``: a compute action's ideal length by stage
    and op (absent: the whole action is ``compute``).
    """
    events = {trace.rank: trace.events for trace in traces}
    out: list[Segment] = []
    t = events[rank][position].end
    steps = 2 * sum(len(e) for e in events.values())  # far more than one clock ever needs
    while t > until:
        steps -= 1
        if steps < 0:
            raise TraceError(
                "the ranks' traces disagree on the order of a send and its receive; the "
                "critical path needs all ranks on one clock (one node)"
            )
        event = events[rank][position]
        name = event.action
        source = receives.get((rank, position))
        if source is not None and source in sends:
            peer, at = sends[source]
            send = events[peer][at]
            if peer != rank and _is_wait_for(event, send):
                arrived = max(min(send.end, t), until)
                out.append(Segment(rank, arrived * 1000, t * 1000, "delivery", name))
                rank, position, t = peer, at, arrived
                continue
        begin = min(max(event.start, until), t)  # clocks a little apart: never forwards
        if begin < t:
            out += _action_segments(rank, event, begin, t, ideal_ms)
        t = begin
        if t <= until or position == 0:
            break
        previous = events[rank][position - 1]
        gap_start = min(max(previous.end, until), t)
        if gap_start < t:
            out += _gap_segments(rank, event, gap_start, t)
        position, t = position - 1, gap_start
    return out


def _action_segments(
    rank: int,
    event: TraceEvent,
    begin: float,
    end: float,
    ideal_ms: Mapping[tuple[int, Op], float] | None,
) -> list[Segment]:
    """The stretch ``[begin, end]`` (seconds) of ``event``, with a compute action's overrun
    (the action's time beyond its ideal, counted at the action's end) split off."""
    name = event.action
    if event.op not in COMPUTE_OPS:
        category = {
            Op.UPDATE: "update",
            Op.ALLREDUCE: "allreduce",
            Op.CLIP: "allreduce",
        }.get(event.op, "send" if event.op.is_comm and not event.op.is_receive else "receive")
        return [Segment(rank, begin * 1000, end * 1000, category, name)]
    ideal = None if ideal_ms is None else ideal_ms.get((event.stage, event.op))
    if ideal is None:
        return [Segment(rank, begin * 1000, end * 1000, "compute", name)]
    ideal_end = min(end, max(begin, event.start + ideal / 1000))
    out = []
    if ideal_end < end:
        out.append(Segment(rank, ideal_end * 1000, end * 1000, "compute overrun", name))
    if begin < ideal_end:
        out.append(Segment(rank, begin * 1000, ideal_end * 1000, "compute", name))
    return out


def _gap_segments(rank: int, event: TraceEvent, begin: float, end: float) -> list[Segment]:
    """The gap ``[begin, end]`` before ``event``: the posting and reclaiming the trace recorded
    (in that order, right before the action), the rest ``between actions``."""
    name = event.action
    out = []
    t = end
    for category, seconds in (
        ("reclaiming sends", event.reclaiming or 0.0),
        ("posting receives", event.posting or 0.0),
    ):
        start = max(begin, t - seconds)
        if start < t:
            out.append(Segment(rank, start * 1000, t * 1000, category, name))
        t = start
    if begin < t:
        out.append(Segment(rank, begin * 1000, t * 1000, "between actions", name))
    return out


def account(
    traces: Sequence[RankTrace],
    plan: Plan,
    *,
    skip: int | None = None,
    ideal_ms: Mapping[tuple[int, Op], float] | None = None,
) -> Accounting:
    """The critical path of ``plan``'s run, averaged over the minibatches after the first
    ``skip`` (default: :func:`~pipedream.optimizer.measured.default_skip`)."""
    if plan.stages[-1].replicas != 1:
        raise TraceError(
            "the critical path is followed from the last stage's updates, one per minibatch; "
            "a replicated last stage updates once per round of its replicas: account a run "
            "whose last stage has one replica"
        )
    check_matches(traces, plan)
    window = steady_window(traces, plan, skip=skip)
    tables = tables_of_run(traces, plan)
    if tables is None:
        raise TraceError(
            "the traces do not follow the plan's action tables (a run of another plan, or one "
            "that stopped early); pass the plan the run trained"
        )
    sends: dict[Message, tuple[int, int]] = {}
    receives: dict[tuple[int, int], Message] = {}
    for trace in traces:
        for position, action in enumerate(tables[trace.rank]):
            if action.op.is_comm and action.peer is not None:
                key = message_of(trace.rank, action)
                if action.op.is_receive:
                    receives[(trace.rank, position)] = key
                else:
                    sends[key] = (trace.rank, position)
    last = {
        event.index: (trace.rank, position)
        for trace in traces
        for position, event in enumerate(trace.events)
        if event.op is Op.UPDATE and event.stage == plan.num_stages - 1
    }
    segments: list[Segment] = []
    for minibatch in window.measured:  # none whose interval spans a checkpoint
        rank, position = last[minibatch]
        segments += walk(
            traces,
            sends,
            receives,
            rank=rank,
            position=position,
            until=window.end(minibatch - 1),
            ideal_ms=ideal_ms,
        )
    count = len(window.measured)
    return _summarise(traces, segments, count, window.seconds * 1000, ideal_ms)


def _summarise(
    traces: Sequence[RankTrace],
    segments: list[Segment],
    count: int,
    window_ms: float,
    ideal_ms: Mapping[tuple[int, Op], float] | None,
) -> Accounting:
    categories = {name: 0.0 for name in CATEGORIES}
    for segment in segments:
        categories[segment.category] += segment.ms / count
    events = {(trace.rank, event.action): event for trace in traces for event in trace.events}
    on_path: dict[Op, set[tuple[int, str]]] = {}
    for segment in segments:
        op = events[(segment.rank, segment.action)].op
        if op in COMPUTE_OPS and segment.category.startswith("compute"):
            on_path.setdefault(op, set()).add((segment.rank, segment.action))
    actions = []
    for op in COMPUTE_OPS:
        if op not in on_path:
            continue
        found = [events[key] for key in sorted(on_path[op])]
        ideals = [None if ideal_ms is None else ideal_ms.get((e.stage, op)) for e in found]
        actions.append(
            PathAction(
                op,
                len(found) / count,
                statistics.fmean((e.end - e.start) * 1000 for e in found),
                None if None in ideals else statistics.fmean(i for i in ideals if i is not None),
            )
        )
    hops = [s.ms for s in segments if s.category == "delivery"]
    ideal = None
    if ideal_ms is not None and all(a.ideal_ms is not None for a in actions):
        ideal = categories["compute"]
    return Accounting(
        time_per_minibatch_ms=window_ms / count,
        minibatches=count,
        categories=categories,
        actions=tuple(actions),
        hops=len(hops) / count,
        hop_ms=statistics.fmean(hops) if hops else None,
        ideal_ms=ideal,
    )


_OP_NAMES = {
    Op.FORWARD: "forwards",
    Op.BACKWARD: "backwards",
    Op.BACKWARD_INPUT: "input-gradient backwards (I)",
    Op.BACKWARD_WEIGHT: "weight-gradient backwards (W)",
}


def format_accounting(accounting: Accounting) -> str:
    """The accounting as a table of milliseconds per minibatch, with each category's share."""
    total = accounting.time_per_minibatch_ms
    lines = [
        f"critical path over {accounting.minibatches} minibatches: {total:.1f} ms per minibatch",
        f"{'category':<20} {'ms/minibatch':>12} {'share':>7}",
    ]
    for name, ms in accounting.categories.items():
        if ms > 0 or name == "compute":
            lines.append(f"{name:<20} {ms:>12.2f} {ms / total:>7.1%}")
    added = sum(accounting.categories.values())
    lines.append(f"{'(sum)':<20} {added:>12.2f} {added / total:>7.1%}")
    for action in accounting.actions:
        ideal = "" if action.ideal_ms is None else f" (ideal {action.ideal_ms:.2f} ms)"
        lines.append(
            f"on the path: {action.count:.1f} {_OP_NAMES[action.op]} per minibatch, "
            f"{action.mean_ms:.2f} ms each{ideal}"
        )
    if accounting.hop_ms is not None:
        lines.append(
            f"on the path: {accounting.hops:.1f} messages waited for per minibatch, "
            f"{accounting.hop_ms:.2f} ms delivery each"
        )
    if accounting.ideal_ms is not None:
        over = total - accounting.ideal_ms
        lines.append(
            f"ideal (the path's compute at its ideal length): {accounting.ideal_ms:.1f} ms; "
            f"measured {over:+.1f} ms ({accounting.ideal_ms / total:.3f} efficiency)"
        )
    return "\n".join(lines)
