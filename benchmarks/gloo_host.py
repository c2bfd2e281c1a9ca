"""How much a host moves when several gloo messages are in flight at once (its copy capacity).

Launched with torchrun by ``sleep_pipeline.py`` (three times, right before its 32 MiB cases)::

    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/gloo_host.py OUT.json

Loopback messages are copied by the CPUs of both ends, so on a small host concurrent transfers
slow each other down. Four processes send 32 MiB messages: one alone (0 -> 1), two on disjoint
pairs (0 -> 1, 2 -> 3) and three along a chain (0 -> 1 -> 2 -> 3), all started together after a
barrier, after ``WARM_MESSAGES`` (``common.py``) untimed messages on every link (fresh links
are slow); the time until the last one arrived, median over repeats, is written to ``OUT.json``
with the host's capacity in bytes/s: the mean over the concurrent cases of
``messages x bytes / time`` (what ``pipedream simulate --host-bandwidth`` takes).
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

__all__ = ["CASES", "SIZE", "main"]

SIZE = 32 * 1024 * 1024
"""Bytes per message."""
CASES = {
    "one": [(0, 1)],
    "two pairs": [(0, 1), (2, 3)],
    "chain of three": [(0, 1), (1, 2), (2, 3)],
}
REPEATS = 9


def _trial(pairs: list[tuple[int, int]], payload: torch.Tensor) -> float:
    rank = dist.get_rank()
    dist.barrier()
    start = time.perf_counter()
    works = []
    for src, dst in pairs:
        if rank == src:
            works.append(dist.isend(payload, dst))
        if rank == dst:
            works.append(dist.irecv(torch.empty_like(payload), src))  # fresh, as the runtime
    for work in works:
        work.wait()
    elapsed = (time.perf_counter() - start) * 1000
    everyone: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(everyone, elapsed)
    return max(everyone)


def main(argv: list[str]) -> int:
    configure_host_memory()  # the runtime's allocator settings: they change the copy cost
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    payload = torch.zeros(SIZE // 4)
    for _ in range(WARM_MESSAGES):  # every link of the chain, as a pipeline's links after warm-up
        _trial(CASES["chain of three"], payload)
    times = {
        name: statistics.median(_trial(pairs, payload) for _ in range(REPEATS))
        for name, pairs in CASES.items()
    }
    concurrent = [len(CASES[name]) * SIZE / (times[name] / 1000) for name in CASES if name != "one"]
    if dist.get_rank() == 0:
        result = {"bytes": SIZE, "ms": times, "capacity_bytes_per_s": statistics.mean(concurrent)}
        Path(argv[0]).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
