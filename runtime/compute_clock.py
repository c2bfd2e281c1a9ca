"""How long a rank computes: host clocks on the CPU, CUDA events on a GPU.

On a GPU the host only queues the work of an action and goes on, so the host time around an
action measures the queueing, not the compute. :class:`ComputeClock` then records a CUDA event
before and after each action on the current stream and sums their elapsed times, reading each
pair only once the GPU has passed it (``Event.query``: no wait), and the rest at the end. A pair
once read is recorded again for a later action: an action costs two event records, not two
events made and destroyed (host work that a launch-bound GPU step waits for).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

__all__ = ["ComputeClock"]


class ComputeClock:
    """Sums the time between each :meth:`start` and the following :meth:`stop`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._started: Any = None
        self._pairs: deque[tuple[Any, Any]] = deque()
        self._free: list[Any] = []
        """CUDA events read and free to record again."""

    def _event(self) -> Any:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def _read(self, first: Any, last: Any) -> None:
        self._seconds += first.elapsed_time(last) / 1000.0
        self._free += (first, last)

    def start(self) -> None:
        if self.cuda:
            self._started = self._event()
            self._started.record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        assert self._started is not None, "stop() without start()"
        if self.cuda:
            end = self._event()
            end.record()
            self._pairs.append((self._started, end))
            while self._pairs and self._pairs[0][1].query():  # done: read without waiting
                self._read(*self._pairs.popleft())
        else:
            self._seconds += time.perf_counter() - self._started
        self._started = None

    @property
    def seconds(self) -> float:
        """The total so far (on a GPU this waits for the actions still queued)."""
        while self._pairs:
            first, last = self._pairs.popleft()
            last.synchronize()
            self._read(first, last)
        return self._seconds
