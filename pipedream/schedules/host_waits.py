"""Where ranks wait for their own sends, and how many sends a :class:`Posting` must leave in
flight so that none waits forever.

:func:`~pipedream.schedules.validate.simulate_dependencies` runs tables as if sends never
waited. The runtime's do, in one place: before each action the executor waits for its oldest
sent messages beyond ``messages_in_flight`` (:mod:`~pipedream.schedules.posting`), and a send
is done only once its peer has issued the matching receive. A rank that runs far ahead thus
waits for a peer to get far enough to receive its oldest message, and that peer may be waiting
for the rank's next message, which it has not sent: a cycle no dependency between actions
shows. It takes many messages between the receives (dense skip connections, each rank talking
to many), and a larger bound breaks it.

The model, per transport, in the worst case the transport allows:

- gloo: a send completes against a posted receive. The header's receive is posted ahead, and
  the payload's too when its tensors have the shapes of the channel's first message, which
  depends on the workload. The worst case is assumed: every payload receive posted by its
  receive action, so a send is done once its receiver has started that action.
- NCCL (``in_order``, ``runtime/comm.py``): a payload's receive is issued when its header is
  read, and headers are read in the order they were sent: a send is done once its receiver
  has started the receive of that message or of a later one from the same sender (a receiver
  waiting for a later message reads every header sent before it). There the wait is the
  GPU's, not the host's: reclaiming a send makes the rank's stream wait for it, and the NCCL
  send completes only once its receive runs, which in turn waits for the receiver's stream to
  get there. The cycle is the same, closed on the GPUs instead of the hosts. (The tests'
  ``PIPEDREAM_IN_ORDER_P2P=1`` runs this discipline over gloo, where these waits do hold the
  host.)

How far ahead receives are posted changes neither worst case, so only the bound on messages in
flight matters here. A send done sooner never makes a rank wait longer, so tables that finish
here finish in the runtime. Pure Python: no torch.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import replace

from pipedream.schedules.actions import MESSAGE_KIND, Action, Op
from pipedream.schedules.posting import Posting
from pipedream.schedules.validate import Message, message_of

__all__ = ["host_stall", "posting_for"]

MAX_DOUBLINGS = 16
"""Doublings of the default bound :func:`posting_for` tries before it gives up."""


def host_stall(
    tables: Mapping[int, Sequence[Action]], posting: Posting, *, in_order: bool
) -> str | None:
    """Run ``tables`` with the executor's waits for its sends under ``posting``: None if every
    rank reaches the end of its table, else where the ranks stop and what each waits for."""
    return _Run(tables, posting.messages_in_flight, in_order=in_order).run()


def posting_for(
    tables: Mapping[int, Sequence[Action]], *, in_order: bool, start: Posting | None = None
) -> Posting:
    """``start`` (default: :class:`Posting`'s defaults) if no rank waits forever under it, else
    the first doubling of its ``messages_in_flight`` under which none does.

    Tables that pass :func:`~pipedream.schedules.validate.simulate_dependencies` always find
    one: once a table's sends all stay in flight, nothing waits for them."""
    posting = start or Posting()
    for _ in range(MAX_DOUBLINGS):
        if host_stall(tables, posting, in_order=in_order) is None:
            return posting
        posting = replace(posting, messages_in_flight=max(1, posting.messages_in_flight * 2))
    stall = host_stall(tables, posting, in_order=in_order)
    assert stall is None, f"no posting up to {posting} runs these tables: {stall}"
    return posting


class _Run:
    """Every rank running its table, until all are done or none can go on."""

    def __init__(
        self, tables: Mapping[int, Sequence[Action]], in_flight: int, *, in_order: bool
    ) -> None:
        self.tables, self.in_flight, self.in_order = tables, in_flight, in_order
        self.position = dict.fromkeys(tables, 0)
        """Actions each rank has finished."""
        self.started = dict.fromkeys(tables, 0)
        """Actions each rank has started (past the wait for its sends)."""
        self.unwaited: dict[int, deque[Message]] = {rank: deque() for rank in tables}
        self.receive_at: dict[Message, tuple[int, int]] = {}
        """Each message's receiver and the position of its receive there."""
        self.number: dict[Message, int] = {}
        """Each message's place among those its sender sends to its receiver."""
        self.sent_on: Counter[tuple[int, int]] = Counter()
        """Messages sent so far, per (sender, receiver): a message is sent once its number is
        below its route's count (each route's messages are sent in their numbers' order)."""
        self.read: Counter[tuple[int, int]] = Counter()
        """NCCL: headers read, per (sender, receiver)."""
        sends: Counter[tuple[int, int]] = Counter()
        for rank, table in tables.items():
            for position, action in enumerate(table):
                if action.peer == rank or not action.op.is_comm:
                    continue
                message = message_of(rank, action)
                if action.op.is_receive:
                    self.receive_at[message] = (rank, position)
                else:
                    self.number[message] = sends[_route(message)]
                    sends[_route(message)] += 1
        self.replicas: dict[int, set[int]] = {}
        for rank, table in tables.items():
            for action in table:
                self.replicas.setdefault(action.stage, set()).add(rank)
        self.arrived: dict[tuple[int, int], set[int]] = {}

    def run(self) -> str | None:
        progress = True
        while progress:
            progress = False
            for rank in self.tables:
                while self._step(rank):
                    progress = True
        stuck = {r: p for r, p in self.position.items() if p < len(self.tables[r])}
        if stuck:
            return "; ".join(self._waits(rank, position) for rank, position in stuck.items())
        for rank, unwaited in self.unwaited.items():  # the drain at the end
            for message in unwaited:
                assert self._done(message), f"rank {rank}: {message} never received"
        return None

    def _step(self, rank: int) -> bool:
        """Run ``rank``'s next action if it can; whether it did."""
        table, position = self.tables[rank], self.position[rank]
        if position >= len(table):
            return False
        if self.started[rank] <= position:
            unwaited = self.unwaited[rank]
            while len(unwaited) > self.in_flight and self._done(unwaited[0]):
                unwaited.popleft()
            if len(unwaited) > self.in_flight:
                return False
            self.started[rank] = position + 1
        action = table[position]
        if action.op.is_comm and action.peer != rank:
            message = message_of(rank, action)
            route = _route(message)
            if action.op.is_send:
                self.sent_on[route] += 1
                self.unwaited[rank].append(message)
            else:
                if self.in_order:  # reads the headers up to this message's, as far as sent
                    upto = min(self.number[message] + 1, self.sent_on[route])
                    self.read[route] = max(self.read[route], upto)
                if self.sent_on[route] <= self.number[message]:  # not sent yet
                    return False
        elif action.op in (Op.ALLREDUCE, Op.CLIP):  # a clip's group: every rank
            among = action.stage if action.op is Op.ALLREDUCE else -1
            group = self.arrived.setdefault((among, action.index), set())
            group.add(rank)
            if group != self.replicas.get(among, set(self.tables)):
                return False
        self.position[rank] = position + 1
        return True

    def _done(self, message: Message) -> bool:
        """Whether a sent ``message`` no longer holds its sender."""
        if self.in_order:
            return self.read[_route(message)] > self.number[message]
        receiver, position = self.receive_at[message]
        return self.started[receiver] > position

    def _waits(self, rank: int, position: int) -> str:
        action = self.tables[rank][position]
        if self.started[rank] <= position:
            oldest = self.unwaited[rank][0]
            return (
                f"rank {rank} before {action} waits for its send of {_describe(oldest)}"
                f" ({len(self.unwaited[rank])} messages in flight)"
            )
        return f"rank {rank} waits in {action}"


def _route(message: Message) -> tuple[int, int]:
    return message[2], message[4]


def _describe(message: Message) -> str:
    op, index, _, from_stage, receiver, to_stage = message
    return f"{MESSAGE_KIND[op]} {index} (stage {from_stage} to {to_stage}) to rank {receiver}"
