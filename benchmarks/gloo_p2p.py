"""One-way time of a gloo message between two processes on this machine, and what posting one
costs the sender and posting its receive ahead the receiver.

Launched with torchrun by the benchmarks::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gloo_p2p.py OUT.json

Rank 0 sends a float32 tensor of each size to rank 1, which receives it into a buffer of the
runtime's pool (:class:`pipedream.runtime.receive_buffers.ReceiveBuffers`: the storage of the
message before, mapped already), after ``WARM_MESSAGES`` (``common.py``) untimed messages of
that size (a fresh link is slow at first). Then the same messages go through the runtime's own
transport (:class:`pipedream.runtime.comm.P2P`: a header and the payload, the receive posted
ahead), and two times are taken:

- the time ``P2P.post_recv`` holds the receiver: it posts the header's and the payload's
  receives (the simulator's ``--recv-overhead``);
- the time ``P2P.send`` holds the sender: the main thread packs the message and hands it to
  gloo, which writes the first megabytes into the socket right there (the simulator's
  ``--send-overhead``).

The two ends then play a 2-stage pipeline: each in turn sleeps ``QUIET_MS`` (its action),
posts the receive of the next message ahead and sends its message, as the runtime does after an
action. The context matters: a post right after a barrier is cheaper than one after the
process slept, so the posts are timed in the pattern the sleep pipelines run. The medians over
repeats (both ends' for the posts) are written to ``OUT.json`` as ``{"one_way_ms": {bytes: ms},
"post_ms": {bytes: ms}, "recv_post_ms": {bytes: ms}, "quiet_ms": QUIET_MS}``.
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
from pipedream.runtime.receive_buffers import ReceiveBuffers

__all__ = ["SIZES", "main"]

SIZES = (32 * 1024, 32 * 1024 * 1024)
"""Message sizes of the sleep benchmark (bytes)."""
REPEATS = 9
POST_REPEATS = 16
"""Exchanges timed per size and rank: single posts vary 2-5x."""
QUIET_MS = 20.0
"""The action before each post: the sleep benchmark's forward (the mlp's take about 10 ms)."""
_BUFFERS = ReceiveBuffers(torch.device("cpu"))
"""Receive buffers as the runtime's transport takes them: storage nobody holds is reused."""


def _one_way_ms(payload: torch.Tensor) -> float:
    """Median time of one message, rank 0 to rank 1 (each measures its own side)."""
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(payload, 1)
        else:
            dist.recv(_BUFFERS.empty_like(payload), 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _post_ms(payload: torch.Tensor, first: int) -> tuple[list[float], list[float]]:
    """Times ``P2P.post_recv`` and ``P2P.send`` held this rank (ms) in the 2-stage exchange,
    messages numbered from ``first``.

    A transport of its own per size: its first message (untimed) defines the channel's
    reference, so the timed ones take the runtime's steady path (header and payload posted
    ahead). Rank 0 sends "act" messages, rank 1 answers each with a "grad"; a last activation,
    untimed, meets the receive rank 1 posted ahead in the last exchange.
    """
    rank = dist.get_rank()
    peer = 1 - rank
    p2p = P2P(rank=rank, device=torch.device("cpu"), timeout=120.0, post_early=True)
    incoming, outgoing = ("grad", "act") if rank == 0 else ("act", "grad")
    receives, sends = [], []
    last = first + POST_REPEATS + 1
    if rank == 1:
        p2p.post_recv("act", first, 0)
    dist.barrier()
    for index in range(first, last):
        if rank == 1:
            p2p.recv("act", index, 0, what="the calibration's activation")
        time.sleep(QUIET_MS / 1000)  # the action
        start = time.perf_counter()
        p2p.post_recv(incoming, index + rank, peer)  # rank 1: the next activation
        posted = time.perf_counter()
        p2p.send(outgoing, index, peer, [payload], version=0)
        if index > first:
            receives.append((posted - start) * 1000)
            sends.append((time.perf_counter() - posted) * 1000)
        if rank == 0:
            p2p.recv("grad", index, 1, what="the calibration's gradient")
    if rank == 0:
        p2p.send("act", last, 1, [payload], version=0)
    else:
        p2p.recv("act", last, 0, what="the calibration's last activation")
    p2p.drain(what="the calibration's sends")
    return receives, sends


def main(argv: list[str]) -> int:
    configure_host_memory()  # the runtime's allocator settings: they change the copy cost
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    one_way, receives, sends = {}, {}, {}  # the posts' times on this rank
    for number, size in enumerate(SIZES):
        payload = torch.zeros(size // 4)
        for _ in range(WARM_MESSAGES):  # a fresh link is slow for its first gigabyte or so
            if rank == 0:
                dist.send(payload, 1)
            else:
                dist.recv(_BUFFERS.empty_like(payload), 0)
        one_way[size] = _one_way_ms(payload)
        receives[size], sends[size] = _post_ms(payload, first=number * (POST_REPEATS + 2))
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, (receives, sends))
    if rank == 1:
        result = {
            "one_way_ms": one_way,
            "post_ms": {n: statistics.median(gathered[0][1][n] + sends[n]) for n in SIZES},
            "recv_post_ms": {n: statistics.median(gathered[0][0][n] + receives[n]) for n in SIZES},
            "quiet_ms": QUIET_MS,
        }
        Path(argv[0]).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
