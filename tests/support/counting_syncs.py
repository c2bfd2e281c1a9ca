"""``pipedream train`` with every host synchronisation with the GPU counted (a torchrun entry).

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        tests/support/counting_syncs.py OUT_PREFIX train PLAN [train options]

PyTorch reports each synchronisation to the callbacks of its GPU trace (the hooks its CUDA
sanitizer uses): a device synchronisation, a stream synchronisation (also every blocking copy
between host and GPU: ``.item()``, ``.tolist()``, ``.cpu()``, a ``.to()`` without
``non_blocking``) and an event synchronisation. Not counted: what the host waits for inside
CUDA without PyTorch seeing it (a ``non_blocking`` copy from pageable memory, ``cudaHostAlloc``
for a new pinned block, the caching allocator's frees, waits inside NCCL or gloo, a full launch
queue).

This entry counts the three kinds from the start of the process and records the counts after
every update of every stage, then writes ``OUT_PREFIX.rank<R>.json``: ``{"at_updates":
[{"device": .., "stream": .., "event": ..}, ...], "total": {...}}``. The differences between
consecutive updates are the synchronisations of one minibatch. Without a GPU nothing is
counted (every count stays 0).

Tests call :func:`count_syncs`, which launches this entry and reads what it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from launching import torchrun

NONE = {"device": 0, "stream": 0, "event": 0}
"""The counts of a stretch without a synchronisation."""


@dataclass(frozen=True)
class RankSyncs:
    """One rank's synchronisations: per minibatch from its first update on, and after it."""

    between_updates: list[dict[str, int]]
    """From each update to the next (one entry fewer than the updates)."""
    after_last_update: dict[str, int]
    """From the last update to the end of the process (reads, checkpoint, summary)."""


def count_syncs(
    tmp: Path, plan: Path, *train_args: str, nproc: int, timeout: float = 150
) -> tuple[subprocess.CompletedProcess[str], list[RankSyncs]]:
    """``pipedream train PLAN TRAIN_ARGS`` on ``nproc`` ranks, counting; each rank's counts.
    ``timeout`` stops a hung run early (on a lent GPU its time is short)."""
    prefix = tmp / "syncs"
    result = torchrun(
        Path(__file__), str(prefix), "train", str(plan), *train_args, nproc=nproc, timeout=timeout
    )
    ranks = []
    for rank in range(nproc if result.returncode == 0 else 0):
        record = json.loads(Path(f"{prefix}.rank{rank}.json").read_text())
        at, total = record["at_updates"], record["total"]
        between = [{kind: b[kind] - a[kind] for kind in a} for a, b in zip(at, at[1:])]
        after = {kind: total[kind] - at[-1][kind] for kind in total} if at else dict(total)
        ranks.append(RankSyncs(between, after))
    return result, ranks


def main(argv: list[str]) -> int:
    prefix, cli_args = argv[0], argv[1:]
    counts = dict(NONE)
    at_updates: list[dict[str, int]] = []

    def bump(kind: str):
        def callback(*_: object) -> None:
            counts[kind] += 1

        return callback

    if torch.cuda.is_available():
        from torch.cuda import _gpu_trace

        _gpu_trace.register_callback_for_device_synchronization(bump("device"))
        _gpu_trace.register_callback_for_stream_synchronization(bump("stream"))
        _gpu_trace.register_callback_for_event_synchronization(bump("event"))
        torch._C._activate_gpu_trace()

    from pipedream.runtime.stage_worker import StageWorker

    update = StageWorker.update

    def counted_update(self: StageWorker, position: int) -> None:
        update(self, position)
        at_updates.append(dict(counts))

    StageWorker.update = counted_update  # type: ignore[method-assign]
    from pipedream.cli import main as cli

    code = cli(cli_args)
    rank = os.environ.get("RANK", "0")
    record = {"at_updates": at_updates, "total": counts}
    Path(f"{prefix}.rank{rank}.json").write_text(json.dumps(record))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
