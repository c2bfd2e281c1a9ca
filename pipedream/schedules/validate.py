"""Checks an action table before anything runs, and prints it as a rank x step grid.

The checks: every stage replica runs F and B of each of its microbatches exactly once (and each
microbatch runs at exactly one replica of every stage), every send has its receive on the peer
(and the other way round), allreduces of a stage's replicas line up, and a dependency simulation
(sends never block; a receive waits for its send; an allreduce waits for all replicas) runs every
action, so the real run cannot deadlock. A failure raises :class:`ScheduleError` whose message
holds the grid with the failing step marked.
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


def simulate_dependencies(tables: Mapping[int, Sequence[Action]]) -> None:
    """Run the tables symbolically; raise ScheduleError if some rank can never proceed."""
    position = {rank: 0 for rank in tables}
    sent: set[tuple[Op, int, int, int]] = set()  # (recv op, microbatch, from rank, to rank)
    # allreduce rendezvous: (stage, index) -> ranks that reached it
    arrived: dict[tuple[int, int], set[int]] = {}
    replicas_of: dict[int, set[int]] = {}
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
                    assert action.peer is not None
                    sent.add((_MATCH[action.op], action.index, rank, action.peer))
                elif action.op.is_receive:
                    key = (action.op, action.index, action.peer, rank)
                    if key not in sent:
                        break
                    sent.discard(key)
                elif action.op is Op.ALLREDUCE:
                    group = arrived.setdefault((action.stage, action.index), set())
                    group.add(rank)
                    if group != replicas_of[action.stage]:
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
    sends: Counter[tuple[Op, int, int, int]] = Counter()
    recvs: Counter[tuple[Op, int, int, int]] = Counter()
    for stage, ranks in enumerate(spec.stage_ranks):
        forwards: Counter[int] = Counter()
        backwards: Counter[int] = Counter()
        for rank in ranks:
            seen_forward: set[int] = set()
            for pos, action in enumerate(tables[rank]):
                if action.stage != stage:
                    _fail(tables, rank, pos, f"rank {rank} runs stage {stage}, not {action.stage}")
                if action.op is Op.FORWARD:
                    forwards[action.index] += 1
                    seen_forward.add(action.index)
                    if spec.rank_of(stage, action.index // m) != rank:
                        _fail(tables, rank, pos, f"microbatch {action.index} at the wrong replica")
                elif action.op is Op.BACKWARD:
                    backwards[action.index] += 1
                    if action.index not in seen_forward:
                        _fail(tables, rank, pos, f"backward of {action.index} before its forward")
                elif action.op in _MATCH:
                    sends[(_MATCH[action.op], action.index, rank, action.peer or 0)] += 1
                elif action.op.is_receive:
                    recvs[(action.op, action.index, action.peer or 0, rank)] += 1
        for name, counter in (("forward", forwards), ("backward", backwards)):
            if set(counter) != expected_micro or any(c != 1 for c in counter.values()):
                wrong = sorted(
                    mb for mb in expected_micro | set(counter) if counter.get(mb, 0) != 1
                )[:8]
                raise ScheduleError(
                    f"stage {stage} does not run the {name} of each microbatch exactly once "
                    f"(microbatches {wrong})\n" + format_grid(tables)
                )
    if sends != recvs:
        unmatched = sorted(((sends - recvs) + (recvs - sends)).keys())[:4]
        raise ScheduleError(
            f"sends and receives do not match: {unmatched} (op, microbatch, from, to)\n"
            + format_grid(tables, compute_only=False)
        )
    simulate_dependencies(tables)
