"""A run's action timelines as a PNG Gantt chart (ranks x time), drawn with matplotlib.

One row per rank: forward, backward, update, communication (sends, receive waits, allreduce)
in their own colours on a light grey background, so that idle time (bubbles, waits outside
any action) is whatever stays grey. Forward and backward bars carry their microbatch number
when they are wide enough to read. matplotlib is optional (``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from pipedream.errors import TraceError
from pipedream.formats.trace import RankTrace

__all__ = ["COLOURS", "matplotlib_available", "plot_timeline"]

COLOURS: dict[str, str] = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "backward-input": "#8fd19e",
    "backward-weight": "#2d6a3e",
    "update": "#8172b2",
    "send": "#dd8452",
    "receive-wait": "#c44e52",
    "allreduce": "#937860",
}
"""Bar colour of each trace category; idle time is :data:`IDLE`."""

IDLE = "#e6e6e6"
_LABELLED = ("forward", "backward", "backward-input", "backward-weight")
_LEGEND = {
    "forward": "forward",
    "backward": "backward",
    "backward-input": "input gradient (I)",
    "backward-weight": "weight gradient (W)",
    "update": "optimizer update",
    "send": "send (posting)",
    "receive-wait": "receive wait",
    "allreduce": "allreduce",
}


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None


def plot_timeline(
    traces: Sequence[RankTrace],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    window: tuple[float, float] | None = None,
) -> Path:
    """Draw the Gantt chart of ``traces`` to ``path`` (PNG) and return the path.

    ``window`` = (start, end) in milliseconds since the run's first action restricts the time
    axis (e.g. to a few steady-state minibatches); by default the whole run is drawn.
    """
    if not matplotlib_available():
        raise TraceError(
            f"drawing {path} needs matplotlib, which is not installed; "
            "pip install matplotlib (or pip install -e '.[plot]'), or leave out --png"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min((e.start for t in traces for e in t.events), default=0.0)
    finish = max((e.end for t in traces for e in t.events), default=origin)
    low, high = window if window is not None else (0.0, (finish - origin) * 1000)
    span = max(high - low, 1e-9)
    figure, axes = plt.subplots(figsize=(14, 1.5 + 0.5 * len(traces)), dpi=100)
    used: set[str] = set()
    for row, trace in enumerate(traces):
        if trace.events:
            first = (trace.events[0].start - origin) * 1000
            last = (trace.events[-1].end - origin) * 1000
            axes.broken_barh([(first, last - first)], (row - 0.4, 0.8), color=IDLE)
        bars: dict[str, list[tuple[float, float]]] = {}
        for event in trace.events:
            start, width = (event.start - origin) * 1000, (event.end - event.start) * 1000
            if start + width < low or start > high:
                continue
            bars.setdefault(event.category, []).append((start, width))
            if event.category in _LABELLED and width > span / 120:
                axes.text(
                    start + width / 2,
                    row,
                    str(event.index),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                    clip_on=True,
                )
        for category, spans in bars.items():
            axes.broken_barh(spans, (row - 0.4, 0.8), color=COLOURS[category], linewidth=0)
            used.add(category)
    axes.set_yticks(range(len(traces)))
    axes.set_yticklabels([_label(t) for t in traces])
    axes.set_ylim(len(traces) - 0.5, -0.5)  # rank 0 on top
    axes.set_xlim(low, high)
    axes.set_xlabel("time since the first action (ms)")
    axes.set_title(title or "pipeline timeline")
    handles = [Patch(color=COLOURS[c], label=_LEGEND[c]) for c in COLOURS if c in used]
    handles.append(Patch(color=IDLE, label="idle"))
    height = 1.5 + 0.5 * len(traces)
    figure.set_size_inches(14, height)
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=8)
    figure.tight_layout(rect=(0, 0.35 / height, 1, 1))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target)
    plt.close(figure)
    return target


def _label(trace: RankTrace) -> str:
    """``rank 0 (stage 2)``, or ``rank 0 (stages 0, 7)`` for a rank that runs several."""
    stages = sorted({event.stage for event in trace.events} or {trace.stage})
    if len(stages) == 1:
        return f"rank {trace.rank} (stage {stages[0]})"
    return f"rank {trace.rank} (stages {', '.join(map(str, stages))})"
