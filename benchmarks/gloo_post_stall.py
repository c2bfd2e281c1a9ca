"""What posting a gloo receive costs while a large message arrives on the same pair.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gloo_post_stall.py

The runtime posts its receives ahead (:meth:`pipedream.runtime.comm.P2P.post_recv`, at the top
of every action of the executor) so that messages can land while the stage computes. On gloo,
posting a receive (``dist.irecv``) can wait while a message streams in over the same pair of
processes (the pair's transport thread is reading it). Rank 0 sends rank 1 a 32 MiB message;
rank 1, 2 ms after the message started, posts a one-element receive from rank 0 and times the
call; once the large message is in, it times the same call again on the now idle pair. The
medians and maxima are printed (no results file).

Run it with and without the runtime's host memory settings (``PIPEDREAM_KEEP_HOST_MEMORY=0``
turns them off): without them the receive buffer faults in page by page while it is read, and
a receive posted meanwhile can wait for about the whole message. The simulator charges every
posting the same ``--recv-overhead`` (``gloo_p2p.py`` measures it on a pair at rest);
``pipedream simulate --trace`` shows what postings cost a run, as each stage's share of time
spent posting receives between actions, beside the simulated share.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from common import WARM_MESSAGES

from pipedream.host_memory import configure_host_memory

__all__ = ["SIZE", "main"]

SIZE = 32 * 1024 * 1024
"""Bytes of the large message."""
REPEATS = 12
STREAMING_S = 0.002
"""How long after posting the large message's receive rank 1 posts the small one."""


def _trial(index: int, payload: torch.Tensor) -> tuple[float, float] | None:
    """Rank 1's two post times (ms): during the large message, then on the idle pair."""
    busy_tag, idle_tag, last_tag = 3 * index + 1, 3 * index + 2, 3 * index + 3
    if dist.get_rank() == 0:
        dist.send(payload, 1, tag=busy_tag)
        dist.send(torch.zeros(1), 1, tag=idle_tag)
        dist.send(torch.zeros(1), 1, tag=last_tag)
        return None
    large = dist.irecv(torch.empty_like(payload), 0, tag=busy_tag)
    time.sleep(STREAMING_S)
    start = time.perf_counter()
    during = dist.irecv(torch.empty(1), 0, tag=idle_tag)
    busy = time.perf_counter() - start
    large.wait()
    during.wait()
    start = time.perf_counter()
    after = dist.irecv(torch.empty(1), 0, tag=last_tag)
    idle = time.perf_counter() - start
    after.wait()
    return busy * 1000, idle * 1000


def main() -> int:
    configure_host_memory()  # the runtime's allocator settings
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("gloo_post_stall.py needs exactly 2 processes (--nproc-per-node 2)")
    payload = torch.zeros(SIZE // 4)
    for _ in range(WARM_MESSAGES):  # a fresh link is slow at first
        if dist.get_rank() == 0:
            dist.send(payload, 1)
        else:
            dist.recv(torch.empty_like(payload), 0)
    dist.barrier()
    times = [_trial(index, payload) for index in range(REPEATS)]
    if dist.get_rank() == 1:
        busy = [t[0] for t in times if t is not None]
        idle = [t[1] for t in times if t is not None]
        print(
            f"posting a receive while {SIZE >> 20} MiB arrive on the same pair: median "
            f"{statistics.median(busy):.2f} ms (max {max(busy):.2f}); on the idle pair: median "
            f"{statistics.median(idle):.3f} ms (max {max(idle):.3f})"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
