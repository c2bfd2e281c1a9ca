"""Transfers that share a host's copy capacity: a fluid model for the simulator.

By default the simulator gives every pair of ranks a link of its own. On one host that is not
what happens: a message over loopback TCP (gloo on CPUs) is copied by the CPUs of both ends, so
concurrent transfers slow each other down: two transfers on different pairs take longer than
one alone, though less than twice as long, so the host moves more than one link's bandwidth
in total but less than one per link (``benchmarks/gloo_host.py`` measures a host's capacity).
The same shape holds for the ranks of a server sharing one network card.

:class:`TransferPool` models that as processor sharing: every active transfer moves at
``min(link bandwidth, capacity / n)``, ``n`` the active transfers charged to the same unit
(each transfer is charged to the units of both its ends). Rates change whenever a transfer
starts or ends, so the pool reports the time of its next completion and the simulator asks
again after each event. Allreduces are not charged to the pool (the simulator models them on
their own). Pure Python.

Without a duplex factor, a link carries one transfer at a time, first come first served, in
either direction. With one (``duplex``), a link carries one transfer at a time *per
direction*, and the two directions move at once, sharing ``duplex`` x the link's bandwidth
(1: the directions share the link, 2: full duplex, each direction at its full speed). Two
large gloo messages sent each way at once between two processes take longer to both arrive
than one alone, but less than twice as long: loopback is neither one message at a time nor
full duplex, and the factor is ``2 x one / both ways`` (``gloo_host.py`` measures it). It
matters for the first of two overlapping messages: first come first served lets it finish at
its full speed, while in a run an activation sent while a gradient is on its way arrives
later than it would alone.

With a per-rank factor (``per_rank``), the transfers touching one rank (sent or received) also
share ``per_rank`` x their link's bandwidth: a rank's transport moves that much in all. Gloo
has one transport thread per process, which reads every incoming message and writes every
outgoing one, so two links that share a rank each move about half as much as one alone: about
one link's worth per rank (``per_rank`` = 1).

With an interface per rank and level (``interface``), a rank's network interface moves a
link's bandwidth each way: the transfers a rank sends over the links of one level share it,
and so do those it receives. A worker receiving activations from several replicas of the
stage before it takes them in no faster than its interface allows, however many links lead to
it (another level's links go through another interface).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Transfer", "TransferPool"]

_DONE_BYTES = 1e-6
"""Bytes left below which a transfer counts as finished (floating-point slack)."""


@dataclass
class Transfer:
    """One message on its way."""

    key: Any
    """What the simulator needs back when it arrives."""
    link: tuple[int, int]
    """The pair of ranks (smaller first)."""
    units: tuple[int, ...]
    """The units whose capacity it shares."""
    remaining: float
    """Bytes still to move."""
    link_rate: float
    """Bytes per ms of the link alone."""
    source: int | None = None
    """The sending rank (its direction on the link; None: one of the link's ends, which a
    pool with a duplex factor or interfaces does not take)."""
    rate: float = field(default=0.0)
    """Bytes per ms now."""
    level: int = 0
    """The level of its link (whose interfaces it goes through)."""
    ways: tuple[tuple[int, int, bool], ...] = field(default=())
    """The interfaces it goes through, ``(rank, level, sending)``: filled by a pool with
    interfaces."""


class TransferPool:
    """Active and queued transfers under a per-unit capacity (bytes per ms) and, optionally, a
    duplex factor (what a link's two directions move together), a per-rank factor (what one
    rank moves in all), in multiples of the link's bandwidth, and an interface per rank and
    level (module docstring)."""

    def __init__(
        self,
        capacity_per_ms: float,
        duplex: float | None = None,
        per_rank: float | None = None,
        interface: bool = False,
    ) -> None:
        assert capacity_per_ms > 0, capacity_per_ms
        assert duplex is None or 1 <= duplex <= 2, duplex
        assert per_rank is None or per_rank > 0, per_rank
        self.capacity = capacity_per_ms
        self.duplex = duplex
        self.per_rank = per_rank
        self.interface = interface
        self.now = 0.0
        self.active: list[Transfer] = []
        self.queued: dict[tuple[Any, ...], deque[Transfer]] = {}

    def _lane(self, transfer: Transfer) -> tuple[Any, ...]:
        """What carries one transfer at a time: the link, or one direction of it."""
        if self.duplex is None:
            return transfer.link
        return (*transfer.link, transfer.source)

    def _advance(self, now: float) -> None:
        assert now >= self.now - 1e-9, (now, self.now)
        elapsed = max(0.0, now - self.now)
        for transfer in self.active:
            transfer.remaining -= transfer.rate * elapsed
        self.now = max(self.now, now)

    def _rerate(self) -> None:
        """Every active transfer's rate: its link's, or less where a limit is shared (only the
        limits the pool has are counted)."""
        bounded = math.isfinite(self.capacity)
        load: dict[int, int] = {}
        on_link: dict[tuple[int, int], int] = {}
        on_rank: dict[int, int] = {}
        each_way: dict[tuple[int, int, bool], int] = {}  # (rank, level, sending)
        for transfer in self.active:
            if bounded:
                for unit in transfer.units:
                    load[unit] = load.get(unit, 0) + 1
            if self.duplex is not None:
                on_link[transfer.link] = on_link.get(transfer.link, 0) + 1
            if self.per_rank is not None:
                for rank in transfer.link:
                    on_rank[rank] = on_rank.get(rank, 0) + 1
            if self.interface:
                for way in transfer.ways:
                    each_way[way] = each_way.get(way, 0) + 1
        for transfer in self.active:
            rate = transfer.link_rate
            if bounded:
                rate = min(rate, min(self.capacity / load[unit] for unit in transfer.units))
            if self.duplex is not None:
                rate = min(rate, self.duplex * transfer.link_rate / on_link[transfer.link])
            if self.per_rank is not None:
                busiest = max(on_rank[rank] for rank in transfer.link)
                rate = min(rate, self.per_rank * transfer.link_rate / busiest)
            if self.interface:
                busiest = max(each_way[way] for way in transfer.ways)
                rate = min(rate, transfer.link_rate / busiest)
            transfer.rate = rate

    def start(self, now: float, transfer: Transfer) -> None:
        """Post ``transfer`` at ``now``; it waits while its link (or direction) is busy."""
        self._advance(now)
        assert self.duplex is None or transfer.source in transfer.link, transfer
        self._admit(transfer)
        lane = self._lane(transfer)
        if any(self._lane(t) == lane for t in self.active):
            self.queued.setdefault(lane, deque()).append(transfer)
            return
        self.active.append(transfer)
        self._rerate()

    def _admit(self, transfer: Transfer) -> None:
        """Note the interfaces a transfer goes through (once, when it is posted): its
        sender's outgoing one and its receiver's incoming one, at its link's level."""
        if self.interface:
            assert transfer.source in transfer.link, "an interface needs the sending rank"
            low, high = transfer.link
            target = high if transfer.source == low else low
            transfer.ways = (
                (transfer.source, transfer.level, True),
                (target, transfer.level, False),
            )

    def next_completion(self) -> float | None:
        """When the first active transfer ends at the current rates (None: nothing moves)."""
        if not self.active:
            return None
        return self.now + min(max(0.0, t.remaining) / t.rate for t in self.active)

    def complete(self, now: float) -> list[Transfer]:
        """Advance to ``now``; the transfers that ended (their links start the next)."""
        self._advance(now)
        done = [t for t in self.active if t.remaining <= _DONE_BYTES * max(1.0, t.link_rate)]
        if not done:
            return []
        finished = {id(t) for t in done}
        self.active = [t for t in self.active if id(t) not in finished]
        for transfer in done:
            waiting = self.queued.get(self._lane(transfer))
            if waiting:
                self.active.append(waiting.popleft())
        self._rerate()
        return done
