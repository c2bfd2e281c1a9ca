"""The p2p transport on 2 gloo processes: headers carry shape, dtype, version and how the payload
travels; receives posted ahead (gloo, speculative once a channel's reference is known) and in
order (the NCCL discipline) both deliver every message intact and leave nothing outstanding."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipedream.runtime import comm
from pipedream.runtime.comm import CHANGED as C
from pipedream.runtime.comm import DEFINES_REFERENCE as D
from pipedream.runtime.comm import FAST as F
from pipedream.runtime.comm import P2P
from pipedream.runtime.comm import PLACEHOLDER as P
from pipedream.runtime.train import IN_ORDER_ENV

from runs import train_and_load

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


Message = tuple[str, int, list[torch.Tensor], int]

FLAGS = {"act": [D, F, F, P, F, P, F, P, P, F], "grad": [D, F, P, P, F]}
"""The header flags each channel's messages must arrive with (the sender's choice) when
receives are posted ahead; without, a changed shape comes as CHANGED (no placeholder)."""


def _expected_flags(post_early: bool, nccl: bool) -> dict[str, list[int]]:
    if nccl:  # nothing is posted ahead, and the headers say what comes, every time
        return {k: [C] * len(v) for k, v in FLAGS.items()}
    return {k: [f if post_early or f != P else C for f in v] for k, v in FLAGS.items()}


def _messages(seed: int) -> list[Message]:
    """Two channels from rank 0 to rank 1, interleaved. act: shapes A, A, A, B, A, B', A, then
    A as float64 (a dtype change), a 0-d bool with a 0-d int16 (a dtype NCCL lacks), A; grad:
    C, C, a float64 (1,), an empty message, C. Versions are distinct."""
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(3, 4, generator=gen), torch.arange(6).view(2, 3)]
    b = [torch.randn(2, 5, 7, generator=gen)]
    b2 = [torch.randn(3, 4, generator=gen), torch.arange(6).view(3, 2)]
    c = [torch.randn(3, 4, generator=gen).to(torch.bfloat16)]
    acts = [a, [t + 1 for t in a], [t + 2 for t in a], b, [t * 3 for t in a], b2]
    flags = [torch.tensor(True), torch.tensor(-300, dtype=torch.int16)]
    acts += [[t - 1 for t in a], [a[0].double(), a[1]], flags, [t - 2 for t in a]]
    grads = [c, [c[0] + 1], [torch.randn(1, generator=gen).double()], [], [c[0] * 2]]
    out: list[Message] = []
    for mb, tensors in enumerate(acts):
        out.append(("act", mb, tensors, 10 + mb))
        if mb < len(grads):
            out.append(("grad", mb, grads[mb], 100 + mb))
    return out


def _again(seed: int) -> list[Message]:
    """The same microbatches (so the same tags) again, every message of its channel's
    reference specs, with new values: all FAST, speculative where posted ahead."""
    gen = torch.Generator().manual_seed(seed)
    first = _messages(0)
    references = {kind: next(t for k, _, t, _ in first if k == kind) for kind in FLAGS}
    out: list[Message] = []
    for kind, mb, _, version in first:
        fresh = [torch.randint(-9, 9, t.shape, generator=gen).to(t.dtype) for t in references[kind]]
        out.append((kind, mb, fresh, version + 1000))
    return out


def _receive_order(messages: list[Message], out_of_order: bool) -> list[Message]:
    """Each channel in its send order (the protocol needs it); out of order (posted ahead, where
    tags keep channels apart; and NCCL's discipline, which reads ahead), the grad channel goes
    first; otherwise as sent."""
    if not out_of_order:
        return messages
    return [m for m in messages if m[0] == "grad"] + [m for m in messages if m[0] == "act"]


WINDOW = 3
"""Messages the receiver posts ahead of the one it receives (like the executor's lookahead)."""


def _receive(p2p: P2P, messages: list[Message], known: set[str]) -> tuple[list[int], list[str]]:
    """Receive ``messages`` posting ``WINDOW`` ahead, checking each; ``known``: the channels
    whose reference this receiver has (updated). Returns the header flags and the problems."""
    flags: list[int] = []
    decode = comm.decode_header

    def recording(header: torch.Tensor) -> comm.Header:
        decoded = decode(header)
        flags.append(decoded.flags)
        return decoded

    comm.decode_header = recording  # this child process only
    problems = []
    for i, (kind, mb, tensors, version) in enumerate(messages):
        for ahead, ahead_mb, _, _ in messages[i : i + WINDOW + 1]:
            p2p.post_recv(ahead, ahead_mb, 0)
        incoming = p2p._incoming.get((kind, mb, 0))
        speculative = None if incoming is None else incoming.speculative
        # posted ahead: speculative receives for every message after its channel's first
        if (speculative is not None) != (p2p.post_early and kind in known):
            problems.append(f"{kind} {mb}: speculative receives: {speculative}")
        reference = p2p._received_reference.get((kind, 0))
        if speculative is not None and comm.specs_of(speculative.buffers) != reference:
            problems.append(f"{kind} {mb}: speculative buffers not of the reference {reference}")
        got, got_version = p2p.recv(kind, mb, 0, what="test")
        if any(g.device != p2p.device for g in got):
            problems.append(f"{kind} {mb}: received on {[g.device for g in got]}")
        got = [g.cpu() for g in got]
        known.add(kind)
        same = len(got) == len(tensors) and all(
            g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, t)
            for g, t in zip(got, tensors)
        )
        if got_version != version or not same:
            problems.append(f"{kind} {mb}: got version {got_version}, tensors {got}")
    comm.decode_header = decode
    return flags, problems


def _flags_by_channel(messages: list[Message], flags: list[int]) -> dict[str, list[int]]:
    return {k: [f for (kind, *_), f in zip(messages, flags) if kind == k] for k in FLAGS}


def _groups_of_parts(header_group, payload_group) -> list[str]:  # pragma: no cover - child
    """Record, for every isend/irecv of this process, whether its part (header or payload)
    went on the group it belongs on: headers on ``header_group``, payloads on
    ``payload_group`` (both None: the default group), and on NCCL's payload group only in a
    dtype NCCL has (ProcessGroupNCCL refuses int16)."""
    wrong: list[str] = []
    isend, irecv = dist.isend, dist.irecv

    def check(name: str, tensor: torch.Tensor, tag: int, group) -> None:
        header = tag % comm.PARTS == 0
        if group is not (header_group if header else payload_group):
            wrong.append(f"{name} tag {tag} on {group}")
        if payload_group is not None and not header and tensor.dtype == torch.int16:
            wrong.append(f"{name} tag {tag}: an int16 payload, which NCCL cannot move")

    def checked_isend(tensor, dst, group=None, tag=0):
        check("isend", tensor, tag, group)
        return isend(tensor, dst=dst, group=group, tag=tag)

    def checked_irecv(tensor, src, group=None, tag=0):
        check("irecv", tensor, tag, group)
        return irecv(tensor, src=src, group=group, tag=tag)

    dist.isend, dist.irecv = checked_isend, checked_irecv
    return wrong


def _worker(
    rank: int, port: int, post_early: bool, staged: bool, nccl: bool, queue
) -> None:  # pragma: no cover - child
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    device = torch.device("cuda" if staged and torch.cuda.is_available() else "cpu")
    # NCCL's discipline on gloo groups: the headers on a group of their own, the payloads on
    # one group per direction
    header_group = dist.new_group(backend="gloo") if nccl else None
    payload_groups = {(0, 1): dist.new_group([0, 1]), (1, 0): dist.new_group([0, 1])}
    wrong = _groups_of_parts(header_group, payload_groups[(0, 1)] if nccl else None)
    p2p = P2P(
        rank=rank,
        device=device,
        timeout=20,
        post_early=post_early,
        staged=staged,
        nccl=nccl,
        header_group=header_group,
        payload_groups=payload_groups if nccl else None,
    )
    rounds = [_messages(0), _again(1)]
    try:
        if rank == 0:
            for messages in rounds:
                for kind, mb, tensors, version in messages:
                    p2p.send(kind, mb, 1, [t.to(device) for t in tensors], version)
                p2p.drain(what="sends")
                dist.barrier()  # the receiver checks for leftovers after each round
            queue.put(("sender", (["sends left after drain"] if p2p._outgoing else []) + wrong))
        else:
            known: set[str] = set()
            first, second = (_receive_order(m, post_early or nccl) for m in rounds)
            flags, problems = _receive(p2p, first, known)
            expected = _expected_flags(post_early, nccl)
            if _flags_by_channel(first, flags) != expected:
                problems.append(f"header flags {_flags_by_channel(first, flags)}, not {expected}")
            if p2p._incoming or p2p._arrived:
                left = [*p2p._incoming, *p2p._arrived]
                problems.append(f"receives left after the first round: {left}")
            dist.barrier()
            flags, more = _receive(p2p, second, known)
            problems += more
            if flags != [C if nccl else F] * len(second) or p2p._incoming or p2p._arrived:
                left = [*p2p._incoming, *p2p._arrived]
                problems.append(f"second round: flags {flags}, left {left}")
            dist.barrier()
            queue.put(("receiver", problems + wrong))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("post_early", "staged", "nccl"),
    [(True, False, False), (False, False, False), (True, True, False), (False, False, True)],
)
def test_messages_round_trip(post_early: bool, staged: bool, nccl: bool) -> None:
    """Shape, count and dtype changes on a channel round-trip bit-exactly with their versions,
    each with the header flag the protocol prescribes; receives are speculative once a
    channel's reference is known; afterwards nothing is outstanding: the same tags carry a
    second round of messages intact (a dangling receive or placeholder would take one).
    ``staged``: through host memory, as ranks sharing a GPU talk (from and to the GPU where
    there is one). ``nccl``: the NCCL transport's discipline on gloo groups (headers on a group
    of their own, numbered, so that reading one never waits for the GPU; payloads on a group
    per direction), the receiver taking the grad channel first, ahead of the send order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    args = (port, post_early, staged, nccl, queue)
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        results = dict(queue.get(timeout=90) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert results == {"sender": [], "receiver": []}
    assert all(proc.exitcode == 0 for proc in procs)


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


@pytest.mark.parametrize(
    ("schedule", "microbatches", "placement", "replicas"),
    [("zbv", 4, (0, 1, 1, 0), None), ("1f1b", 2, None, [1, 2, 1, 1])],
    ids=["zbv", "1f1b-replicas"],
)
def test_the_nccl_transport_trains_what_gloos_does(
    tmp_path: Path,
    schedule: str,
    microbatches: int,
    placement: tuple[int, ...] | None,
    replicas: list[int] | None,
) -> None:
    """The whole runtime with NCCL's discipline on gloo (``PIPEDREAM_IN_ORDER_P2P=1``: a group
    per direction created from the plan's routes, headers numbered on their own group and read
    ahead, nothing posted ahead) ends on the bits the gloo transport ends on. zbv receives
    payloads in another order than they were sent; the two replicas of stage 1 take turns with
    the ranks on either side (routes 0-1, 0-2, 1-3, 2-3 and back)."""
    stages = [["0"], ["1"], ["2"], ["3"]]
    runs = {
        name: train_and_load(
            tmp_path,
            stages,
            steps=6,
            schedule=schedule,
            microbatches=microbatches,
            workload_args={"layers": "3", "width": "16", "lr": "0.1", "momentum": "0.5"},
            placement=placement,
            replicas=replicas,
            name=name,
            env=env,
        )
        for name, env in (("gloo", {}), ("in-order", {IN_ORDER_ENV: "1"}))
    }
    assert runs["gloo"].keys() == runs["in-order"].keys()
    assert all(torch.equal(runs["gloo"][k], runs["in-order"][k]) for k in runs["gloo"])
