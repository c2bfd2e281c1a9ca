"""Point-to-point transport between stages: asynchronous isend/irecv with a small header.

Every message is a header (number of tensors, weight version, flags, and the dtype and shape of
each tensor) followed by the tensors, so activations of any shape and dtype work and the version
tag travels with them (vertical sync needs it). Each part of a message has its own tag, derived
from the microbatch, the kind of message and the part number (:func:`message_tag`): part 0 is
the header, parts 1-31 the *slow* payload tags, parts 32-63 the *fast* ones (so a message
carries at most 31 tensors; the header, 64 integers, is the tighter bound: 29 0-d tensors). The
header also names its message (kind and microbatch).

Receiving the payload early. A payload receive needs its buffer, hence its dtype and shape, and
gloo cannot tell that a header has arrived before it is waited on (``Work.is_completed()`` stays
False until ``wait()``), so a receive that waited for the header would start the transfer of the
payload only when its receive action runs: a large activation then lies entirely on the critical
path. Receives are therefore posted *speculatively* with the shape of a *reference* message. But
gloo cannot cancel a posted receive (``Work`` has no abort), so a guess must never be left
dangling: the sender makes sure that every speculative receive gets a matching send. Per
channel (kind, stage pair and peer, one direction) both sides keep a reference: the specs
(dtypes and shapes) of the first message on the channel in this :class:`P2P`'s lifetime (a
channel's messages are sent and received in the same order: the tables are built
consistently). The header's flags say how the payload travels:

- ``DEFINES_REFERENCE``: the sender's first message on the channel; payload on the slow tags.
  The receiver has no reference yet, so it posted nothing speculatively.
- ``FAST``: the payload's specs equal the reference; payload on the fast tags, where the
  receiver may already have posted reference-shaped receives (:meth:`P2P.post_recv`).
- ``PLACEHOLDER``: the specs differ from the reference; the real payload goes on the slow tags,
  and a zero-filled placeholder of the reference's specs also goes on the fast tags, so that
  speculative receives always complete; the receiver takes the placeholder and drops it.
- ``CHANGED``: the same without a placeholder, where no payload is posted ahead (gloo without
  ``post_early``; every NCCL message).

So every fast-tag send is matched by exactly one fast-tag receive (speculative, or posted after
the header), and every slow-tag send by a receive posted after the header. On gloo
(``post_early``) the header receive is posted ahead of the receive action, and so are the fast
payload receives once the channel's reference is known (for the messages already posted when it
becomes known, at that moment). Only the slow payload of a message whose specs differ from the
reference waits for its header. On NCCL only headers are posted ahead (below). Sends are never
waited on until their buffers must be reclaimed (:meth:`P2P.poll` keeps at most
``messages_in_flight`` messages, each whole) or the run ends (:meth:`P2P.drain`). On the CPU,
payloads are received into reused storage
(:class:`~pipedream.runtime.receive_buffers.ReceiveBuffers`), so that gloo does not fault in
fresh pages while it reads a large message.

Ranks that share GPUs (``--device cuda-shared``) talk over gloo, which moves host memory only:
their messages are *staged* (``staged=True``): copied to pinned host memory before they are
sent, and to the rank's GPU once received; both copies are done when they return.

On NCCL (``nccl=True``) nothing waits on the host for the GPU, and NCCL's own matching
decides the rest. NCCL pairs a rank's k-th receive from a peer with the peer's k-th send to it,
whatever the tags, and a send may wait on the GPU until its receive runs. So:

- The headers travel apart from their payloads, over a gloo group (``header_group``), as host
  tensors: reading a header is a wait for the peer's host to have sent it, not a copy from the
  GPU, which would wait for everything queued on the GPU before it. Each direction numbers its
  messages, and a header's tag is its number, so headers are read in the order they were sent;
  every header names its message. Header receives are posted ahead, one for each receive
  announced (:meth:`P2P.post_recv`, whatever its message: they are numbered, not named), so a
  header sent ahead lands while its receiver computes and its send can be reclaimed; as many
  messages as announced will come, so none is left dangling. Payload receives are not posted
  ahead (every header is ``CHANGED``): a posted NCCL receive that runs on the GPU before its
  send is issued holds the direction's stream, and it needs the header's shapes.
- A rank receives a direction's payloads in the order they were sent, which can differ from
  the order its table needs them in (under a V schedule a rank sends one microbatch's
  activations before an earlier one's gradient, which its peer needs first): receiving a
  message reads the headers up to its own and issues the payload receives of the messages
  before it as it goes; their receive actions find them issued.
- Each direction between two ranks has its own group (``payload_groups``), so its own NCCL
  communicator and stream: two ranks that send to each other before receiving (every 1F1B
  steady state) would otherwise queue each one's receive behind its send on one stream, and
  with messages larger than NCCL's buffers neither send could finish.
- A payload's ``wait`` is a stream wait: the rank's stream waits for the transfer, the host
  goes on (``Work.wait`` with a timeout would block the host until the transfer is done); a
  transfer that never completes is ended by its process group's timeout, which
  ``pipedream train`` sets from ``--timeout`` for every group it creates.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipedream.errors import RunFailure
from pipedream.runtime.receive_buffers import ReceiveBuffers
from pipedream.schedules import MAX_STAGES_PER_RANK, MESSAGES_IN_FLIGHT

__all__ = [
    "CHANGED",
    "LANES",
    "MICROBATCH_TAGS",
    "DEFINES_REFERENCE",
    "FAST",
    "HEADER_LEN",
    "MAX_TENSORS",
    "P2P",
    "PLACEHOLDER",
    "Header",
    "PeerTimeoutError",
    "Spec",
    "decode_header",
    "encode_header",
    "message_tag",
    "channel_kind",
    "payload_tags",
    "specs_of",
    "stage_lane",
]

HEADER_LEN = 64
MAX_TENSORS = 31
"""Tensors in one message, at most (the slow and the fast payload tags each have 31 parts)."""
PARTS = 64
"""Part numbers per message: 0 the header, then the slow and the fast payload parts."""
_SLOW = 1
"""Part number of the first tensor on the slow tags."""
_FAST = _SLOW + MAX_TENSORS
"""Part number of the first tensor on the fast tags."""

DEFINES_REFERENCE = 1
"""Header flag: the sender's first message on its channel; payload on the slow tags."""
FAST = 2
"""Header flag: the payload has the channel's reference specs; payload on the fast tags."""
PLACEHOLDER = 4
"""Header flag: payload on the slow tags, plus a placeholder of the reference on the fast tags."""
CHANGED = 8
"""Header flag: payload on the slow tags, no placeholder (nothing was posted ahead)."""
_FLAGS = (DEFINES_REFERENCE, FAST, PLACEHOLDER, CHANGED)

_MAGIC = 0x5044  # "PD"
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_NCCL_DTYPES = frozenset(_DTYPES) - {torch.int16}
"""The header's dtypes that ProcessGroupNCCL sends and receives (it has no int16); a payload of
another travels as its bytes (:func:`_nccl_payload`)."""
_KINDS = {"act": 0, "grad": 1, "tied-grad": 2, "weights": 3}
"""Message kinds (see ``actions.MESSAGE_KIND``); a tag has room for four."""

Spec = tuple[torch.dtype, tuple[int, ...]]
"""The dtype and shape of one tensor of a message."""


class PeerTimeoutError(RunFailure):
    """A peer failed or did not answer in time (it probably died); names who waited for what."""


# -- tags and headers ------------------------------------------------------------------------
LANES = MAX_STAGES_PER_RANK**2
"""Channels of one kind between two ranks (``kind@lane``), one per pair of stages: a rank
that runs several stages sends and receives each stage pair's messages on a lane of its own
(:func:`stage_lane`), so two stage pairs between the same two ranks never share a tag, a
reference or a header's name, even where one stage receives from two stages of one peer (skip
connections, an attention mask sent to every stage, under interleaved and V schedules)."""
MICROBATCH_TAGS = 1 << 15
"""Tags tell microbatches apart modulo this (far more than can be in flight at once)."""


def stage_lane(receiver_place: int, sender_place: int) -> int:
    """The lane of the messages to a stage from a stage, given each one's place among the
    stages of its rank (0 where a rank runs one stage: every lane is 0 then)."""
    assert 0 <= receiver_place < MAX_STAGES_PER_RANK, receiver_place
    assert 0 <= sender_place < MAX_STAGES_PER_RANK, sender_place
    return receiver_place * MAX_STAGES_PER_RANK + sender_place


def channel_kind(kind: str, lane: int) -> str:
    """The kind of lane ``lane``'s messages: ``act``, ``act@1``, ..."""
    assert 0 <= lane < LANES, f"lane {lane} out of range"
    return kind if lane == 0 else f"{kind}@{lane}"


def message_tag(kind: str, microbatch: int, part: int) -> int:
    """A tag unique among the messages that can be in flight between two ranks (< 2**31):
    microbatch modulo :data:`MICROBATCH_TAGS`, lane, kind and part."""
    assert 0 <= part < PARTS, f"part {part} out of range"
    base, _, lane = kind.partition("@")
    lane_kind = (microbatch % MICROBATCH_TAGS) * LANES + int(lane or 0)
    return (lane_kind * 4 + _KINDS[base]) * PARTS + part


def payload_tags(kind: str, microbatch: int, count: int, *, fast: bool) -> list[int]:
    """The tags of a message's ``count`` tensors, on the fast or the slow tags."""
    _check_count(count)
    first = _FAST if fast else _SLOW
    return [message_tag(kind, microbatch, first + index) for index in range(count)]


def _check_count(count: int) -> None:
    if count > MAX_TENSORS:
        raise ValueError(f"a message carries at most {MAX_TENSORS} tensors, not {count}")


def _nccl_payload(tensor: Tensor) -> Tensor:
    """``tensor`` (contiguous) as NCCL can move it: itself, or a flat view of its bytes where
    NCCL has no such dtype (a receive into that view fills the tensor)."""
    return tensor if tensor.dtype in _NCCL_DTYPES else tensor.reshape(-1).view(torch.uint8)


def _in_order_tag(number: int, part: int) -> int:
    """NCCL: the tag of part ``part`` (0: the header) of the ``number``-th message of one
    direction. NCCL ignores it; gloo, which carries the headers (and the payloads where the
    protocol is tested without GPUs), matches by it, so every part of every message in flight
    has its own."""
    return (number % (1 << 24)) * PARTS + part


def specs_of(tensors: Sequence[Tensor]) -> list[Spec]:
    return [(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]


@dataclass(frozen=True)
class Header:
    """A decoded message header."""

    version: int
    """The weight version tag of the message."""
    flags: int
    """How the payload travels: ``DEFINES_REFERENCE``, ``FAST`` or ``PLACEHOLDER``."""
    specs: list[Spec]
    """The dtype and shape of each tensor of the payload."""
    kind: str
    """The message's channel kind (``act``, ``grad@1``, ...)."""
    microbatch: int
    """The message's microbatch (or update, or weight version: the index of its action)."""


def _channel_code(kind: str) -> int:
    base, _, lane = kind.partition("@")
    return _KINDS[base] * LANES + int(lane or 0)


def _channel_of(code: int) -> str:
    base = next(name for name, number in _KINDS.items() if number == code // LANES)
    return channel_kind(base, code % LANES)


def encode_header(
    specs: Sequence[Spec], version: int, flags: int, *, kind: str, microbatch: int
) -> Tensor:
    """The header of message ``(kind, microbatch)`` of tensors ``specs`` (ValueError if it does
    not fit)."""
    assert flags in _FLAGS, f"bad header flags {flags}"
    _check_count(len(specs))
    values = [_MAGIC, len(specs), version, flags, _channel_code(kind), microbatch]
    for dtype, shape in specs:
        values += [_DTYPES.index(dtype), len(shape), *shape]
    if len(values) > HEADER_LEN:
        raise ValueError(f"too many tensors or dimensions to send in one message: {values}")
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def decode_header(header: Tensor) -> Header:
    values = header.tolist()
    assert values[0] == _MAGIC, f"corrupt message header {values[:8]}"
    count, version, flags = values[1], values[2], values[3]
    assert flags in _FLAGS, f"corrupt message header flags {values[:8]}"
    specs = []
    position = 6
    for _ in range(count):
        dtype, ndim = _DTYPES[values[position]], values[position + 1]
        shape = tuple(values[position + 2 : position + 2 + ndim])
        specs.append((dtype, shape))
        position += 2 + ndim
    return Header(version, flags, specs, _channel_of(values[4]), values[5])


# -- the transport ---------------------------------------------------------------------------
@dataclass
class _Receives:
    """Receives posted for the tensors of one message (on its fast or its slow tags)."""

    buffers: list[Tensor]
    works: list[Any]


@dataclass
class _Incoming:
    """A message whose header receive is posted, with its speculative payload receives, if any."""

    peer: int
    kind: str
    microbatch: int
    header: Tensor
    header_work: Any
    speculative: _Receives | None = None
    """Fast-tag receives of the channel's reference specs, posted before the header arrived."""


class P2P:
    """Messages between this rank and its pipeline neighbours."""

    def __init__(
        self,
        *,
        rank: int,
        device: torch.device,
        timeout: float,
        post_early: bool,
        staged: bool = False,
        nccl: bool = False,
        header_group: Any = None,
        payload_groups: Mapping[tuple[int, int], Any] | None = None,
        messages_in_flight: int = MESSAGES_IN_FLIGHT,
    ):
        self.rank = rank
        self.device = device
        self.timeout = timeout
        self.post_early = post_early
        self.staged = staged
        self.wire = torch.device("cpu") if staged else device
        """Where messages travel from and to (host memory when staged)."""
        self.nccl = nccl
        """NCCL's discipline: headers numbered on ``header_group`` and read in send order,
        payloads on a group per direction, their waits stream waits (the host goes on).
        Used on gloo too by the tests (``PIPEDREAM_IN_ORDER_P2P``)."""
        self.header_group = header_group
        """A gloo group the headers travel on (NCCL payloads); None: with their payloads."""
        assert not nccl or header_group is not None, "NCCL payloads need a gloo header group"
        self.payload_groups = dict(payload_groups or {})
        """NCCL: the group of each direction's payloads, ``(sender, receiver) -> group``."""
        assert not nccl or payload_groups is not None, "NCCL payloads need a group per direction"
        self._sent_count: dict[int, int] = {}
        """NCCL: messages sent to each peer so far (the next one's sequence number)."""
        self._header_posts: dict[int, int] = {}
        """NCCL: header receives posted from each peer so far (the next one's number)."""
        self._headers_ahead: dict[int, deque[tuple[int, Tensor, Any]]] = {}
        """NCCL: header receives posted ahead from each peer and not yet read, oldest first."""
        self._announced: set[tuple[str, int, int]] = set()
        """NCCL: messages announced by :meth:`post_recv` whose header is not read yet."""
        self._arrived: dict[tuple[str, int, int], tuple[Header, _Receives]] = {}
        """NCCL: messages whose header is read and whose payload receives are issued, by key."""
        self._header_device = torch.device("cpu") if header_group is not None else self.wire
        self._incoming: dict[tuple[str, int, int], _Incoming] = {}
        self._buffers = ReceiveBuffers(self.wire, pin=staged and torch.cuda.is_available())
        self.messages_in_flight = messages_in_flight
        self._outgoing: deque[list[tuple[Any, Tensor, bool]]] = deque()
        """Messages in flight, oldest first: each part's work, the tensor it reads, and whether
        it is waited on the host."""
        # (kind, peer) -> the specs of the first message sent to / received from the peer
        self._sent_reference: dict[tuple[str, int], list[Spec]] = {}
        self._received_reference: dict[tuple[str, int], list[Spec]] = {}

    # -- receiving -------------------------------------------------------------------------
    def post_recv(self, kind: str, microbatch: int, peer: int) -> None:
        """Post a message's receives ahead of time. On gloo (``post_early``): its header and,
        once the channel has a reference, its payload on the fast tags, speculatively. On NCCL:
        the next numbered header receive from ``peer`` (headers arrive in send order, whatever
        their message), unless the message's header is read already. A message is announced
        before it is received, at most once: then no more header receives are posted than
        messages come (one posted ahead is pending only while a message announced and unread
        is on its way)."""
        key = (kind, microbatch, peer)
        if self.nccl:
            if key not in self._announced and key not in self._arrived:
                self._announced.add(key)
                self._headers_ahead.setdefault(peer, deque()).append(self._post_header(peer))
            return
        if not self.post_early or key in self._incoming:
            return
        incoming = self._start(kind, microbatch, peer)
        reference = self._received_reference.get((kind, peer))
        if reference is not None:
            self._speculate(incoming, reference)
        self._incoming[key] = incoming

    def _speculate(self, incoming: _Incoming, reference: list[Spec]) -> None:
        """Post the fast-tag receives of a message not yet received, of the reference specs."""
        assert incoming.speculative is None
        incoming.speculative = self._irecv(
            incoming.kind, incoming.microbatch, incoming.peer, reference, fast=True
        )

    def _start(self, kind: str, microbatch: int, peer: int) -> _Incoming:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._header_device)
        tag = message_tag(kind, microbatch, 0)
        work = dist.irecv(header, src=peer, tag=tag, group=self.header_group)
        return _Incoming(peer, kind, microbatch, header, work)

    def _irecv(
        self, kind: str, microbatch: int, peer: int, specs: Sequence[Spec], *, fast: bool
    ) -> _Receives:
        buffers = [self._buffers.empty(dtype, shape) for dtype, shape in specs]
        tags = payload_tags(kind, microbatch, len(specs), fast=fast)
        works = [dist.irecv(buffer, src=peer, tag=tag) for buffer, tag in zip(buffers, tags)]
        return _Receives(buffers, works)

    def poll(self) -> None:
        """Reclaim the oldest messages beyond ``messages_in_flight``, each whole.

        gloo reports a send complete only once it is waited on, so sends are bounded by waiting
        on the oldest: otherwise every sent activation would stay alive until the end. (Nothing
        is learnt from polling receives: gloo's ``is_completed`` stays False until ``wait``, and
        on NCCL no payload is posted ahead.) On NCCL the payloads' waits are stream waits: the
        host goes on, but the rank's stream waits until the receiver has read the header and
        issued the receive. The bound counts messages, not tensors: a message of many tensors
        does not make its sender wait sooner (``pipedream.schedules.host_waits`` sizes it per
        plan so that these waits cannot close a cycle between ranks, on hosts or GPUs).
        """
        while len(self._outgoing) > self.messages_in_flight:
            for work, _, on_host in self._outgoing.popleft():
                self._wait(work, "an earlier send", on_host=on_host)

    def recv(self, kind: str, microbatch: int, peer: int, *, what: str) -> tuple[list[Tensor], int]:
        """Wait for a message; returns its tensors and version tag."""
        if self.nccl:
            return self._recv_in_send_order(kind, microbatch, peer, what=what)
        key = (kind, microbatch, peer)
        incoming = self._incoming.pop(key, None) or self._start(kind, microbatch, peer)
        self._wait(incoming.header_work, what, on_host=True)
        header = decode_header(incoming.header.cpu())  # on a GPU (no header group): a sync
        channel = (kind, peer)
        reference = self._received_reference.get(channel)
        if header.flags == DEFINES_REFERENCE:
            assert reference is None and incoming.speculative is None, f"{channel}: 2nd reference"
            self._received_reference[channel] = header.specs
            payload = self._irecv(kind, microbatch, peer, header.specs, fast=False)
            # the messages already posted on the channel come after the first: speculate now
            for other in self._incoming.values():
                if (other.kind, other.peer) == channel:
                    self._speculate(other, header.specs)
        elif header.flags == FAST:
            assert reference == header.specs, f"{channel}: fast message {header} not {reference}"
            payload = self._fast_receives(incoming, header.specs)
        else:  # PLACEHOLDER or CHANGED: the specs changed
            assert reference is not None and reference != header.specs, f"{channel}: {header}"
            payload = self._irecv(kind, microbatch, peer, header.specs, fast=False)
            if header.flags == PLACEHOLDER:
                self._wait_all(self._fast_receives(incoming, reference), what)  # then dropped
            else:
                assert not self.post_early, f"{channel}: {header} while receiving ahead"
        self._wait_all(payload, what)
        return self._landed(payload), header.version

    def _landed(self, payload: _Receives) -> list[Tensor]:
        """A received payload's tensors on this rank's device."""
        if self.staged:  # to the rank's GPU (a copy that is done when it returns)
            return [buffer.to(self.device) for buffer in payload.buffers]
        return payload.buffers

    def _recv_in_send_order(
        self, kind: str, microbatch: int, peer: int, *, what: str
    ) -> tuple[list[Tensor], int]:
        """NCCL: the message, its payload received after those the peer sent before it.

        NCCL pairs a rank's k-th receive from a peer with the peer's k-th send to it (tags do
        not count), so payload receives must be issued in the sender's order, which can differ
        from the order this rank needs them in (a V schedule's rank sends a microbatch's
        activations to the other rank before an earlier microbatch's gradient, which that rank
        needs first). The headers say the order: they travel in it, numbered per direction.
        Reading up to this message's header issues the receives of the earlier messages too;
        their actions later find them issued."""
        key = (kind, microbatch, peer)
        while key not in self._arrived:
            self._take_next(peer, what)
        header, payload = self._arrived.pop(key)
        self._wait_all(payload, what)  # stream waits: the host goes on
        return self._landed(payload), header.version

    def _post_header(self, peer: int) -> tuple[int, Tensor, Any]:
        """NCCL: post the receive of the next numbered header from ``peer``; returns its
        number, buffer and work."""
        number = self._header_posts.get(peer, 0)
        self._header_posts[peer] = number + 1
        raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._header_device)
        work = dist.irecv(raw, src=peer, tag=_in_order_tag(number, 0), group=self.header_group)
        return number, raw, work

    def _take_next(self, peer: int, what: str) -> None:
        """NCCL: read the next header from ``peer`` (posted ahead, else now) and issue its
        payload's receives."""
        ahead = self._headers_ahead.get(peer)
        number, raw, work = ahead.popleft() if ahead else self._post_header(peer)
        self._wait(work, what, on_host=True)
        header = decode_header(raw)
        buffers = [self._buffers.empty(dtype, shape) for dtype, shape in header.specs]
        group = self.payload_groups[(peer, self.rank)]
        works = [
            dist.irecv(
                _nccl_payload(buffer), src=peer, tag=_in_order_tag(number, 1 + part), group=group
            )
            for part, buffer in enumerate(buffers)
        ]
        key = (header.kind, header.microbatch, peer)
        self._announced.discard(key)
        self._arrived[key] = (header, _Receives(buffers, works))

    def _fast_receives(self, incoming: _Incoming, specs: list[Spec]) -> _Receives:
        """The message's fast-tag receives: those posted speculatively, else posted now."""
        if incoming.speculative is not None:
            return incoming.speculative
        return self._irecv(incoming.kind, incoming.microbatch, incoming.peer, specs, fast=True)

    def _wait_all(self, receives: _Receives, what: str) -> None:
        for work in receives.works:
            self._wait(work, what, on_host=not self.nccl)

    # -- sending ---------------------------------------------------------------------------
    def send(
        self, kind: str, microbatch: int, peer: int, tensors: list[Tensor], version: int
    ) -> None:
        """Start sending ``tensors``; buffers are kept alive until the send completes."""
        tensors = [self._on_wire(t.detach()) for t in tensors]
        if self.nccl:
            self._send_in_order(kind, microbatch, peer, tensors, version)
            return
        specs = specs_of(tensors)
        channel = (kind, peer)
        reference = self._sent_reference.get(channel)
        if reference is None:
            flags = DEFINES_REFERENCE
        elif specs == reference:
            flags = FAST
        else:  # a placeholder only where the receiver may have posted reference-shaped receives
            flags = PLACEHOLDER if self.post_early else CHANGED
        header = encode_header(specs, version, flags, kind=kind, microbatch=microbatch)
        self._sent_reference.setdefault(channel, specs)
        header = header.to(self._header_device)
        header_tag = message_tag(kind, microbatch, 0)
        self._outgoing.append([])
        self._isend(header, peer, header_tag, group=self.header_group, on_host=True)
        tags = payload_tags(kind, microbatch, len(specs), fast=flags == FAST)
        for tensor, tag in zip(tensors, tags):
            self._isend(tensor, peer, tag)
        if flags == PLACEHOLDER:
            assert reference is not None
            self._send_placeholder(kind, microbatch, peer, reference)

    def _send_in_order(
        self, kind: str, microbatch: int, peer: int, tensors: list[Tensor], version: int
    ) -> None:
        """NCCL: the header, numbered, on the gloo header group, and the payload on the group of
        this direction (its own NCCL communicator, so its own stream: a send that waits for the
        peer's receive never holds up a transfer the other way, which the peer may need first).
        No payload is posted ahead, so there is no reference and no placeholder."""
        header = encode_header(
            specs_of(tensors), version, CHANGED, kind=kind, microbatch=microbatch
        )  # raises before any send
        group = self.payload_groups.get((self.rank, peer))
        assert group is not None, f"no payload group from rank {self.rank} to rank {peer}"
        number = self._sent_count.get(peer, 0)
        self._sent_count[peer] = number + 1
        tag = _in_order_tag(number, 0)
        self._outgoing.append([])
        self._isend(header, peer, tag, group=self.header_group, on_host=True)
        for part, tensor in enumerate(tensors):
            self._isend(_nccl_payload(tensor), peer, _in_order_tag(number, 1 + part), group=group)

    def _send_placeholder(self, kind: str, microbatch: int, peer: int, specs: list[Spec]) -> None:
        """Zeros of the reference ``specs`` on the fast tags, for the receiver's speculation."""
        tags = payload_tags(kind, microbatch, len(specs), fast=True)
        for (dtype, shape), tag in zip(specs, tags):
            self._isend(torch.zeros(shape, dtype=dtype, device=self.wire), peer, tag)

    def _on_wire(self, tensor: Tensor) -> Tensor:
        """``tensor`` contiguous where messages travel (a finished copy in pinned host memory
        when staged)."""
        if not self.staged or tensor.device == self.wire:
            return tensor.contiguous()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(tensor)  # not non_blocking: gloo reads it as soon as the send is posted
        return host

    def _isend(
        self, tensor: Tensor, peer: int, tag: int, group: Any = None, on_host: bool | None = None
    ) -> None:
        """Start a send, a part of the newest message in flight; ``on_host``: whether it is
        waited on the host (default: unless the tensor is an NCCL payload)."""
        work = dist.isend(tensor, dst=peer, tag=tag, group=group)
        self._outgoing[-1].append((work, tensor, not self.nccl if on_host is None else on_host))

    def drain(self, *, what: str) -> None:
        """Wait for every outstanding send (end of run, checkpoints). Every receive posted
        ahead has been read by then: a receive posted under another kind than the one it is
        read under would be left behind."""
        for message in self._outgoing:
            for work, _, on_host in message:
                self._wait(work, what, on_host=on_host)
        self._outgoing.clear()
        unread = sorted(self._incoming) + sorted(self._announced) + sorted(self._arrived)
        assert not unread, (
            f"rank {self.rank}: messages posted or read ahead, never received: {unread}"
        )

    def _wait(self, work: Any, what: str, *, on_host: bool) -> None:
        """Wait for ``work``: on the host, up to the timeout; else a stream wait."""
        start = time.monotonic()
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout)) if on_host else work.wait()
        except RuntimeError as exc:
            reason = " ".join(str(exc).split())  # one line
            raise PeerTimeoutError(
                f"rank {self.rank}: {what} failed after {time.monotonic() - start:.0f}s; the peer "
                f"probably died ({reason[:300]})"
            ) from None
        if ok is False:
            raise PeerTimeoutError(
                f"rank {self.rank}: timed out after {self.timeout:.0f}s waiting for {what}"
            )
