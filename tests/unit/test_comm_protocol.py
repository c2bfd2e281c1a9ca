"""The p2p message protocol in one process: headers, tags, the sender's flags, and both receive
disciplines (posted ahead with speculation, and NCCL's issue order) over a fake transport that
matches sends and receives per tag in posting order, like gloo, and never blocks."""

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
    P2P,
    PLACEHOLDER,
    channel_kind,
    decode_header,
    encode_header,
    message_tag,
    payload_tags,
    specs_of,
)

D, F, P, C = DEFINES_REFERENCE, FAST, PLACEHOLDER, CHANGED


# -- headers and tags ----------------------------------------------------------------------
@pytest.mark.parametrize("flags", [DEFINES_REFERENCE, FAST, PLACEHOLDER, CHANGED])
def test_header_round_trip_with_each_flag(flags: int) -> None:
    tensors = [torch.zeros(2, 3, 4), torch.zeros(5, dtype=torch.int64), torch.tensor(True)]
    header = decode_header(encode_header(specs_of(tensors), 42, flags))
    assert (header.version, header.flags) == (42, flags)
    assert header.specs == [
        (torch.float32, (2, 3, 4)),
        (torch.int64, (5,)),
        (torch.bool, ()),
    ]
    assert encode_header([], -1, flags).shape == (HEADER_LEN,)
    assert decode_header(encode_header([], -1, flags)).specs == []


def test_header_too_long_is_refused() -> None:
    with pytest.raises(ValueError, match="too many tensors or dimensions"):
        encode_header([(torch.float32, (1,) * 70)], 0, FAST)


def test_more_than_31_tensors_are_refused_naming_the_count() -> None:
    specs = [(torch.float32, ())] * (MAX_TENSORS + 1)
    with pytest.raises(ValueError, match="at most 31 tensors, not 32"):
        encode_header(specs, 0, FAST)
    with pytest.raises(ValueError, match="at most 31 tensors, not 32"):
        payload_tags("act", 0, 32, fast=False)
    p2p = P2P(rank=0, device=torch.device("cpu"), timeout=1, post_early=True)
    with pytest.raises(ValueError, match="at most 31 tensors, not 32"):
        p2p.send("act", 0, 1, [torch.zeros(())] * 32, 0)  # raises before sending anything
    assert not p2p._outgoing and not p2p._sent_reference


def test_tag_ranges_are_disjoint_and_fit_in_31_bits() -> None:
    """Across kinds, lanes (the receiving stage's place on its rank) and microbatches."""
    microbatches = [*range(64), (1 << 19) - 1]
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


# -- the protocol over a fake transport ------------------------------------------------------
@dataclass
class _Work:
    done: bool = False

    def wait(self, timeout: object = None) -> bool:
        assert self.done, "this wait would block forever: no matching send or receive"
        return True


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
        sends, recvs = self.sends.get(tag), self.recvs.get(tag)
        while sends and recvs:
            (sent, send_work), (buffer, recv_work) = sends.popleft(), recvs.popleft()
            assert (sent.dtype, sent.shape) == (buffer.dtype, buffer.shape), f"tag {tag} mismatch"
            buffer.copy_(sent)
            send_work.done = recv_work.done = True
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


@pytest.mark.parametrize("sends_first", [True, False])
def test_in_order_discipline_issues_receives_exactly_like_the_sends(
    loopback: _Loopback, monkeypatch: pytest.MonkeyPatch, sends_first: bool
) -> None:
    """NCCL ignores tags: the receiver's irecvs must match the sender's isends one for one, in
    issue order, in size and dtype (header, payload), and a changed shape sends no placeholder
    (nothing was posted ahead for it to fill)."""
    flags = _decoded_flags(monkeypatch)
    sender = P2P(rank=0, device=torch.device("cpu"), timeout=1, post_early=False)
    receiver = P2P(rank=1, device=torch.device("cpu"), timeout=1, post_early=False)
    messages = _channel_messages(1)
    if sends_first:
        for mb, tensors in enumerate(messages):
            sender.send("act", mb, 1, tensors, mb)
    for mb, tensors in enumerate(messages):
        receiver.post_recv("act", mb, 0)  # a no-op without post_early
        if not sends_first:
            sender.send("act", mb, 1, tensors, mb)
        got, version = receiver.recv("act", mb, 0, what="test")
        assert version == mb and all(torch.equal(g, t) for g, t in zip(got, tensors))
        assert len(got) == len(tensors)
    assert flags == [C if f == P else f for f in EXPECTED_FLAGS]
    assert not receiver._incoming
    assert loopback.recv_log == loopback.send_log
    payloads = sum(map(len, messages))
    assert len(loopback.send_log) == len(messages) + payloads  # headers and payloads only
    sender.drain(what="test")
    assert loopback.outstanding() == 0


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
