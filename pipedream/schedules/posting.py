"""Which receives the executor posts ahead, and before which action, and how many of its sends
it leaves in flight: one rule for the runtime and the simulator.

On gloo a message is read only once its receive is posted, so the executor posts receives
before it reaches them (:meth:`pipedream.runtime.comm.P2P.post_recv`): a message that arrives
while the rank computes is then read in the background instead of after the compute. Before
it runs the action at position ``p`` of its table, the executor posts every receive at a
position below ``p + window`` that it has not posted yet. Posting costs the rank's main thread
time (more while a large message streams in on the same pair, whose transport thread is busy
reading it), which the simulator charges where the runtime spends it.

Sends are not waited on when they are posted, but their buffers must be reclaimed: before each
action the executor waits for its oldest sent messages (each whole: its header and every
tensor) until at most ``messages_in_flight`` are left unwaited
(:meth:`pipedream.runtime.comm.P2P.poll`; gloo reports a send complete only once waited on). A
rank whose messages move slower than it computes therefore stops there until the oldest has
left, which the simulator models as well. The bound counts messages, not tensors, so how many
tensors a stage boundary carries does not change when a rank waits.

The two numbers are a :class:`Posting`. The defaults suit every built-in schedule; a plan whose
ranks exchange many messages per microbatch (dense skip connections) may need more messages in
flight, which :func:`~pipedream.schedules.host_waits.posting_for` finds from the tables.
Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipedream.schedules.actions import Action

__all__ = ["MESSAGES_IN_FLIGHT", "RECEIVE_WINDOW", "Posting", "receives_posted_before"]

RECEIVE_WINDOW = 32
"""Actions ahead of the current one within which the executor has posted every receive
(the default)."""

MESSAGES_IN_FLIGHT = 8
"""Messages sent but not yet waited on when an action starts, at most (the default)."""


@dataclass(frozen=True)
class Posting:
    """How far ahead the executor posts receives, and how many sends it leaves in flight."""

    window: int = RECEIVE_WINDOW
    """Actions ahead of the current one within which every receive is posted."""
    messages_in_flight: int = MESSAGES_IN_FLIGHT
    """Messages sent and not yet waited on when an action starts, at most."""

    def __post_init__(self) -> None:
        assert self.window >= 1 and self.messages_in_flight >= 0, self


def receives_posted_before(
    table: Sequence[Action], window: int = RECEIVE_WINDOW
) -> list[tuple[int, ...]]:
    """For each position of ``table``, the positions of the receives posted right before the
    action there runs (each receive once, in table order).

    >>> from pipedream.schedules.actions import parse_action
    >>> table = [parse_action(t) for t in ("1RF0", "1F0", "1RF1", "1F1", "1RB0", "1B0")]
    >>> receives_posted_before(table, window=2)
    [(0,), (2,), (), (4,), (), ()]
    >>> receives_posted_before(table, window=4)
    [(0, 2), (4,), (), (), (), ()]
    """
    assert window >= 1, window
    receives = [position for position, action in enumerate(table) if action.op.is_receive]
    posted, out = 0, []
    for position in range(len(table)):
        start = posted
        while posted < len(receives) and receives[posted] < position + window:
            posted += 1
        out.append(tuple(receives[start:posted]))
    return out
