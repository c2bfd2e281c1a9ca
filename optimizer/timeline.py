"""Showing a simulated :class:`~pipedream.optimizer.simulator.Timeline`: a text grid and a PNG.

The grid has one row per rank and one column per time slot; a cell shows what the rank does
in the middle of the slot (``F3``/``B3``: forward/backward of microbatch 3, ``A``: allreduce,
``U``: update, ``S``: posting a send, where the network charges it, ``R``: posting receives
ahead, ``W``: waiting for its earlier sends to leave, beyond the runtime's bound on sends in
flight) and ``.`` when it waits for anything else: the bubbles. GPipe, 2 stages, 2
microbatches, F = B::

    rank (stage) | 0  1  2  3  4  5
       0 (0)     | F0 F1 .  .  B0 B1
       1 (1)     | .  F0 F1 B0 B1 .

The PNG draws the same with matplotlib (an optional dependency: ``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import os

from pipedream.errors import PlanningError
from pipedream.formats.plan import Plan
from pipedream.optimizer.simulator import Event, Timeline
from pipedream.wording import count

__all__ = ["COLOURS", "draw_timeline", "format_timeline", "slot_ms"]

COLOURS = {
    "F": "#4c72b0",
    "B": "#55a868",
    "I": "#8fd19e",
    "W": "#2d6a3e",
    "A": "#c44e52",
    "U": "#8c8c8c",
    "S": "#dd8452",
    "R": "#937860",
    "H": "#e5c494",
}
"""Bar colours: forward blue, backward green (its input-gradient half light, its weight-gradient
half dark), allreduce red, update grey, send orange, receives posted ahead brown, held by sends
still to leave sand."""


def slot_ms(timeline: Timeline) -> float:
    """The grid's resolution: the shortest forward or backward (so each shows at least once)."""
    durations = [e.end_ms - e.start_ms for e in timeline.events if e.kind in "FBIW"]
    positive = [d for d in durations if d > 0]
    return min(positive) if positive else max(timeline.makespan_ms, 1e-9)


def _label(event: Event) -> str:
    return f"{event.kind}{event.index}" if event.kind in "FBIW" else event.kind


def format_timeline(timeline: Timeline, plan: Plan, *, width: int = 64) -> str:
    """The rank x time-slot grid of the first ``width`` slots (see the module docstring)."""
    slot = slot_ms(timeline)
    total = max(1, round(timeline.makespan_ms / slot))
    shown = min(total, width)
    by_rank: dict[int, list[Event]] = {}
    for event in timeline.events:
        if event.end_ms > event.start_ms:
            by_rank.setdefault(event.rank, []).append(event)
    stage_of = _stages_of_ranks(plan)
    rows: dict[int, list[str]] = {}
    for rank in sorted(stage_of):
        events, cells, i = by_rank.get(rank, []), [], 0
        for column in range(shown):
            middle = (column + 0.5) * slot
            while i < len(events) and events[i].end_ms <= middle:
                i += 1
            hit = i < len(events) and events[i].start_ms <= middle
            cells.append(_label(events[i]) if hit else ".")
        rows[rank] = cells
    cell = max([len(c) for cells in rows.values() for c in cells] + [len(str(shown - 1))]) + 1
    head = "rank (stage)"
    lead = max([len(head)] + [len(f"{rank} ({stage_of[rank]})") for rank in rows])
    head = head.ljust(lead)
    lines = [f"{head} | " + "".join(f"{s:<{cell}}" for s in range(shown)).rstrip()]
    for rank, cells in rows.items():
        name = f"{rank} ({stage_of[rank]})".rjust(lead)
        lines.append(f"{name} | " + "".join(f"{c:<{cell}}" for c in cells).rstrip())
    note = f"one slot = {slot:.4g} ms"
    if total > shown:
        note += f"; first {shown} of {total} slots shown (--width)"
    return "\n".join([*lines, note])


def draw_timeline(timeline: Timeline, plan: Plan, path: str | os.PathLike[str]) -> None:
    """Draw the timeline to a PNG: one row per rank (grouped by stage), bubbles left blank."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise PlanningError(
            f"--png {path}: drawing needs matplotlib; install it with pip install -e '.[plot]' "
            "(or leave out --png for the text grid)"
        ) from None
    ranks = list(dict.fromkeys(rank for stage in plan.stages for rank in stage.ranks))
    row = {rank: i for i, rank in enumerate(ranks)}
    stage_of = _stages_of_ranks(plan)
    figure, axes = plt.subplots(figsize=(12, 1.6 + 0.45 * len(ranks)))
    for kind, colour in COLOURS.items():
        events = [e for e in timeline.events if e.kind == kind and e.end_ms > e.start_ms]
        for event in events:
            width = event.end_ms - event.start_ms
            axes.barh(
                row[event.rank],
                width,
                left=event.start_ms,
                height=0.8,
                color=colour,
                edgecolor="white",
                linewidth=0.4,
            )
            if kind in "FB" and width > timeline.makespan_ms / 80:
                axes.text(
                    event.start_ms + width / 2,
                    row[event.rank],
                    str(event.index),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    axes.set_yticks(range(len(ranks)), [f"stage {stage_of[r]} / rank {r}" for r in ranks])
    axes.invert_yaxis()
    axes.set_xlabel("time (ms)")
    axes.set_xlim(0, timeline.makespan_ms)
    axes.set_title(
        f"{plan.workload}: {plan.schedule}, {count(plan.num_stages, 'stage')}, "
        f"{count(plan.microbatches, 'microbatch')}/minibatch; simulated "
        f"{timeline.time_per_minibatch_ms:.3f} ms per minibatch (white: bubbles)"
    )
    names = {
        "F": "forward",
        "B": "backward",
        "I": "input gradient",
        "W": "weight gradient",
        "A": "allreduce",
        "U": "update",
        "S": "send",
        "R": "receives posted",
        "H": "waiting for sends",
    }
    shown = {event.kind for event in timeline.events}
    axes.legend(
        handles=[Patch(color=c, label=names[k]) for k, c in COLOURS.items() if k in shown],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 1.5 / (4 + len(ranks))),
        ncol=7,
        fontsize=8,
        frameon=False,
    )
    figure.tight_layout()
    figure.savefig(os.fspath(path), dpi=110)
    plt.close(figure)


def _stages_of_ranks(plan: Plan) -> dict[int, str]:
    """Rank -> the stage it runs (``0``), or the stages (``0,3``) under interleaved and V
    schedules."""
    ranks = sorted({rank for stage in plan.stages for rank in stage.ranks})
    return {rank: ",".join(str(s) for s in plan.stages_of_rank(rank)) for rank in ranks}
