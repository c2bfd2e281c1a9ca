"""How long messages took, from the post of the send to their arrival: simulated and measured.

``pipedream simulate --trace`` compares each stage's action times with the run's. When the
replay (the plan simulated with the run's own action times) still misses, the network model
is the suspect, and the action times do not show it: a message that takes longer than modelled
shows up only as a longer wait in its receiver. This module gives both sides one measure, per
link of the pipeline (a stage to the next with activations, back with gradients): the median
time from the start of the send's post to the message's arrival.

A run's trace has no arrival times. It has the receive action, which starts when the receiver
reaches it and ends once the message is there: when the receiver waited, the end is the
arrival; when the message was already there, the end says only that it arrived earlier. So
both sides count only the messages whose receiver waited more than :data:`WAITED_MS` (the
simulation knows every arrival, but counting all of them would compare two different sets),
and say how many there were. The simulated and the measured message then share a definition:
from the start of the sender's post to the end of the receiver's wait. The two ends are read
on two ranks' clocks: one clock on one node, but between nodes their offset (what NTP leaves,
often a millisecond or more) adds to every measured message.

Pure Python: no torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from pipedream.schedules import Op

__all__ = ["WAITED_MS", "LinkTimes", "MessageTime", "link_times", "message_kind"]

WAITED_MS = 0.5
"""A receive that lasted longer than this waited for its message (a receive whose message was
there already takes far less in the runtime: decoding the header, taking the buffers)."""


def message_kind(op: Op) -> str:
    """What a send or receive action carries: ``activations``, ``gradients``, ``tied
    gradients`` (a copy's to its owner) or ``tied weights`` (a new version to the copies)."""
    assert op.is_comm, op
    if op in (Op.SEND_ACT, Op.RECV_ACT):
        return "activations"
    if op in (Op.SEND_GRAD, Op.RECV_GRAD):
        return "gradients"
    return "tied gradients" if op in (Op.SEND_TIED_GRAD, Op.RECV_TIED_GRAD) else "tied weights"


@dataclass(frozen=True)
class MessageTime:
    """One message between two stages, in milliseconds on one clock."""

    source: int
    """Sending stage."""
    destination: int
    """Receiving stage."""
    kind: str
    """``activations`` (to a later stage), ``gradients`` (back to an earlier one), or a tied
    parameter's ``tied gradients`` / ``tied weights`` (:func:`message_kind`)."""
    sent_ms: float
    """When the sender started posting it."""
    reached_ms: float
    """When the receiver reached its receive."""
    received_ms: float
    """When the receive ended: the arrival, if the receiver waited."""

    @property
    def waited(self) -> bool:
        """Whether the receiver waited for it (its arrival is then known)."""
        return self.received_ms - self.reached_ms > WAITED_MS


@dataclass(frozen=True)
class LinkTimes:
    """The messages one link carried whose receivers waited."""

    source: int
    destination: int
    kind: str
    median_ms: float
    """Median time from the post of the send to the arrival."""
    count: int
    """Messages counted (those whose receiver waited)."""


def link_times(messages: Iterable[MessageTime], start_ms: float, end_ms: float) -> list[LinkTimes]:
    """Per link, in pipeline order, the median time of the messages sent and received within
    ``[start_ms, end_ms]`` whose receiver waited (links without one are left out).

    >>> times = [MessageTime(0, 1, "activations", s, s + 3.0, s + d) for s, d in
    ...          [(0.0, 5.0), (10.0, 7.0), (20.0, 3.2), (30.0, 9.0)]]
    >>> link_times(times, 0.0, 30.0)  # the third did not wait, the fourth ended after 30
    [LinkTimes(source=0, destination=1, kind='activations', median_ms=6.0, count=2)]
    """
    found: dict[tuple[int, int, str], list[float]] = {}
    for message in messages:
        if not (start_ms <= message.sent_ms and message.received_ms <= end_ms):
            continue
        if message.waited:
            key = (message.source, message.destination, message.kind)
            found.setdefault(key, []).append(message.received_ms - message.sent_ms)
    order = sorted(found, key=lambda key: (key[2] != "activations", key[0], key[1]))
    return [LinkTimes(*key, statistics.median(found[key]), len(found[key])) for key in order]
