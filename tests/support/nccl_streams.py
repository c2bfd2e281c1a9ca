"""A model of how NCCL runs a rank's communication on the GPU, to check action tables against.

Nothing here can run NCCL; it replays what the executor issues on NCCL (``runtime/comm.py``)
under NCCL's rules, with the worst case where the rules allow a choice:

- A point-to-point operation runs on its communicator's stream: it starts once the operations
  issued before it on that stream are done, and once the work queued on the rank's compute
  stream when it was issued is done (ProcessGroupNCCL makes its stream wait for the current
  one). That work includes every transfer the compute stream was made to wait for: a received
  payload (its receive action) and a send reclaimed by ``poll`` past the messages in flight
  the posting allows.
- The k-th send from rank a to rank b on a communicator is paired with b's k-th receive from a
  on it, whatever the tags, and a pair completes only once both have started (a send larger
  than NCCL's buffers waits for its receive).
- A replicated stage's allreduce completes once every replica has started it.

The host never waits for the GPU on NCCL (headers travel over gloo, and ``validate_tables``
already checks that the hosts cannot deadlock), so each rank's issue order follows from its
table alone. :func:`run_on_nccl` returns the messages whose payloads went to the wrong receive
and the operations that could never complete. ``pipedream.schedules.host_waits`` sizes the
bound on sends in flight with a model of its own, which must find the same tables stuck.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipedream.schedules import MESSAGE_KIND, MESSAGES_IN_FLIGHT, Action, Op

__all__ = ["NcclOutcome", "run_on_nccl"]

Message = tuple[str, int, int, int]
"""A message: its kind, index, sending stage and receiving stage."""


@dataclass(eq=False)
class _Op:
    rank: int
    stream: tuple
    what: str  # "send", "recv" or "allreduce"
    message: tuple
    """A point-to-point operation's :data:`Message`; an allreduce's stage and update."""
    ends: tuple[int, int] | None
    """A point-to-point operation's sender and receiver ranks."""
    after: int
    """How many of the rank's waited operations the compute stream had queued at issue."""
    previous: _Op | None = None
    waited: list[_Op] = field(default_factory=list)
    """What the rank's compute stream waited for, in order (shared by the rank's operations)."""
    done: bool = False

    def ready(self) -> bool:
        return (self.previous is None or self.previous.done) and all(
            op.done for op in self.waited[: self.after]
        )

    def __str__(self) -> str:
        return f"rank {self.rank} {self.what} {self.message}"


@dataclass(frozen=True)
class NcclOutcome:
    swapped: list[str] = field(default_factory=list)
    """Sends paired with the receive of another message (a silent swap of payloads)."""
    stuck: list[str] = field(default_factory=list)
    """Operations that can never complete (a deadlock on the GPU)."""


def _message(action: Action) -> Message:
    sender = action.stage if action.op.is_send else action.peer_stage
    receiver = action.peer_stage if action.op.is_send else action.stage
    assert sender is not None and receiver is not None
    return (MESSAGE_KIND[action.op], action.index, sender, receiver)


class _Rank:
    """One rank's issue order: its streams and what its compute stream waited for."""

    def __init__(self, rank: int, in_flight: int) -> None:
        self.rank = rank
        self.in_flight = in_flight
        self.ops: list[_Op] = []
        self.waited: list[_Op] = []
        self.last: dict[tuple, _Op] = {}
        self.outgoing: list[_Op] = []  # the payloads of the messages in flight

    def issue(self, stream: tuple, what: str, message: tuple, ends: tuple[int, int] | None) -> _Op:
        op = _Op(self.rank, stream, what, message, ends, len(self.waited), self.last.get(stream))
        op.waited = self.waited
        self.last[stream] = op
        self.ops.append(op)
        return op

    def poll(self) -> None:
        while len(self.outgoing) > self.in_flight:  # its header is waited on the host
            self.waited.append(self.outgoing.pop(0))


def run_on_nccl(
    tables: Mapping[int, Sequence[Action]],
    *,
    stream_per_direction: bool,
    read_ahead: bool,
    messages_in_flight: int = MESSAGES_IN_FLIGHT,
) -> NcclOutcome:
    """Replay ``tables`` as the NCCL transport issues them: payloads on one communicator per
    direction between two ranks (``stream_per_direction``) or one per pair of ranks, received
    in the sender's order (``read_ahead``: reading headers ahead) or in the receiver's table
    order, and sends reclaimed past ``messages_in_flight``."""

    def stream(sender: int, receiver: int) -> tuple:
        if stream_per_direction:
            return ("p2p", sender, receiver)
        return ("p2p", min(sender, receiver), max(sender, receiver))

    sent: dict[tuple[int, int], list[Message]] = {}
    for rank, table in tables.items():
        for action in table:
            if action.op.is_send and action.peer != rank:
                assert action.peer is not None
                sent.setdefault((rank, action.peer), []).append(_message(action))
    ops: list[_Op] = []
    for rank, table in tables.items():
        state = _Rank(rank, messages_in_flight)
        received: dict[Message, _Op] = {}
        taken: Counter[int] = Counter()
        for action in table:
            state.poll()
            peer = action.peer
            if action.op.is_send and peer != rank:
                assert peer is not None
                op = state.issue(stream(rank, peer), "send", _message(action), (rank, peer))
                state.outgoing.append(op)
            elif action.op.is_receive and peer != rank:
                assert peer is not None
                message = _message(action)
                if read_ahead:  # every message the peer sent before this one, in its order
                    while message not in received:
                        earlier = sent[(peer, rank)][taken[peer]]
                        taken[peer] += 1
                        received[earlier] = state.issue(
                            stream(peer, rank), "recv", earlier, (peer, rank)
                        )
                else:
                    received[message] = state.issue(
                        stream(peer, rank), "recv", message, (peer, rank)
                    )
                state.waited.append(received.pop(message))
            elif action.op is Op.ALLREDUCE:
                key = (action.stage, action.index)
                state.waited.append(
                    state.issue(("allreduce", action.stage), "allreduce", key, None)
                )
        ops += state.ops
    return _resolve(ops)


def _resolve(ops: list[_Op]) -> NcclOutcome:
    """Pair the operations as NCCL does, then complete whatever can complete."""
    groups: dict[tuple, list[_Op]] = {}
    ordinal: Counter[tuple] = Counter()
    for op in ops:
        if op.ends is None:  # an allreduce: its replicas' k-th on the stage's communicator
            key: tuple = (op.stream, op.message)
        else:  # the k-th send of a direction on a communicator and the k-th receive
            ordinal[(op.stream, op.ends, op.what)] += 1
            key = (op.stream, op.ends, ordinal[(op.stream, op.ends, op.what)])
        groups.setdefault(key, []).append(op)
    swapped = [
        " paired with ".join(map(str, members))
        for members in groups.values()
        if members[0].ends is not None and len({op.message for op in members}) > 1
    ]
    progress = True
    while progress:
        progress = False
        for members in groups.values():
            if not members[0].done and all(op.ready() for op in members):
                for op in members:
                    op.done = True
                progress = True
    return NcclOutcome(swapped, [str(op) for op in ops if not op.done])
