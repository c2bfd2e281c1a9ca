"""One-way time of a gloo message between two processes on this machine, and what posting one
costs the sender.

Launched with torchrun by the benchmarks::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gloo_p2p.py OUT.json

Rank 0 sends a float32 tensor of each size to rank 1, which receives it into a fresh buffer
(as the runtime does), after ``WARM_MESSAGES`` (``common.py``) untimed messages of that size
(a fresh link is slow at first). Then the same messages go through the runtime's own transport
(:class:`pipedream.runtime.comm.P2P`: a header and the payload, the receive posted ahead), and
the time ``P2P.send`` holds the sender is taken: the main thread packs the message and hands it
to gloo, which writes the first megabytes into the socket right there (the simulator's
``--send-overhead``). The medians over repeats are written to ``OUT.json`` as
``{"one_way_ms": {bytes: ms}, "post_ms": {bytes: ms}}``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import WARM_MESSAGES

from pipedream.host_memory import configure_host_memory
from pipedream.runtime.comm import P2P

__all__ = ["SIZES", "main"]

SIZES = (32 * 1024, 32 * 1024 * 1024)
"""Message sizes of the sleep benchmark (bytes)."""
REPEATS = 9


def _one_way_ms(payload: torch.Tensor) -> float:
    """Median time of one message, rank 0 to rank 1 (each measures its own side)."""
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(payload, 1)
        else:
            dist.recv(torch.empty_like(payload), 0)  # a fresh buffer, as the runtime's
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _post_ms(payload: torch.Tensor, first: int) -> float:
    """Median time ``P2P.send`` holds rank 0 (messages numbered from ``first``); 0 on rank 1.

    A transport of its own per size: its first message (untimed) defines the channel's
    reference, so the timed ones take the runtime's steady path (the receives posted ahead).
    """
    rank = dist.get_rank()
    p2p = P2P(rank=rank, device=torch.device("cpu"), timeout=120.0, post_early=True)
    times = []
    for index in range(first, first + REPEATS + 1):
        if rank == 1:
            p2p.post_recv("act", index, 0)  # ahead, as the runtime posts its receives
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            p2p.send("act", index, 1, [payload], version=0)
            if index > first:
                times.append(time.perf_counter() - start)
            p2p.drain(what="the calibration's send")
        else:
            p2p.recv("act", index, 0, what="the calibration's message")
    return statistics.median(times) * 1000 if times else 0.0


def main(argv: list[str]) -> int:
    configure_host_memory()  # the runtime's allocator settings: they change the copy cost
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    one_way, post = {}, {}
    for number, size in enumerate(SIZES):
        payload = torch.zeros(size // 4)
        for _ in range(WARM_MESSAGES):  # a fresh link is slow for its first gigabyte or so
            if rank == 0:
                dist.send(payload, 1)
            else:
                dist.recv(torch.empty_like(payload), 0)
        one_way[size] = _one_way_ms(payload)
        post[size] = _post_ms(payload, first=number * (REPEATS + 1))
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, post)  # the sender's post times, the receiver's one-way
    if rank == 1:
        result = {"one_way_ms": one_way, "post_ms": gathered[0]}
        Path(argv[0]).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
