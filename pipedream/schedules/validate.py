"""Checks an action table before anything runs, and prints it as a rank x step grid.

The checks: every stage replica runs F and the backward of each of its microbatches exactly
once, the backward as one B or as an I and a later W (and each microbatch runs at exactly one
replica of every stage), a rank runs only its own stages, every send has its receive on the
peer (and the other way round; a message is known by its kind, microbatch and the ranks and
stages at both ends), allreduces of a stage's replicas line up, a global-norm run's ``C`` of each
update comes once per rank, after the rank's gradient work of the update and before its updates,
and a dependency simulation (sends never block; a receive waits for its send; an allreduce waits
for all replicas, a ``C`` for all ranks) runs every action, so the real run cannot deadlock. A
failure raises :class:`ScheduleError` whose message holds the grid with the failing step marked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from pipedream.errors import ScheduleError
from pipedream.schedules.actions import MATCHING_RECEIVE, Action, Op
from pipedream.schedules.spec import PipelineSpec

__all__ = ["format_grid", "simulate_dependencies", "validate_tables"]

_MATCH = MATCHING_RECEIVE


def format_grid(
    tables: Mapping[int, Sequence[Action]],
    *,
    compute_only: bool = True,
    mark: tuple[int, int] | None = None,
    max_steps: int = 48,
) -> str:
    """Rank x step grid of the tables; ``mark=(rank, position)`` flags one cell with ``!``.

    ``position`` indexes the rank's full table; with ``compute_only`` communication is hidden.
    """
    rows: dict[int, list[str]] = {}
    for rank, table in sorted(tables.items()):
        cells = []
        for position, action in enumerate(table):
            if compute_only and action.op.is_comm and not (mark and mark == (rank, position)):
                continue
            text = str(action)
            if mark == (rank, position):
                text = f"!{text}!"
            cells.append(text)
        rows[rank] = cells
    width = max((len(c) for cells in rows.values() for c in cells), default=3) + 1
    steps = max((len(cells) for cells in rows.values()), default=0)
    shown = min(steps, max_steps)
    lines = [("rank | " + "".join(f"{s:<{width}}" for s in range(shown))).rstrip()]
    for rank, cells in rows.items():
        line = f"{rank:>4} | " + "".join(f"{c:<{width}}" for c in cells[:shown])
        if len(cells) > shown:
            line += f"... (+{len(cells) - shown})"
        lines.append(line.rstrip())
    return "\n".join(lines)


Message = tuple[Op, int, int, int | None, int, int | None]
"""(receive op, index, from rank, from stage, to rank, to stage)."""


def message_of(rank: int, action: Action) -> Message:
    """The message a send or receive of ``rank`` moves (sends named by their receive)."""
    assert action.peer is not None, action
    if action.op in _MATCH:
        return (_MATCH[action.op], action.index, rank, action.stage, action.peer, action.peer_stage)
    return (action.op, action.index, action.peer, action.peer_stage, rank, action.stage)


def simulate_dependencies(tables: Mapping[int, Sequence[Action]]) -> None:
    """Run the tables symbolically; raise ScheduleError if some rank can never proceed."""
    position = {rank: 0 for rank in tables}
    sent: set[Message] = set()
    # allreduce rendezvous: (stage, index) -> ranks that reached it (stage -1: a clip's)
    arrived: dict[tuple[int, int], set[int]] = {}
    replicas_of: dict[int, set[int]] = {-1: set(tables)}
    for rank, table in tables.items():
        for action in table:
            replicas_of.setdefault(action.stage, set()).add(rank)
    progress = True
    while progress:
        progress = False
        for rank, table in tables.items():
            while position[rank] < len(table):
                action = table[position[rank]]
                if action.op in _MATCH:
                    sent.add(message_of(rank, action))
                elif action.op.is_receive:
                    key = message_of(rank, action)
                    if key not in sent:
                        break
                    sent.discard(key)
                elif action.op in (Op.ALLREDUCE, Op.CLIP):
                    among = action.stage if action.op is Op.ALLREDUCE else -1
                    group = arrived.setdefault((among, action.index), set())
                    group.add(rank)
                    if group != replicas_of[among]:
                        break
                position[rank] += 1
                progress = True
    stuck = {rank: pos for rank, pos in position.items() if pos < len(tables[rank])}
    if stuck:
        rank, pos = min(stuck.items())
        waiting = ", ".join(
            f"rank {r} at step {p} ({tables[r][p].describe()})" for r, p in sorted(stuck.items())
        )
        raise ScheduleError(
            f"the schedule deadlocks: {waiting}\n"
            + format_grid(tables, compute_only=False, mark=(rank, pos))
        )


def _fail(tables: Mapping[int, Sequence[Action]], rank: int, pos: int, problem: str) -> None:
    raise ScheduleError(f"{problem}\n" + format_grid(tables, compute_only=False, mark=(rank, pos)))


def _out_of_order(action: Action, done: Mapping[Op, set[int]]) -> str:
    """Why a stage's compute ``action`` cannot come after the computations in ``done``."""
    index, op = action.index, action.op
    if op is Op.FORWARD:
        return f"second forward of microbatch {index}" if index in done[op] else ""
    if index not in done[Op.FORWARD]:
        return f"backward of {index} before its forward"
    # membership, never a union of the sets: that copied them at every action (quadratic)
    halves = index in done[Op.BACKWARD_INPUT] or index in done[Op.BACKWARD_WEIGHT]
    if op is Op.BACKWARD and halves:
        return f"backward of {index} both whole and in halves"
    if op is Op.BACKWARD_INPUT and index in done[Op.BACKWARD]:
        return f"backward of {index} both whole and in halves"
    if op is Op.BACKWARD_WEIGHT:
        if index not in done[Op.BACKWARD_INPUT]:
            return f"weight gradient of {index} before its input gradient"
        if index in done[Op.BACKWARD_WEIGHT]:
            return f"second weight gradient of microbatch {index}"
    return ""


def _check_clips(spec: PipelineSpec, tables: Mapping[int, Sequence[Action]]) -> None:
    """A clipped spec: one ``C`` per rank and update, after the rank's gradient work of the
    update and before its updates; an unclipped one: none."""
    from pipedream.schedules.global_norm import update_of

    for rank, table in tables.items():
        clipped: dict[int, int] = {}
        for pos, action in enumerate(table):
            if action.op is Op.CLIP:
                if not spec.global_norm:
                    _fail(tables, rank, pos, "a gradient clip in a run that does not clip")
                if action.index in clipped:
                    _fail(tables, rank, pos, f"a second clip of update {action.index}")
                clipped[action.index] = pos
        if not spec.global_norm:
            continue
        for pos, action in enumerate(table):
            update = update_of(spec, action)
            if update is None or action.op is Op.CLIP:
                continue
            at = clipped.get(update)
            if at is None:
                _fail(tables, rank, pos, f"rank {rank} never clips update {update}")
            elif action.op in (Op.UPDATE, Op.SEND_WEIGHTS) and pos < at:
                _fail(tables, rank, pos, f"{action} before the clip of update {update}")
            elif action.op not in (Op.UPDATE, Op.SEND_WEIGHTS) and pos > at:
                _fail(tables, rank, pos, f"{action}, work of update {update}, after its clip")


def validate_tables(spec: PipelineSpec, tables: Mapping[int, Sequence[Action]]) -> None:
    """All structural checks, then the dependency simulation."""
    m = spec.microbatches
    expected_micro = {
        k * m + j
        for k in range(spec.first_minibatch, spec.first_minibatch + spec.num_minibatches)
        for j in range(m)
    }
    if set(tables) != set(range(spec.world_size)):
        raise ScheduleError(f"tables for ranks {sorted(tables)}, expected 0..{spec.world_size - 1}")
    sends: Counter[Message] = Counter()
    recvs: Counter[Message] = Counter()
    for rank, table in tables.items():
        for pos, action in enumerate(table):
            if rank not in spec.stage_ranks[action.stage]:
                _fail(tables, rank, pos, f"rank {rank} does not run stage {action.stage}")
            if action.op in _MATCH:
                sends[message_of(rank, action)] += 1
            elif action.op.is_receive:
                recvs[message_of(rank, action)] += 1
    for stage, ranks in enumerate(spec.stage_ranks):
        counts = {op: Counter[int]() for op in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT)}
        for rank in ranks:
            done: dict[Op, set[int]] = {op: set() for op in Op}
            for pos, action in enumerate(tables[rank]):
                if action.stage != stage or not action.op.is_compute:
                    continue
                problem = _out_of_order(action, done)
                if problem:
                    _fail(tables, rank, pos, problem)
                done[action.op].add(action.index)
                if action.op is Op.FORWARD and spec.rank_of(stage, action.index // m) != rank:
                    _fail(tables, rank, pos, f"microbatch {action.index} at the wrong replica")
                if action.op in counts:
                    counts[action.op][action.index] += 1
            unfinished = done[Op.BACKWARD_INPUT] - done[Op.BACKWARD_WEIGHT]
            if unfinished:
                raise ScheduleError(
                    f"stage {stage} at rank {rank} never runs the weight gradient of "
                    f"microbatches {sorted(unfinished)[:8]}\n" + format_grid(tables)
                )
        backwards = counts[Op.BACKWARD] + counts[Op.BACKWARD_INPUT]
        for name, counter in (("forward", counts[Op.FORWARD]), ("backward", backwards)):
            if set(counter) != expected_micro or any(c != 1 for c in counter.values()):
                wrong = sorted(
                    mb for mb in expected_micro | set(counter) if counter.get(mb, 0) != 1
                )[:8]
                raise ScheduleError(
                    f"stage {stage} does not run the {name} of each microbatch exactly once "
                    f"(microbatches {wrong})\n" + format_grid(tables)
                )
    _check_clips(spec, tables)
    if sends != recvs:
        unmatched = sorted(((sends - recvs) + (recvs - sends)).keys(), key=str)[:4]
        raise ScheduleError(
            f"sends and receives do not match: {unmatched} (op, microbatch, from rank, from "
            "stage, to rank, to stage)\n" + format_grid(tables, compute_only=False)
        )
    simulate_dependencies(tables)
