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
action the executor waits for its oldest sends until at most :data:`MAX_SENDS_IN_FLIGHT`
message parts (a message's header and each of its tensors) are left unwaited
(:meth:`pipedream.runtime.comm.P2P.poll`; gloo reports a send complete only once waited on). A
rank whose messages move slower than it computes therefore stops there until the oldest has
left, which the simulator models as well.
Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedream.schedules.actions import Action

__all__ = ["MAX_SENDS_IN_FLIGHT", "RECEIVE_WINDOW", "receives_posted_before"]

RECEIVE_WINDOW = 32
"""Actions ahead of the current one within which the executor has posted every receive."""

MAX_SENDS_IN_FLIGHT = 16
"""Message parts (headers and tensors) sent but not yet waited on when an action starts, at
most."""


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
