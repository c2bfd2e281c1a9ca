"""Where a rank's host waits for its peers, and a :class:`Posting` under which none waits forever.

:func:`~pipedream.schedules.validate.simulate_dependencies` runs tables as if sends never
waited. The runtime's do, in one place: before each action the executor waits for its oldest
sent messages beyond ``messages_in_flight`` (:mod:`~pipedream.schedules.posting`), and a send
is done only once its peer has posted the matching receive (a gloo send completes against a
posted receive; so do an NCCL payload's header, which travels over gloo). A rank that runs far
ahead thus waits for a peer to get far enough to post the receive of its oldest message, and
that peer may be waiting for the rank's next message, which it has not sent: a cycle no
dependency between actions shows. It takes many messages between the receives (dense skip
connections, each rank talking to many), and a larger posting breaks it.

The model, per transport, in the worst case the transport allows:

- gloo: a message's header receive is posted ahead, and its payload receives too when its
  tensors have the shapes of the channel's first message, which depends on the workload. The
  worst case is assumed: every payload receive posted by its receive action, so a send is done
  once its receiver has started that action.
- NCCL (``in_order``, ``runtime/comm.py``): header receives are numbered per direction, one is
  posted ahead for each message announced (a receive within the window) or when the receiver
  reads that far, and payloads never hold the host (stream waits): a send is done once its
  receiver has posted the header receive of the message's number.

A send done sooner never makes a host wait longer, so tables that finish here finish in the
runtime. Pure Python: no torch.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence

from pipedream.schedules.actions import MESSAGE_KIND, Action, Op
from pipedream.schedules.posting import Posting, receives_posted_before
from pipedream.schedules.validate import Message, message_of

__all__ = ["host_stall", "posting_for"]

MAX_DOUBLINGS = 16
"""Doublings of the default posting :func:`posting_for` tries before it gives up."""


def host_stall(
    tables: Mapping[int, Sequence[Action]], posting: Posting, *, in_order: bool
) -> str | None:
    """Run ``tables`` with the executor's waits under ``posting``: None if every rank reaches
    the end of its table, else where the ranks stop and what each waits for."""
    return _HostRun(tables, posting, in_order=in_order).run()


def posting_for(
    tables: Mapping[int, Sequence[Action]], *, in_order: bool, start: Posting | None = None
) -> Posting:
    """``start`` (default: :class:`Posting`'s defaults) if no host waits forever under it, else
    the first of its doublings (window and messages in flight both) under which none does.

    Tables that pass :func:`~pipedream.schedules.validate.simulate_dependencies` always find
    one: once the window covers a table and its sends all stay in flight, nothing waits."""
    posting = start or Posting()
    for _ in range(MAX_DOUBLINGS):
        if host_stall(tables, posting, in_order=in_order) is None:
            return posting
        posting = Posting(posting.window * 2, max(1, posting.messages_in_flight * 2))
    stall = host_stall(tables, posting, in_order=in_order)
    assert stall is None, f"no posting up to {posting} runs these tables: {stall}"
    return posting


class _HostRun:
    """Every rank's host running its table, until all are done or none can go on."""

    def __init__(
        self, tables: Mapping[int, Sequence[Action]], posting: Posting, *, in_order: bool
    ) -> None:
        self.tables, self.posting, self.in_order = tables, posting, in_order
        self.posts = {r: receives_posted_before(t, posting.window) for r, t in tables.items()}
        self.position = dict.fromkeys(tables, 0)
        """Actions each rank has finished."""
        self.started = dict.fromkeys(tables, 0)
        """Actions each rank has started (past the wait for its sends)."""
        self.reached = dict.fromkeys(tables, -1)
        """The last position whose receives each rank has posted."""
        self.unwaited: dict[int, deque[Message]] = {rank: deque() for rank in tables}
        self.sent: set[Message] = set()
        self.receive_at: dict[Message, tuple[int, int]] = {}
        """Each message's receiver and the position of its receive there."""
        self.number: dict[Message, int] = {}
        """Each message's place among those its sender sends to its receiver."""
        self.in_send_order: dict[tuple[int, int], list[Message]] = {}
        for rank, table in tables.items():
            for position, action in enumerate(table):
                if action.peer == rank or not action.op.is_comm:
                    continue
                message = message_of(rank, action)
                if action.op.is_receive:
                    self.receive_at[message] = (rank, position)
                else:
                    route = self.in_send_order.setdefault(_route(message), [])
                    self.number[message] = len(route)
                    route.append(message)
        # NCCL, per (sender, receiver): header receives posted, those of them posted ahead and
        # not read yet, and headers read
        self.headers_posted: Counter[tuple[int, int]] = Counter()
        self.headers_ahead: Counter[tuple[int, int]] = Counter()
        self.headers_read: Counter[tuple[int, int]] = Counter()
        self.announced: set[Message] = set()
        """Messages announced (a header receive posted ahead for each) or read."""
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
        if self.reached[rank] < position:
            for ahead in self.posts[rank][position]:
                if table[ahead].peer != rank:
                    self._announce(message_of(rank, table[ahead]))
            self.reached[rank] = position
        if self.started[rank] <= position:
            unwaited = self.unwaited[rank]
            while len(unwaited) > self.posting.messages_in_flight and self._done(unwaited[0]):
                unwaited.popleft()
            if len(unwaited) > self.posting.messages_in_flight:
                return False
            self.started[rank] = position + 1
        action = table[position]
        if action.op.is_comm and action.peer != rank:
            message = message_of(rank, action)
            if action.op.is_send:
                self.sent.add(message)
                self.unwaited[rank].append(message)
            elif message not in self.sent:
                return False
            elif self.in_order:
                self._read_up_to(message)
        elif action.op is Op.ALLREDUCE:
            group = self.arrived.setdefault((action.stage, action.index), set())
            group.add(rank)
            if group != self.replicas[action.stage]:
                return False
        self.position[rank] = position + 1
        return True

    def _announce(self, message: Message) -> None:
        """NCCL: a receive within the window, unless announced or read already, posts the next
        header receive of its direction (``P2P.post_recv``)."""
        if self.in_order and message not in self.announced:
            self.announced.add(message)
            self.headers_posted[_route(message)] += 1
            self.headers_ahead[_route(message)] += 1

    def _read_up_to(self, message: Message) -> None:
        """NCCL: read the direction's headers up to ``message``'s, each with a receive posted
        ahead if one is pending, else posted then (``P2P._take_next``)."""
        route = _route(message)
        first, last = self.headers_read[route], self.number[message]
        for earlier in self.in_send_order[route][first : last + 1]:
            self.headers_read[route] += 1
            self.announced.add(earlier)
            if self.headers_ahead[route]:
                self.headers_ahead[route] -= 1
            else:
                self.headers_posted[route] += 1
            assert self.headers_posted[route] >= self.headers_read[route]

    def _done(self, message: Message) -> bool:
        """Whether a sent ``message`` no longer holds its sender's host."""
        if self.in_order:
            return self.headers_posted[_route(message)] > self.number[message]
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
