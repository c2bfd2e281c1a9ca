"""What a run measured, in the simulator's terms: its time per minibatch and its stages' costs.

``pipedream simulate PLAN --trace RUN_DIR`` sets a simulation beside the run it predicts. When
the two disagree, either the profile's costs were not what the run's actions took (the machine
was slower or busier than when it was profiled, or a layer runs differently inside a pipeline)
or the simulator's model of the schedule and the network is off. Simulating the plan again
with the costs the run's own actions took (:func:`measured_work`) separates the two: what is
left between that replay and the measurement belongs to the model.

The measurement follows the benchmarks' definition: the time per minibatch is the mean
interval between the completions of consecutive minibatches, a minibatch completing when the
last stage's optimizer update for it ends, after leaving out the first ``skip`` minibatches
(process start-up and the pipeline's fill). An interval that spans a checkpoint
(``--checkpoint-every``: the pipeline drains, the checkpoint is written, the next stretch
fills it again) is left out too: the window is the stretches' steady parts. A resumed run's
completions start at its checkpoint's step. A last stage with ``r`` replicas updates once per
``r`` minibatches (one each, then an allreduce, on every replica): its updates are counted
instead, and the interval between two is divided by ``r``. A stage's costs are
the means of its forward, backward and update actions, and of the posting of its sends, that
start and end within the same window; means rather than medians, because the time per
minibatch is a sum of them. A backward's mean includes the adding of its gradients into
``.grad`` and an update's mean the copying of a stashed weight version, as the run spent them.
The time between actions (from the end of one to the start of the next, counted before each
action in the window) is the runtime's own, which no action holds; it is reported as a share
of the window, and so are the two parts of it that the trace records and the simulator
models: posting receives ahead and waiting for earlier sends to complete (reclaiming them).
Each link's messages are timed from the post of the send to their arrival where the receiver
waited for them (:mod:`~pipedream.optimizer.messages`), the traces' actions matched to the
plan's tables for their peers.
Pure Python: no torch.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pipedream.errors import ScheduleError, TraceError
from pipedream.formats.plan import Plan
from pipedream.formats.trace import RankTrace, TraceEvent, plan_identity
from pipedream.optimizer.messages import LinkTimes, MessageTime, link_times, message_kind
from pipedream.optimizer.simulator import StageWork
from pipedream.schedules import Action, Op, build_tables, parse_action, spec_from_plan
from pipedream.schedules.validate import Message, message_of

__all__ = [
    "MeasuredRun",
    "MeasuredStage",
    "Window",
    "check_matches",
    "completions",
    "default_skip",
    "measure_run",
    "measured_work",
    "message_times",
    "steady_window",
    "tables_of_run",
]

_SENDS = (Op.SEND_ACT, Op.SEND_GRAD, Op.SEND_TIED_GRAD, Op.SEND_WEIGHTS)


@dataclass(frozen=True)
class MeasuredStage:
    """Mean milliseconds of one stage's actions in the measured window (None: none ran)."""

    forward_ms: float | None
    backward_ms: float | None
    update_ms: float | None
    send_ms: float | None
    """Posting a send (activation or gradient): what holds the sending rank."""
    between: float | None = None
    """Share of the window the stage's ranks spent between actions, in none (the executor's
    own work: posting receives ahead, reclaiming finished sends, bookkeeping)."""
    posting: float | None = None
    """Of ``between``, the share spent posting receives ahead (None: the trace did not record
    it)."""
    reclaiming: float | None = None
    """Of ``between``, the share spent waiting for earlier sends to complete (None: not
    recorded)."""
    input_share: float | None = None
    """Where backwards are split: the input-gradient half's share of ``backward_ms`` (which
    is then the mean I plus the mean W)."""


@dataclass(frozen=True)
class MeasuredRun:
    """A run's steady-state time per minibatch and its stages' mean action times."""

    time_per_minibatch_ms: float
    first_minibatch: int
    """The completion that opens the window (minibatches before it were left out); with a
    replicated last stage, the update."""
    last_minibatch: int
    """The completion that closes it."""
    stages: tuple[MeasuredStage, ...]
    minibatches_per_update: int = 1
    """The last stage's replicas: the minibatches one of its updates completes."""
    links: tuple[LinkTimes, ...] = ()
    """Each link's messages in the window whose receiver waited (empty when the traces could
    not be matched to the plan's tables)."""
    run_start: int = 0
    """The run's first completion: 0, or where a resumed run began."""
    across_checkpoints: int = 0
    """Intervals between the first and the last completion that span a checkpoint (left
    out)."""

    @property
    def intervals(self) -> int:
        """Minibatch intervals the time per minibatch averages."""
        return self.last_minibatch - self.first_minibatch - self.across_checkpoints

    @property
    def left_out(self) -> int:
        """Completions before the window's first that it leaves out."""
        return self.first_minibatch - self.run_start


@dataclass(frozen=True)
class Window:
    """The completions a measurement averages over: which intervals between consecutive
    completions of the last stage count (after the skipped ones, none across a checkpoint)."""

    start: int
    """The run's first completion (0, or a resumed run's first)."""
    ends: tuple[float, ...]
    """When completion ``start + i`` ended (Unix seconds)."""
    measured: tuple[int, ...]
    """The completions whose interval from the one before is measured, ascending."""

    def end(self, completion: int) -> float:
        """When ``completion`` ended."""
        return self.ends[completion - self.start]

    @property
    def spans(self) -> tuple[tuple[float, float], ...]:
        """The measured stretches of time: one per run of consecutive measured intervals."""
        spans: list[tuple[float, float]] = []
        for number, completion in enumerate(self.measured):
            if number and self.measured[number - 1] == completion - 1:
                spans[-1] = (spans[-1][0], self.end(completion))
            else:
                spans.append((self.end(completion - 1), self.end(completion)))
        return tuple(spans)

    @property
    def seconds(self) -> float:
        """The measured intervals' total length."""
        return sum(end - start for start, end in self.spans)


def default_skip(num_minibatches: int) -> int:
    """Minibatches left out at the start when none is given: a third, at least one, as long as
    two completions are left to measure between.

    >>> [default_skip(n) for n in (2, 3, 24, 200)]
    [0, 1, 8, 66]
    """
    return max(0, min(max(1, num_minibatches // 3), num_minibatches - 2))


def check_matches(traces: Sequence[RankTrace], plan: Plan) -> None:
    """The traces are a whole run of ``plan``: every rank's, on the plan's stages, of the plan's
    workload and shape where the traces record it, and run to the end."""
    if not traces:
        raise TraceError("the run has no traces; run the training with --trace")
    identity = plan_identity(plan)
    for trace in traces:
        for key, ran in (trace.plan or {}).items():
            if key in identity and ran != identity[key]:
                raise TraceError(
                    f"{trace.path}: the run trained {key} {_shown(ran)}, but the plan has "
                    f"{_shown(identity[key])}; pass the plan the run trained"
                )
    # a rank's trace names its first stage (interleaved and V schedules run several)
    ranks = {r: min(plan.stages_of_rank(r)) for s in plan.stages for r in s.ranks}
    for trace in traces:
        if trace.world_size != plan.world_size or ranks.get(trace.rank) != trace.stage:
            raise TraceError(
                f"{trace.path}: rank {trace.rank} ran stage {trace.stage} of {trace.world_size} "
                f"ranks, but the plan has {plan.world_size} ranks and puts rank {trace.rank} on "
                f"stage {ranks.get(trace.rank)}; pass the run directory of this plan's training"
            )
    missing = sorted(set(ranks) - {trace.rank for trace in traces})
    if missing:
        raise TraceError(
            f"the run has no trace of rank(s) {missing}; pass the whole --run-dir of a "
            "training run with --trace (on several nodes, copy every node's traces/ into one)"
        )
    stopped = [trace for trace in traces if not trace.complete]
    if stopped:
        ranks_ = [trace.rank for trace in stopped]
        raise TraceError(
            f"rank(s) {ranks_} stopped before the end of the run (it failed or was "
            f"interrupted; {stopped[0].path} ends after {len(stopped[0].events)} actions): "
            "measure a run that trained to the end (`pipedream trace RUN_DIR` without --plan "
            "still draws what ran)"
        )
    stretches = {trace.stretches for trace in traces}
    if len(stretches) > 1:
        raise TraceError(
            f"the ranks' traces record different stretches between checkpoints ({traces[0].path}"
            f": {_stretch_list(traces[0].stretches)}); are they of one run? re-run with --trace"
        )


def _shown(value: object) -> str:
    """A plan's value as a message shows it (short)."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _stretch_list(stretches: tuple[tuple[int, int], ...] | None) -> str:
    if stretches is None:
        return "not recorded"
    return ", ".join(f"{first}..{first + count - 1}" for first, count in stretches)


def _run_start(traces: Sequence[RankTrace], per_update: int) -> int:
    """The run's first completion: where its first stretch starts (a resumed run's
    checkpoint step), in the unit completions count; 0 where the traces do not record it."""
    stretches = traces[0].stretches
    return stretches[0][0] // per_update if stretches else 0


def completions(
    traces: Sequence[RankTrace], last_stage: int, unit: str, *, start: int = 0
) -> list[float]:
    """When each minibatch (``unit``: each update of a replicated last stage) from ``start`` on
    completed: the end of its last update on the last stage."""
    ends: dict[int, float] = {}
    for trace in traces:
        for event in trace.events:
            if event.op is Op.UPDATE and event.stage == last_stage:
                ends[event.index] = max(ends.get(event.index, event.end), event.end)
    if not ends:
        return []
    complete = max(ends) + 1
    if sorted(ends) != list(range(start, complete)):
        missing = sorted(set(range(start, complete)) - set(ends))[:5]
        what = "updates" if unit == "updates" else f"the updates of {unit}"
        raise TraceError(f"the last stage's traces lack {what} {missing}")
    return [ends[index] for index in range(start, complete)]


def steady_window(traces: Sequence[RankTrace], plan: Plan, *, skip: int | None) -> Window:
    """The completions after the first ``skip`` (default: :func:`default_skip`) and the
    intervals between them that do not span a checkpoint."""
    per_update = plan.stages[-1].replicas
    unit = "minibatches" if per_update == 1 else "updates"  # what skip counts
    start = _run_start(traces, per_update)
    ends = completions(traces, plan.num_stages - 1, unit, start=start)
    if skip is None:
        skip = default_skip(len(ends))
    if skip < 0:
        raise TraceError(f"cannot leave out {skip} {unit}; give 0 or more")
    if len(ends) - skip < 2:
        resumed = f" (resumed at {start})" if start else ""
        raise TraceError(
            f"the run completed {len(ends)} {unit}{resumed}; leaving out the first {skip} "
            "leaves fewer than 2 to measure between: train longer, or leave out fewer"
        )
    # the first completion of every later stretch: its interval spans the checkpoint
    restarts = {first // per_update for first, _ in (traces[0].stretches or ())[1:]}
    first = start + skip
    measured = [c for c in range(first + 1, start + len(ends)) if c not in restarts]
    if not measured:
        fewer = skip > 0 and any(c not in restarts for c in range(start + 1, start + len(ends)))
        raise TraceError(
            f"every interval between the {unit} after the first {skip} spans a checkpoint "
            f"(stretches {_stretch_list(traces[0].stretches)}; the pipeline drains at each): "
            "measure a run with longer stretches (--checkpoint-every)"
            + (", or leave out fewer" if fewer else "")
        )
    return Window(start, tuple(ends), tuple(measured))


def tables_of_run(traces: Sequence[RankTrace], plan: Plan) -> dict[int, list[Action]] | None:
    """The plan's tables for the minibatches the run trained (one per stretch between
    checkpoints, joined), if every rank's trace ran exactly its tables (None otherwise: then
    no peers are known)."""
    stretches = traces[0].stretches
    if stretches is None:  # a trace that did not record them: one table, inferred
        m = plan.microbatches
        forwards = [
            e.index for t in traces for e in t.events if e.op is Op.FORWARD and e.stage == 0
        ]
        if not forwards or len(forwards) % m:
            return None
        stretches = ((min(forwards) // m, len(forwards) // m),)
    tables: dict[int, list[Action]] = {trace.rank: [] for trace in traces}
    clip = any(event.op is Op.CLIP for event in traces[0].events)  # a global norm (C)
    for first, count in stretches:
        spec = spec_from_plan(plan, first, count, traces[0].edges, traces[0].tied, global_norm=clip)
        try:
            built = build_tables(spec)
        except ScheduleError:  # e.g. a run that stopped early: not a whole number of rounds
            return None
        for rank, table in tables.items():
            table += built.get(rank, [])
    for trace in traces:
        table = tables[trace.rank]
        if len(table) != len(trace.events):
            return None
        for action, event in zip(table, trace.events):
            ran = parse_action(event.action)
            if (ran.op, ran.stage, ran.index) != (action.op, action.stage, action.index):
                return None
    return tables


def message_times(traces: Sequence[RankTrace], plan: Plan) -> list[MessageTime]:
    """Every message of the run whose send and receive both ran, in milliseconds."""
    tables = tables_of_run(traces, plan)
    if tables is None:
        return []
    sent: dict[Message, float] = {}
    received: dict[Message, tuple[float, float]] = {}
    for trace in traces:
        for action, event in zip(tables[trace.rank], trace.events):
            if not action.op.is_comm:
                continue
            key = message_of(trace.rank, action)
            if action.op in _SENDS:
                sent[key] = event.start * 1000
            else:
                received[key] = (event.start * 1000, event.end * 1000)
    messages = []
    for key, (reached, done) in received.items():
        op, _, _, source, _, destination = key
        if key in sent:
            assert source is not None and destination is not None, key
            kind = message_kind(op)
            messages.append(MessageTime(source, destination, kind, sent[key], reached, done))
    return messages


def _inside(
    start: float, end: float, spans: Sequence[tuple[float, float]], starts: list[float]
) -> bool:
    """Whether ``[start, end]`` lies within one of the spans (sorted, disjoint; ``starts``:
    theirs)."""
    number = bisect.bisect_right(starts, start) - 1
    return number >= 0 and end <= spans[number][1]


def _overlap(event: TraceEvent, spans: Sequence[tuple[float, float]], starts: list[float]) -> float:
    """Seconds of ``event`` within the spans (sorted, disjoint; ``starts``: their starts)."""
    total = 0.0
    number = max(0, bisect.bisect_right(starts, event.start) - 1)
    while number < len(spans) and spans[number][0] < event.end:
        start, end = spans[number]
        total += max(0.0, min(end, event.end) - max(start, event.start))
        number += 1
    return total


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) * 1000 if values else None


def measure_run(traces: Sequence[RankTrace], plan: Plan, *, skip: int | None = None) -> MeasuredRun:
    """The steady-state time per minibatch of ``plan``'s run and each stage's mean action
    times, leaving out the first ``skip`` minibatches (default: :func:`default_skip`) and the
    intervals that span a checkpoint."""
    check_matches(traces, plan)
    per_update = plan.stages[-1].replicas
    window = steady_window(traces, plan, skip=skip)
    spans, length = window.spans, window.seconds
    starts = [start for start, _ in spans]
    stages = []
    for number in range(len(plan.stages)):
        durations: dict[str, list[float]] = {k: [] for k in ("F", "B", "I", "W", "U", "S")}
        between, posting, reclaiming = [], [], []
        recorded = True  # whether every event in the window says what came before it
        for trace in traces:
            if number not in plan.stages_of_rank(trace.rank):
                continue
            covered = posted = reclaimed = 0.0  # the rank's, shared by the stages it runs
            for event in trace.events:
                covered += _overlap(event, spans, starts)
                if not _inside(event.start, event.end, spans, starts):
                    continue
                if event.posting is None or event.reclaiming is None:
                    recorded = False
                else:
                    posted += event.posting
                    reclaimed += event.reclaiming
                key = "S" if event.op in _SENDS else event.op.value
                if key in durations and event.stage == number:
                    durations[key].append(event.end - event.start)
            gaps = length - covered  # the window's time in no action of the rank
            between.append(gaps / length if length > 0 else 0.0)
            posting.append(posted / length if length > 0 else 0.0)
            reclaiming.append(reclaimed / length if length > 0 else 0.0)
        backward_ms, input_share = _mean(durations["B"]), None
        halves = _mean(durations["I"]), _mean(durations["W"])
        if backward_ms is None and halves[0] is not None and halves[1] is not None:
            backward_ms = halves[0] + halves[1]
            input_share = halves[0] / backward_ms if backward_ms > 0 else 0.5
        stages.append(
            MeasuredStage(
                forward_ms=_mean(durations["F"]),
                backward_ms=backward_ms,
                input_share=input_share,
                update_ms=_mean(durations["U"]),
                send_ms=_mean(durations["S"]),
                between=statistics.fmean(between) if between else None,
                posting=statistics.fmean(posting) if posting and recorded else None,
                reclaiming=statistics.fmean(reclaiming) if reclaiming and recorded else None,
            )
        )
    measured = window.measured
    per_minibatch = length * 1000 / len(measured) / per_update
    first, last = measured[0] - 1, measured[-1]
    inside = [  # the messages sent and received within one span
        message
        for message in message_times(traces, plan)
        if _inside(message.sent_ms / 1000, message.received_ms / 1000, spans, starts)
    ]
    links = link_times(inside, -math.inf, math.inf)
    return MeasuredRun(
        per_minibatch,
        first,
        last,
        tuple(stages),
        per_update,
        tuple(links),
        run_start=window.start,
        across_checkpoints=last - first - len(measured),
    )


def measured_work(work: Sequence[StageWork], run: MeasuredRun) -> list[StageWork]:
    """``work`` with the forward, backward and update times the run measured.

    The measured means already hold the gradient accumulation and the version copies, so those
    are not added again; a cost the window did not see (a stage without updates in it) keeps
    the profiled value. Bytes and the network stay as they are.
    """
    assert len(work) == len(run.stages), (len(work), len(run.stages))
    replaced = []
    for profiled, measured in zip(work, run.stages):
        changes: dict[str, float] = {}
        if measured.forward_ms is not None:
            changes["forward_ms"] = measured.forward_ms
        if measured.backward_ms is not None:
            changes.update(backward_ms=measured.backward_ms, accumulate_ms=0.0)
        if measured.input_share is not None:
            changes["input_share"] = measured.input_share
        if measured.update_ms is not None:
            changes.update(update_ms=measured.update_ms, copy_ms=0.0)
        replaced.append(dataclasses.replace(profiled, **changes))
    return replaced
