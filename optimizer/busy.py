"""Busy times of shared resources, and the earliest window in which several are all free.

The simulator's messages with network interfaces (:class:`~pipedream.optimizer.simulator.Network`
``interface``) each need three resources at once for their transfer: the link between the two
ranks, the sender's interface to send and the receiver's interface to receive. A message takes
the earliest window in which all three are free, so one that waits for a busy interface holds
nothing meanwhile, and later messages use the time it leaves (a network interface serves
whichever message is ready, not the one posted first). Pure Python.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence

__all__ = ["BusyTimes"]


class BusyTimes:
    """The booked intervals ``[start, end)`` of each resource, in time order."""

    def __init__(self) -> None:
        self._busy: dict[Hashable, list[tuple[float, float]]] = {}

    def earliest(self, keys: Sequence[Hashable], after: float, duration: float) -> float:
        """The earliest start at or after ``after`` of a window of ``duration`` in which every
        resource of ``keys`` is free."""
        start = after
        moved = True
        while moved:
            moved = False
            for key in keys:
                for begin, end in self._busy.get(key, ()):
                    if begin >= start + duration:
                        break  # this and every later interval begin after the window
                    if start < end and begin < end:  # it overlaps the window: start after it
                        start, moved = end, True
        return start

    def book(self, keys: Sequence[Hashable], start: float, end: float) -> None:
        """Mark every resource of ``keys`` busy from ``start`` to ``end``."""
        for key in keys:
            bisect.insort(self._busy.setdefault(key, []), (start, end))

    def forget_before(self, keys: Sequence[Hashable], time: float) -> None:
        """Drop the intervals of ``keys`` that end by ``time`` (no later window reaches back)."""
        for key in keys:
            busy = self._busy.get(key)
            if busy:
                done = 0
                while done < len(busy) and busy[done][1] <= time:
                    done += 1
                del busy[:done]
