"""``pipedream train`` with every host synchronisation with the GPU counted (a torchrun entry).

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        tests/support/counting_syncs.py OUT_PREFIX train PLAN [train options]

PyTorch reports each synchronisation to the callbacks of its GPU trace (the hooks its CUDA
sanitizer uses): a device synchronisation, a stream synchronisation (also every blocking copy
between host and GPU: ``.item()``, ``.tolist()``, ``.cpu()``, a copy from pageable memory)
and an event synchronisation. This entry counts the three kinds from the start of the process
and records the counts after every update of every stage, then writes
``OUT_PREFIX.rank<R>.json``: ``{"at_updates": [{"device": .., "stream": .., "event": ..},
...], "total": {...}}``. The differences between consecutive updates are the synchronisations of
one minibatch. Without a GPU nothing is counted (every count stays 0).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> int:
    prefix, cli_args = argv[0], argv[1:]
    counts = {"device": 0, "stream": 0, "event": 0}
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
