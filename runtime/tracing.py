"""Writing a rank's action timeline (``--trace``): ``RUN_DIR/traces/rank-NNN.json``.

Each event is one action of the rank's table: its ``action`` (compact form), ``start`` and
``end``, and what the executor did right before it, between the previous action and this one:
``posting`` (seconds spent posting receives ahead, :mod:`~pipedream.schedules.posting`) and
``reclaiming`` (seconds spent waiting for earlier sends to complete, so that at most
``MAX_SENDS_IN_FLIGHT`` parts stay in flight). Traces written before those two were recorded
lack them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["TRACE_FORMAT", "TracedAction", "write_trace"]

TRACE_FORMAT = "pipedream/trace@1"

TracedAction = tuple[str, float, float, float, float]
"""What the executor records per action: its compact form, start and end
(``time.perf_counter()``), and the seconds it spent right before it posting receives ahead and
reclaiming sends."""


def write_trace(
    run_dir: Path,
    trace: list[TracedAction],
    *,
    rank: int,
    stage: int,
    world_size: int,
) -> Path:
    """Every action's start and end, on a clock shared by all ranks.

    The executor records ``time.perf_counter()`` (cheap, monotonic); it is converted to Unix
    seconds with one offset per rank so that the ranks' timelines line up when merged.
    """
    offset = time.time() - time.perf_counter()
    payload = {
        "format": TRACE_FORMAT,
        "rank": rank,
        "stage": stage,
        "world_size": world_size,
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
    path.write_text(json.dumps(payload))
    return path
