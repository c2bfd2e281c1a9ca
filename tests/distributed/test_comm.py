"""The p2p transport on 2 gloo processes: headers carry shape, dtype and version; receives posted
ahead (gloo) and in order (the NCCL discipline) both deliver every message intact."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipedream.runtime.comm import P2P, decode_header, encode_header, message_tag


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _messages() -> list[tuple[str, int, list[torch.Tensor], int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("act", 0, [torch.randn(3, 4, generator=gen)], 0),
        ("act", 1, [torch.randn(2, 5, 7, generator=gen), torch.arange(6).view(2, 3)], 1),
        ("grad", 0, [torch.randn(3, 4, generator=gen).to(torch.bfloat16)], 0),
        ("act", 2, [torch.tensor(True).reshape(())], 7),
        ("grad", 1, [torch.randn(1, generator=gen).double()], 2),
    ]


def _worker(rank: int, port: int, post_early: bool, queue) -> None:  # pragma: no cover - child
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    p2p = P2P(rank=rank, device=torch.device("cpu"), timeout=30, post_early=post_early)
    messages = _messages()
    try:
        if rank == 0:
            for kind, mb, tensors, version in messages:
                p2p.send(kind, mb, 1, tensors, version)
            p2p.drain(what="sends")
        else:
            for kind, mb, _, _ in messages:
                p2p.post_recv(kind, mb, 0)
            p2p.poll()
            ok = True
            for kind, mb, tensors, version in reversed(messages) if post_early else messages:
                got, got_version = p2p.recv(kind, mb, 0, what="test")
                ok &= got_version == version and len(got) == len(tensors)
                ok &= all(g.dtype == t.dtype and torch.equal(g, t) for g, t in zip(got, tensors))
            queue.put(ok)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("post_early", [True, False])
def test_messages_round_trip(post_early: bool) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, post_early, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        assert queue.get(timeout=60) is True
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert all(proc.exitcode == 0 for proc in procs)


def test_header_round_trip_and_tags() -> None:
    tensors = [torch.zeros(2, 3, 4), torch.zeros(5, dtype=torch.int64)]
    version, specs = decode_header(encode_header(tensors, 42))
    assert version == 42
    assert specs == [(torch.float32, (2, 3, 4)), (torch.int64, (5,))]
    tags = {message_tag(k, mb, p) for k in ("act", "grad") for mb in range(64) for p in range(16)}
    assert len(tags) == 2 * 64 * 16  # all distinct


def _dying_peer(rank: int, port: int, queue) -> None:  # pragma: no cover - child process
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == 1:
        import os

        os._exit(0)  # dies without a word, like a SIGKILLed worker
    p2p = P2P(rank=0, device=torch.device("cpu"), timeout=20, post_early=True)
    try:
        p2p.recv("grad", 3, 1, what="the receive of the gradient of microbatch 3 at stage 0")
        queue.put("no error")
    except Exception as exc:
        queue.put(f"{type(exc).__name__}: {exc}")


def test_dead_peer_gives_a_message_naming_the_wait() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_dying_peer, args=(r, port, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        message = queue.get(timeout=60)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert message.startswith(
        "PeerTimeoutError: rank 0: the receive of the gradient of microbatch 3 at stage 0"
    ), message
    assert "the peer probably died" in message or "timed out" in message
