"""The p2p message protocol in one process: headers, tags, the sender's flags, and both receive
disciplines: posted ahead with speculation, over a fake transport that matches sends and
receives per tag in posting order, like gloo, and never blocks; and NCCL's, over a fake that
pairs them in issue order whatever the tags, as NCCL does."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from pipedream.runtime import comm
from pipedream.runtime.comm import (
    CHANGED,
    DEFINES_REFERENCE,
    FAST,
    HEADER_LEN,
    LANES,
    MAX_TENSORS,
    MICROBATCH_TAGS,
    P2P,
    PLACEHOLDER,
    channel_kind,
    decode_header,
    encode_header,
    message_tag,
    payload_tags,
    specs_of,
    stage_lane,
)
from pipedream.schedules import MAX_STAGES_PER_RANK

D, F, P, C = DEFINES_REFERENCE, FAST, PLACEHOLDER, CHANGED


# -- headers and tags ----------------------------------------------------------------------
@pytest.mark.parametrize("flags", [DEFINES_REFERENCE, FAST, PLACEHOLDER, CHANGED])
def test_header_round_trip_with_each_flag(flags: int) -> None:
    tensors = [torch.zeros(2, 3, 4), torch.zeros(5, dtype=torch.int64), torch.tensor(True)]
    header = decode_header(encode_header(specs_of(tensors), 42, flags, kind="grad@3", microbatch=9))
    assert (header.version, header.flags) == (42, flags)
    assert (header.kind, header.microbatch) == ("grad@3", 9)
    assert header.specs == [
        (torch.float32, (2, 3, 4)),
        (torch.int64, (5,)),
        (torch.bool, ()),
    ]
    empty = encode_header([], -1, flags, kind="weights@15", microbatch=(1 << 40) + 1)
    assert empty.shape == (HEADER_LEN,)
    assert decode_header(empty) == comm.Header(-1, flags, [], "weights@15", (1 << 40) + 1)


def test_header_too_long_is_refused() -> None:
    with pytest.raises(ValueError, match="too many tensors or dimensions"):
        encode_header([(torch.float32, (1,) * 70)], 0, FAST, kind="act", microbatch=0)


def test_more_than_31_tensors_are_refused_naming_the_count() -> None:
    specs = [(torch.float32, ())] * (MAX_TENSORS + 1)
    with pytest.raises(ValueError, match="at most 31 tensors, not 32"):
        encode_header(specs, 0, FAST, kind="act", microbatch=0)
    with pytest.raises(ValueError, match="at most 31 tensors, not 32"):
        payload_tags("act", 0, 32, fast=False)
    p2p = P2P(rank=0, device=torch.device("cpu"), timeout=1, post_early=True)
    with pytest.raises(ValueError, match="at most 31 tensors, not 32"):
        p2p.send("act", 0, 1, [torch.zeros(())] * 32, 0)  # raises before sending anything
    assert not p2p._outgoing and not p2p._sent_reference


def test_tag_ranges_are_disjoint_and_fit_in_31_bits() -> None:
    """Across kinds, lanes (one per stage pair between two ranks) and microbatches."""
    microbatches = [*range(64), MICROBATCH_TAGS - 1]
    seen: set[int] = set()
    kinds = [channel_kind(k, lane) for k in ("act", "grad") for lane in (0, 1, LANES - 1)]
    assert kinds[:2] == ["act", "act@1"]
    for kind in kinds:
        for mb in microbatches:
            header = {message_tag(kind, mb, 0)}
            slow = set(payload_tags(kind, mb, MAX_TENSORS, fast=False))
            fast = set(payload_tags(kind, mb, MAX_TENSORS, fast=True))
            assert len(slow) == len(fast) == MAX_TENSORS
            assert not (header & slow) and not (header & fast) and not (slow & fast)
            tags = header | slow | fast
            assert not (tags & seen)  # distinct across kinds and microbatches too
            seen |= tags
            assert all(0 <= tag < 2**31 for tag in tags)
    assert max(seen) < 2**31
    with pytest.raises(AssertionError):
        message_tag("act", 0, 64)


def test_every_stage_pair_between_two_ranks_has_a_lane_of_its_own() -> None:
    """Under interleaved and V schedules one stage can receive from two stages of one peer: a
    skip connection, or an attention mask the first stage sends to every later one. Stage 3
    (rank 1's second stage) takes activations from stages 0 and 2, both on rank 0: keyed by
    the receiving stage alone, the two messages shared tags and swapped payloads."""
    places = {0: 0, 1: 0, 2: 1, 3: 1}  # interleaved on 2 ranks: stages 0, 2 and 1, 3
    pairs = [(3, 0), (3, 2), (2, 1), (1, 0), (2, 0)]  # (receiver, sender)
    lanes = [stage_lane(places[r], places[s]) for r, s in pairs]
    assert lanes == [16, 17, 16, 0, 16]
    # the pairs from rank 0 to rank 1 (receivers 3, 3, 1) and from rank 1 to rank 0 (2) differ
    assert len({lanes[0], lanes[1], lanes[3]}) == 3
    assert stage_lane(0, 0) == 0  # one stage per rank: every message on lane 0, as before
    assert stage_lane(MAX_STAGES_PER_RANK - 1, MAX_STAGES_PER_RANK - 1) == LANES - 1


# -- the protocol over a fake transport ------------------------------------------------------
@dataclass
class _Work:
    done: bool = False
    on_stream: bool = False
    """An NCCL payload's: its wait is a stream wait, which never blocks the host."""

    def wait(self, timeout: object = None) -> bool:
        if not self.on_stream:
            assert self.done, "this wait would block forever: no matching send or receive"
        return True


Posted = deque[tuple[Tensor, _Work]]


def _pair_up(sends: Posted | None, recvs: Posted | None, where: str) -> None:
    """Complete the oldest send with the oldest receive, while both wait: the receive's buffer
    takes the send's values (of the same dtype and shape, or the transport fails)."""
    while sends and recvs:
        (sent, send_work), (buffer, recv_work) = sends.popleft(), recvs.popleft()
        assert (sent.dtype, sent.shape) == (buffer.dtype, buffer.shape), f"{where} mismatch"
        buffer.copy_(sent)
        send_work.done = recv_work.done = True


@dataclass
class _Loopback:
    """One direction, one pair of ranks: sends and receives match per tag in posting order."""

    sends: dict[int, deque[tuple[Tensor, _Work]]] = field(default_factory=dict)
    recvs: dict[int, deque[tuple[Tensor, _Work]]] = field(default_factory=dict)
    send_log: list[tuple[int, torch.dtype]] = field(default_factory=list)
    recv_log: list[tuple[int, torch.dtype]] = field(default_factory=list)

    def isend(self, tensor: Tensor, dst: int, tag: int, group: object = None) -> _Work:
        assert group is None, "one group here: the transport's default"
        self.send_log.append((tensor.numel(), tensor.dtype))
        return self._post(self.sends, tag, tensor.clone())

    def irecv(self, tensor: Tensor, src: int, tag: int, group: object = None) -> _Work:
        assert group is None, "one group here: the transport's default"
        self.recv_log.append((tensor.numel(), tensor.dtype))
        return self._post(self.recvs, tag, tensor)

    def _post(self, queues: dict[int, deque[tuple[Tensor, _Work]]], tag: int, t: Tensor) -> _Work:
        work = _Work()
        queues.setdefault(tag, deque()).append((t, work))
        _pair_up(self.sends.get(tag), self.recvs.get(tag), f"tag {tag}")
        return work

    def outstanding(self) -> int:
        return sum(map(len, self.sends.values())) + sum(map(len, self.recvs.values()))


@pytest.fixture
def loopback(monkeypatch: pytest.MonkeyPatch) -> _Loopback:
    fake = _Loopback()
    monkeypatch.setattr(comm, "dist", SimpleNamespace(isend=fake.isend, irecv=fake.irecv))
    return fake


def _channel_messages(seed: int) -> list[list[Tensor]]:
    """Shapes A, A, A, B, A, B', A, A as float64, A again, an empty message, then A."""
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(3, 4, generator=gen), torch.arange(5)]
    b = [torch.randn(2, 5, 7, generator=gen)]
    b2 = [torch.randn(3, 4, generator=gen), torch.arange(6), torch.tensor(False)]
    return [
        a,
        [t + 1 for t in a],
        [t + 2 for t in a],
        b,
        [t + 3 for t in a],
        b2,
        [t * 2 for t in a],
        [a[0].double(), a[1]],
        [t - 1 for t in a],
        [],
        [t - 2 for t in a],
    ]


EXPECTED_FLAGS = [D, F, F, P, F, P, F, P, F, P, F]


def _decoded_flags(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    flags: list[int] = []
    decode = comm.decode_header

    def recording(header: Tensor) -> comm.Header:
        decoded = decode(header)
        flags.append(decoded.flags)
        return decoded

    monkeypatch.setattr(comm, "decode_header", recording)
    return flags


@pytest.mark.parametrize("window", [0, 1, 3])
def test_speculative_receives_round_trip_and_leave_nothing_outstanding(
    loopback: _Loopback, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """The receiver posts ``window`` messages ahead of the sender (gloo: headers, and the
    reference-shaped fast receives once the reference is known) and receives each message
    right after it is sent."""
    flags = _decoded_flags(monkeypatch)
    sender = P2P(rank=0, device=torch.device("cpu"), timeout=1, post_early=True)
    receiver = P2P(rank=1, device=torch.device("cpu"), timeout=1, post_early=True)
    messages = _channel_messages(0)
    speculated = []
    for mb, tensors in enumerate(messages):
        for ahead in range(mb, min(mb + window + 1, len(messages))):
            receiver.post_recv("act", ahead, 0)
        sender.send("act", mb, 1, tensors, 100 + mb)
        speculated.append(receiver._incoming[("act", mb, 0)].speculative is not None)
        got, version = receiver.recv("act", mb, 0, what="test")
        assert version == 100 + mb
        assert [(g.dtype, g.shape) for g in got] == [(t.dtype, t.shape) for t in tensors]
        assert all(torch.equal(g, t) for g, t in zip(got, tensors))
    assert flags == EXPECTED_FLAGS
    # every message after the first, the reference: those posted before it arrived too
    assert speculated == [mb > 0 for mb in range(len(messages))]
    sender.drain(what="test")
    assert loopback.outstanding() == 0 and not receiver._incoming


def test_a_message_of_many_tensors_counts_once_among_the_sends_in_flight(
    loopback: _Loopback,
) -> None:
    """The executor's bound on sends in flight counts messages: a stage boundary of many
    tensors does not make its sender wait sooner (with a bound on tensors a message of 20 was
    waited on right away, for a receive its peer posts only when it gets there; with dense
    skip connections or changing shapes that closed cycles between ranks)."""
    p2p = P2P(rank=0, device=torch.device("cpu"), timeout=1, post_early=True)
    p2p.send("act", 0, 1, [torch.zeros(())] * 20, 0)
    p2p.poll()  # one message in flight: nothing to wait for (no receive is posted here)
    for mb in range(1, p2p.messages_in_flight + 1):
        p2p.send("act", mb, 1, [torch.zeros(2)], mb)
    with pytest.raises(AssertionError, match="block forever"):
        p2p.poll()  # one message too many: it waits for the oldest, whole
    assert len(p2p._outgoing) == p2p.messages_in_flight


def test_speculative_buffers_have_the_reference_specs(loopback: _Loopback) -> None:
    sender = P2P(rank=0, device=torch.device("cpu"), timeout=1, post_early=True)
    receiver = P2P(rank=1, device=torch.device("cpu"), timeout=1, post_early=True)
    for mb in range(2):
        receiver.post_recv("grad", mb, 0)
        assert receiver._incoming[("grad", mb, 0)].speculative is None  # no reference yet
    receiver.post_recv("act", 5, 0)
    reference = [torch.ones(4, 2, dtype=torch.bfloat16), torch.ones(3, dtype=torch.int32)]
    sender.send("grad", 0, 1, reference, 0)
    receiver.recv("grad", 0, 0, what="test")
    receiver.post_recv("grad", 2, 0)
    for mb in (1, 2):  # posted before the reference arrived, and after
        speculative = receiver._incoming[("grad", mb, 0)].speculative
        assert speculative is not None and len(speculative.works) == 2
        assert specs_of(speculative.buffers) == specs_of(reference)
        assert not any(work.done for work in speculative.works)  # posted before the send
    receiver.post_recv("act", 6, 0)  # another channel: no reference there
    assert receiver._incoming[("act", 5, 0)].speculative is None
    assert receiver._incoming[("act", 6, 0)].speculative is None


# -- NCCL's matching ----------------------------------------------------------------------
HEADERS = object()
"""The gloo group the NCCL transport's headers travel on."""


@dataclass
class _Nccl:
    """Two ranks (0 and 1) as NCCL pairs them: on a payload group a receive takes the oldest
    unmatched send of its direction, whatever the tags (a shape mismatch is an error, matching
    values are not checked: NCCL copies bytes), and a wait is a stream wait, which does not
    block the host; on the header group, gloo's matching by tag, and a wait blocks the host
    until its match is posted."""

    queues: dict[tuple, tuple[deque, deque]] = field(default_factory=dict)
    directions: dict[object, set[tuple[int, int]]] = field(default_factory=dict)
    """The directions each payload group carried."""

    def isend(self, tensor: Tensor, dst: int, tag: int, group: object = None) -> _Work:
        return self._post(0, tensor.clone(), src=1 - dst, dst=dst, tag=tag, group=group)

    def irecv(self, tensor: Tensor, src: int, tag: int, group: object = None) -> _Work:
        return self._post(1, tensor, src=src, dst=1 - src, tag=tag, group=group)

    def _post(self, side: int, t: Tensor, *, src: int, dst: int, tag: int, group: object) -> _Work:
        if group is not HEADERS:
            self.directions.setdefault(group, set()).add((src, dst))
        key = (group, src, dst, tag if group is HEADERS else None)
        sends, recvs = self.queues.setdefault(key, (deque(), deque()))
        work = _Work(on_stream=group is not HEADERS)
        (sends, recvs)[side].append((t, work))
        _pair_up(sends, recvs, str(key))
        return work

    def outstanding(self) -> int:
        return sum(len(sends) + len(recvs) for sends, recvs in self.queues.values())


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch) -> _Nccl:
    fake = _Nccl()
    monkeypatch.setattr(comm, "dist", SimpleNamespace(isend=fake.isend, irecv=fake.irecv))
    return fake


def _nccl_p2p(rank: int) -> P2P:
    groups = {(0, 1): "payloads 0 to 1", (1, 0): "payloads 1 to 0"}
    return P2P(
        rank=rank,
        device=torch.device("cpu"),
        timeout=1,
        post_early=False,
        nccl=True,
        header_group=HEADERS,
        payload_groups=groups,
    )


@pytest.mark.parametrize("sends_first", [True, False])
def test_on_nccl_each_message_arrives_whole_with_its_shapes_changing(
    nccl: _Nccl, sends_first: bool
) -> None:
    """Shapes, dtypes and counts change from message to message; every payload receive takes
    the send it is paired with by issue order, and nothing is left over."""
    sender, receiver = _nccl_p2p(0), _nccl_p2p(1)
    messages = _channel_messages(1)
    if sends_first:
        for mb, tensors in enumerate(messages):
            sender.send("act", mb, 1, tensors, mb)
    for mb, tensors in enumerate(messages):
        receiver.post_recv("act", mb, 0)  # the header's receive only
        if not sends_first:
            sender.send("act", mb, 1, tensors, mb)
        got, version = receiver.recv("act", mb, 0, what="test")
        assert version == mb and len(got) == len(tensors)
        assert all(torch.equal(g, t) for g, t in zip(got, tensors))
    assert not receiver._incoming and not receiver._arrived
    sender.drain(what="test")
    assert nccl.outstanding() == 0


def test_on_nccl_payloads_are_received_in_the_order_they_were_sent(nccl: _Nccl) -> None:
    """A V schedule's rank 0 sends microbatch 2's activations (stage 0 to 1) before microbatch
    0's gradient (stage 3 to 2), and rank 1 needs the gradient first. NCCL pairs receives
    with sends in issue order, so receiving the gradient first must issue the activations'
    receive before its own (it was paired with the activations, the same shape: the two
    swapped silently)."""
    sender, receiver = _nccl_p2p(0), _nccl_p2p(1)
    activations, gradient = torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)
    sender.send("act", 2, 1, [activations], 5)
    sender.send("grad@1", 0, 1, [gradient], 6)
    (got,), version = receiver.recv("grad@1", 0, 0, what="the gradient")
    assert version == 6 and torch.equal(got, gradient)
    assert list(receiver._arrived) == [("act", 2, 0)]  # issued, waiting for its action
    (got,), version = receiver.recv("act", 2, 0, what="the activations")
    assert version == 5 and torch.equal(got, activations)
    assert nccl.outstanding() == 0 and not receiver._arrived


def test_on_nccl_a_sender_far_ahead_is_not_held_by_its_headers(nccl: _Nccl) -> None:
    """The receiver announces its next messages (as the executor does before it computes) and
    the sender sends them all and reclaims its messages past ``messages_in_flight``. The
    headers' receives are posted ahead, so reclaiming a header send does not wait for the
    receiver's host to reach that message (here it would never return)."""
    sender, receiver = _nccl_p2p(0), _nccl_p2p(1)
    count = 2 * sender.messages_in_flight
    for mb in range(count):
        receiver.post_recv("act", mb, 0)
    for mb in range(count):
        sender.send("act", mb, 1, [torch.full((2,), float(mb))], mb)
    sender.poll()
    assert len(sender._outgoing) == sender.messages_in_flight
    for mb in range(count):
        (got,), version = receiver.recv("act", mb, 0, what="test")
        assert version == mb and torch.equal(got, torch.full((2,), float(mb)))
    sender.drain(what="test")
    assert nccl.outstanding() == 0 and not receiver._headers_ahead[0]


def test_on_nccl_header_receives_posted_ahead_are_never_more_than_the_messages(
    nccl: _Nccl,
) -> None:
    """Header receives are numbered, not named, and gloo cannot take one back: a message
    announced twice, or once its header is read (by the receive of a later message), must not
    post another, or the last would wait forever for a header that never comes."""
    sender, receiver = _nccl_p2p(0), _nccl_p2p(1)
    for mb in range(3):
        sender.send("act", mb, 1, [torch.full((2,), float(mb))], mb)
    receiver.post_recv("act", 1, 0)
    receiver.post_recv("act", 1, 0)  # once more: no second receive
    (got,), _ = receiver.recv("act", 1, 0, what="test")  # reads the headers of 0 and 1
    receiver.post_recv("act", 0, 0)  # read already: nothing to post
    receiver.post_recv("act", 2, 0)
    for mb in (0, 2):
        (got,), version = receiver.recv("act", mb, 0, what="test")
        assert version == mb and torch.equal(got, torch.full((2,), float(mb)))
    assert nccl.outstanding() == 0 and not receiver._announced


def test_on_nccl_each_direction_has_a_group_of_its_own(nccl: _Nccl) -> None:
    """Both ranks send before they receive, as in every 1F1B steady state: with one NCCL
    communicator for both directions each rank's receive waits on the GPU behind its own send,
    which waits for the other's receive."""
    ranks = [_nccl_p2p(0), _nccl_p2p(1)]
    for rank, p2p in enumerate(ranks):
        p2p.send("act" if rank == 0 else "grad", 0, 1 - rank, [torch.ones(4) * rank], 0)
    for rank, p2p in enumerate(ranks):
        (got,), _ = p2p.recv("grad" if rank == 0 else "act", 0, 1 - rank, what="test")
        assert torch.equal(got, torch.ones(4) * (1 - rank))
    assert nccl.directions == {"payloads 0 to 1": {(0, 1)}, "payloads 1 to 0": {(1, 0)}}


def test_large_payloads_land_in_storage_the_stage_has_released(loopback: _Loopback) -> None:
    """On the CPU, a payload goes into the storage of an earlier one nobody holds any more
    (speculative receives too), never into one still held."""
    sender = P2P(rank=0, device=torch.device("cpu"), timeout=1, post_early=True)
    receiver = P2P(rank=1, device=torch.device("cpu"), timeout=1, post_early=True)
    messages = [[torch.full((64, 1024), float(mb))] for mb in range(4)]  # 256 KiB each

    def receive(mb: int) -> Tensor:
        receiver.post_recv("act", mb, 0)
        sender.send("act", mb, 1, messages[mb], 0)
        (got,), _ = receiver.recv("act", mb, 0, what="test")
        assert torch.equal(got, messages[mb][0])
        return got

    held = receive(0)  # the reference, on the slow tags
    address = held.untyped_storage().data_ptr()
    second = receive(1)  # speculative: the first is still held
    assert second.untyped_storage().data_ptr() != address
    del held
    assert receive(2).untyped_storage().data_ptr() == address  # dropped at once
    assert receive(3).untyped_storage().data_ptr() == address
    assert torch.equal(second, messages[1][0])  # untouched by the later messages
    assert receiver._buffers.allocated == 2
