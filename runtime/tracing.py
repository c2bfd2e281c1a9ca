"""Writing a rank's action timeline (``--trace``): ``RUN_DIR/traces/rank-NNN.json``."""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["TRACE_FORMAT", "write_trace"]

TRACE_FORMAT = "pipedream/trace@1"


def write_trace(
    run_dir: Path,
    trace: list[tuple[str, float, float]],
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
            {"action": name, "start": start + offset, "end": end + offset}
            for name, start, end in trace
        ],
    }
    directory = run_dir / "traces"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{rank:03d}.json"
    path.write_text(json.dumps(payload))
    return path
