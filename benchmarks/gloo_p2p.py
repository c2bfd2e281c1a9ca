"""One-way time of a gloo message between two processes on this machine (the transport's limit).

Launched with torchrun by the benchmarks::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gloo_p2p.py OUT.json

Rank 0 sends a float32 tensor of each size to rank 1, which receives it into a fresh buffer
(as the runtime does), after ``WARM_MESSAGES`` (``common.py``) untimed messages of that size
(a fresh link is slow at first); the median over repeats is written to ``OUT.json`` as
``{bytes: milliseconds}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import WARM_MESSAGES

from pipedream.host_memory import configure_host_memory

__all__ = ["SIZES", "main"]

SIZES = (32 * 1024, 32 * 1024 * 1024)
"""Message sizes of the sleep benchmark (bytes)."""


def main(argv: list[str]) -> int:
    configure_host_memory()  # the runtime's allocator settings: they change the copy cost
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for size in SIZES:
        payload = torch.zeros(size // 4)
        for _ in range(WARM_MESSAGES):  # a fresh link is slow for its first gigabyte or so
            if rank == 0:
                dist.send(payload, 1)
            else:
                dist.recv(torch.empty_like(payload), 0)
        times = []
        for _ in range(9):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(payload, 1)
            else:
                buffer = torch.empty(size // 4)
                dist.recv(buffer, 0)
            times.append(time.perf_counter() - start)
        results[size] = sorted(times)[len(times) // 2] * 1000
    if rank == 1:
        Path(argv[0]).write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
