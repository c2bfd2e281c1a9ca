"""Point-to-point transport between stages: asynchronous isend/irecv with a small header.

Every message is a header (number of tensors, weight version, and the dtype and shape of each
tensor) followed by the tensors, so activations of any shape and dtype work and the version tag
travels with them (vertical sync needs it). Each message part has its own tag, derived from the
microbatch, the kind of message and the part number.

Receives are posted ahead: on gloo, the headers of the next receives in the table are posted
early and the payload receive is posted as soon as a header is known to have arrived
(:meth:`P2P.poll`; gloo often reports completion only on ``wait``, so in practice the payload is
posted when its receive action runs). NCCL
matches point-to-point operations between two ranks in issue order and ignores tags, so there a
message is received header-then-payload at its turn. Sends are never waited on until their
buffers must be reclaimed (``poll`` keeps at most ``MAX_SENDS_IN_FLIGHT``) or the run ends
(``drain``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipedream.errors import RunFailure

__all__ = ["HEADER_LEN", "P2P", "PeerTimeoutError", "decode_header", "encode_header", "message_tag"]

HEADER_LEN = 64
MAX_SENDS_IN_FLIGHT = 16
"""Message parts (headers and tensors) sent but not yet waited on, at most."""
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
_KINDS = {"act": 0, "grad": 1}


class PeerTimeoutError(RunFailure):
    """A peer failed or did not answer in time (it probably died); names who waited for what."""


def message_tag(kind: str, microbatch: int, part: int) -> int:
    """A tag unique among the messages that can be in flight between two ranks."""
    assert 0 <= part < 16
    return ((microbatch % (1 << 20)) * 4 + _KINDS[kind]) * 16 + part


def encode_header(tensors: list[Tensor], version: int) -> Tensor:
    values = [_MAGIC, len(tensors), version]
    for tensor in tensors:
        values += [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    if len(values) > HEADER_LEN:
        raise ValueError(f"too many tensors or dimensions to send in one message: {values}")
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def decode_header(header: Tensor) -> tuple[int, list[tuple[torch.dtype, tuple[int, ...]]]]:
    values = header.tolist()
    assert values[0] == _MAGIC, f"corrupt message header {values[:8]}"
    count, version = values[1], values[2]
    specs = []
    position = 3
    for _ in range(count):
        dtype, ndim = _DTYPES[values[position]], values[position + 1]
        shape = tuple(values[position + 2 : position + 2 + ndim])
        specs.append((dtype, shape))
        position += 2 + ndim
    return version, specs


@dataclass
class _Incoming:
    peer: int
    kind: str
    microbatch: int
    header: Tensor
    header_work: Any
    payload: list[Tensor] = field(default_factory=list)
    payload_works: list[Any] = field(default_factory=list)
    version: int = -1


class P2P:
    """Messages between this rank and its pipeline neighbours."""

    def __init__(self, *, rank: int, device: torch.device, timeout: float, post_early: bool):
        self.rank = rank
        self.device = device
        self.timeout = timeout
        self.post_early = post_early
        self._incoming: dict[tuple[str, int, int], _Incoming] = {}
        self._outgoing: list[tuple[Any, list[Tensor]]] = []

    # -- receiving -------------------------------------------------------------------------
    def post_recv(self, kind: str, microbatch: int, peer: int) -> None:
        """Post the receive of a message's header ahead of time (gloo only)."""
        key = (kind, microbatch, peer)
        if not self.post_early or key in self._incoming:
            return
        self._incoming[key] = self._start(kind, microbatch, peer)

    def _start(self, kind: str, microbatch: int, peer: int) -> _Incoming:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        work = dist.irecv(header, src=peer, tag=message_tag(kind, microbatch, 0))
        return _Incoming(peer, kind, microbatch, header, work)

    def _post_payload(self, incoming: _Incoming) -> None:
        version, specs = decode_header(incoming.header.cpu())
        incoming.version = version
        for part, (dtype, shape) in enumerate(specs, start=1):
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            tag = message_tag(incoming.kind, incoming.microbatch, part)
            incoming.payload.append(buffer)
            incoming.payload_works.append(dist.irecv(buffer, src=incoming.peer, tag=tag))

    def poll(self) -> None:
        """Post payload receives for headers that arrived; reclaim completed sends."""
        for incoming in self._incoming.values():
            if not incoming.payload_works and incoming.version < 0:
                if incoming.header_work.is_completed():
                    incoming.header_work.wait()
                    self._post_payload(incoming)
        # gloo reports a send complete only once it is waited on, so bound the sends in flight
        # by waiting on the oldest: otherwise every sent activation stays alive until the end
        while len(self._outgoing) > MAX_SENDS_IN_FLIGHT:
            work, _ = self._outgoing.pop(0)
            self._wait(work, "an earlier send")

    def recv(self, kind: str, microbatch: int, peer: int, *, what: str) -> tuple[list[Tensor], int]:
        """Wait for a message; returns its tensors and version tag."""
        key = (kind, microbatch, peer)
        incoming = self._incoming.pop(key, None) or self._start(kind, microbatch, peer)
        if incoming.version < 0:
            self._wait(incoming.header_work, what)
            self._post_payload(incoming)
        for work in incoming.payload_works:
            self._wait(work, what)
        return incoming.payload, incoming.version

    # -- sending ---------------------------------------------------------------------------
    def send(
        self, kind: str, microbatch: int, peer: int, tensors: list[Tensor], version: int
    ) -> None:
        """Start sending ``tensors``; buffers are kept alive until the send completes."""
        tensors = [t.detach().contiguous() for t in tensors]
        header = encode_header(tensors, version).to(self.device)
        parts = [header, *tensors]
        for part, tensor in enumerate(parts):
            work = dist.isend(tensor, dst=peer, tag=message_tag(kind, microbatch, part))
            self._outgoing.append((work, [tensor]))

    def drain(self, *, what: str) -> None:
        """Wait for every outstanding send (end of run, checkpoints)."""
        for work, _ in self._outgoing:
            self._wait(work, what)
        self._outgoing.clear()

    def _wait(self, work: Any, what: str) -> None:
        start = time.monotonic()
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout))
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
