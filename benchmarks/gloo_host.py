"""How much a host moves when several gloo messages are in flight at once (its copy capacity).

Launched with torchrun by ``sleep_pipeline.py`` right before and right after each of its
32 MiB cases, with as many processes as the case has stages::

    python -m torch.distributed.run --standalone --nproc-per-node S benchmarks/gloo_host.py OUT.json

Loopback messages are copied by the CPUs of both ends, so on a small host concurrent transfers
slow each other down, and more so the more processes share its cores and cache. The S
processes send 32 MiB messages in the patterns of :func:`cases`: one alone (0 -> 1), one each
way between two ranks, one on each of S / 2 disjoint pairs, and one on each link of the chain
0 -> 1 -> ... -> S - 1 (a pipeline's forward messages), all started together after a barrier,
after ``WARM_MESSAGES`` (``common.py``) untimed messages on every link of the chain (fresh links
are slow). Messages land in buffers of the runtime's pool
(:class:`pipedream.runtime.receive_buffers.ReceiveBuffers`: memory already mapped). The time
until the last one arrived, median over repeats, is written to ``OUT.json`` with the host's
capacity in bytes/s: the mean of ``messages x bytes / time`` over the patterns whose messages take
different links (what ``pipedream simulate --host-bandwidth`` takes; ``null`` for 2
processes). "both ways" gives a link's duplex factor, 2 x "one" / "both
ways" (``pipedream simulate --duplex``): on loopback it lies between 1 (one message at a time)
and 2 (the two directions independent).
"one after quiet" is what a pipeline of sleep layers sees (``simulator_accuracy.py`` takes it
as the sleep cases' message time): ranks 0 and 1 play ping-pong, each end waiting
``QUIET_MS`` before it sends the message back, and a message's time is half of a round trip
less the wait (:func:`_after_quiet`). A large loopback message can take markedly longer after
tens of milliseconds of quiet on its link than right after other traffic (not TCP's slow start
after idle: ``net.ipv4.tcp_slow_start_after_idle`` does not change it), and a pipeline of sleep
layers sends after such quiet. "one" comes right after a barrier, and with 4 or 8 processes
also carries the barrier's skew.
Every timed repeat of every pattern is written too (``each_ms``): how much one message's time
varies from one to the next on the host (``simulator_accuracy.py`` gives those ratios to
``pipedream simulate --message-spread``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import WARM_MESSAGES

from pipedream.host_memory import configure_host_memory
from pipedream.runtime.receive_buffers import ReceiveBuffers

__all__ = ["SIZE", "capacity", "cases", "main"]

SIZE = 32 * 1024 * 1024
"""Bytes per message."""
REPEATS = 9
QUIET_MS = 40.0
"""How long each end of "one after quiet" holds a message before it sends one back (the sleep
benchmark's backward, long enough for the link to count as quiet)."""
_BUFFERS = ReceiveBuffers(torch.device("cpu"))
"""Receive buffers as the runtime's transport takes them: storage nobody holds is reused."""


def cases(world_size: int) -> dict[str, list[tuple[int, int]]]:
    """The (source, destination) messages of each timed pattern among ``world_size`` ranks.

    >>> cases(4)["chain of 3"]
    [(0, 1), (1, 2), (2, 3)]
    """
    if world_size < 2:
        raise ValueError(f"gloo_host.py needs at least 2 processes, got {world_size}")
    found = {"one": [(0, 1)], "both ways": [(0, 1), (1, 0)]}
    if world_size >= 4:
        found[f"{world_size // 2} pairs"] = [(r, r + 1) for r in range(0, world_size - 1, 2)]
    if world_size >= 3:
        found[f"chain of {world_size - 1}"] = [(r, r + 1) for r in range(world_size - 1)]
    return found


def capacity(times: dict[str, float], world_size: int) -> float | None:
    """The host's copy capacity in bytes/s from each pattern's time (ms): the mean of
    ``messages x bytes / time`` over the patterns of :func:`cases` whose messages take different
    links, of those timed; None where there are none (2 processes).

    >>> capacity({"one": 10.0, "both ways": 20.0, "chain of 2": 32.0}, 3) / 2**20
    2000.0
    """
    concurrent = [
        len(pairs) * SIZE / (times[name] / 1000)
        for name, pairs in cases(world_size).items()
        if name not in ("one", "both ways") and name in times
    ]
    return statistics.mean(concurrent) if concurrent else None


def _trial(pairs: list[tuple[int, int]], payload: torch.Tensor) -> float:
    """Milliseconds from a barrier until the last of ``pairs``' messages arrived."""
    rank = dist.get_rank()
    dist.barrier()
    start = time.perf_counter()
    works = []
    for src, dst in pairs:
        if rank == src:
            works.append(dist.isend(payload, dst))
        if rank == dst:
            works.append(dist.irecv(_BUFFERS.empty_like(payload), src))
    for work in works:
        work.wait()
    elapsed = (time.perf_counter() - start) * 1000
    everyone: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(everyone, elapsed)
    return max(everyone)


def _after_quiet(payload: torch.Tensor, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` messages after ``QUIET_MS`` of quiet on its link
    (rank 0's; the others get an empty list).

    Rank 0 waits ``QUIET_MS`` and sends; rank 1 holds the message ``QUIET_MS`` and sends it
    back. Rank 0 times the round trip on its own clock and rank 1 its hold, so the two clocks
    are never compared. Ranks 2 and up only join the barrier and the gather.
    """
    rank = dist.get_rank()
    dist.barrier()
    round_trips, holds = [], []
    for _ in range(repeats + 1):  # the first round trip follows the barrier: not timed
        if rank == 0:
            time.sleep(QUIET_MS / 1000)
            start = time.perf_counter()
            sent = dist.isend(payload, 1)
            dist.irecv(_BUFFERS.empty_like(payload), 1).wait()
            round_trips.append(time.perf_counter() - start)
            sent.wait()
        elif rank == 1:
            dist.irecv(_BUFFERS.empty_like(payload), 0).wait()
            arrived = time.perf_counter()
            time.sleep(QUIET_MS / 1000)
            holds.append(time.perf_counter() - arrived)
            dist.isend(payload, 0).wait()
    everyone: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, holds)
    if rank != 0:
        return []
    return [(trip - hold) / 2 * 1000 for trip, hold in zip(round_trips[1:], everyone[1][1:])]


def main(argv: list[str]) -> int:
    configure_host_memory()  # the runtime's allocator settings: they change the copy cost
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    payload = torch.zeros(SIZE // 4)
    patterns = cases(dist.get_world_size())
    chain = [(r, r + 1) for r in range(dist.get_world_size() - 1)]
    for _ in range(WARM_MESSAGES):  # every link, as a pipeline's links after its warm-up
        _trial(chain, payload)
        _trial([(dst, src) for src, dst in chain], payload)
    each = {
        name: [_trial(pairs, payload) for _ in range(REPEATS)] for name, pairs in patterns.items()
    }
    times = {name: statistics.median(trials) for name, trials in each.items()}
    host_capacity = capacity(times, dist.get_world_size())
    each["one after quiet"] = _after_quiet(payload, REPEATS)
    if dist.get_rank() == 0:
        times["one after quiet"] = statistics.median(each["one after quiet"])
        result = {
            "bytes": SIZE,
            "processes": dist.get_world_size(),
            "ms": times,
            "capacity_bytes_per_s": host_capacity,
            "each_ms": each,
        }
        Path(argv[0]).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
