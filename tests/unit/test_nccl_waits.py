"""On NCCL the transport never blocks the host on the GPU: payload waits are stream waits.

``Work.wait(timeout=...)`` on an NCCL work blocks the calling thread until the GPU has finished
the transfer (PyTorch's ProcessGroupNCCL polls it); ``Work.wait()`` only makes the current stream
wait. Headers travel on gloo and are waited on the host, with the timeout. Checked with works
that record how they were waited on (no NCCL here)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipedream.runtime.comm import P2P, PeerTimeoutError, _Receives
from pipedream.runtime.executor import wait_collective


class _Work:
    def __init__(self) -> None:
        self.waits: list[dict[str, Any]] = []

    def wait(self, **kwargs: Any) -> bool:
        self.waits.append(kwargs)
        return True


def _p2p(*, nccl: bool) -> P2P:
    return P2P(
        rank=0,
        device=torch.device("cpu"),
        timeout=7,
        post_early=False,
        nccl=nccl,
        header_group=object() if nccl else None,
        payload_groups={} if nccl else None,
    )


def test_nccl_payloads_are_stream_waits_and_headers_host_waits() -> None:
    p2p = _p2p(nccl=True)
    payload, header, send, header_send = _Work(), _Work(), _Work(), _Work()
    p2p._wait_all(_Receives([torch.zeros(1)], [payload]), "a payload")
    p2p._wait(header, "a header", on_host=True)
    p2p._outgoing.append([(header_send, torch.zeros(1), True), (send, torch.zeros(1), False)])
    p2p.drain(what="the sends")
    assert payload.waits == [{}] and send.waits == [{}]
    assert header.waits == [{"timeout": timedelta(seconds=7)}] == header_send.waits


def test_gloo_waits_on_the_host_with_the_timeout() -> None:
    p2p = _p2p(nccl=False)
    payload = _Work()
    p2p._wait_all(_Receives([torch.zeros(1)], [payload]), "a payload")
    assert payload.waits == [{"timeout": timedelta(seconds=7)}]


def test_replica_allreduces_are_stream_waits_on_nccl_and_timed_host_waits_on_gloo() -> None:
    """The buckets' allreduce waits (``wait_collective``): no timeout on NCCL (a timeout would
    block the host until the GPU is done), the run's on gloo; a wait that times out or fails
    names the rank and what it waited for."""
    nccl, gloo = _Work(), _Work()
    wait_collective(nccl, "the allreduce", rank=3, nccl=True, timeout=7)
    wait_collective(gloo, "the allreduce", rank=3, nccl=False, timeout=7)
    assert nccl.waits == [{}] and gloo.waits == [{"timeout": timedelta(seconds=7)}]

    class _TimedOut(_Work):
        def wait(self, **kwargs: Any) -> bool:
            return False

    class _Failed(_Work):
        def wait(self, **kwargs: Any) -> bool:
            raise RuntimeError("connection reset by peer")

    with pytest.raises(PeerTimeoutError, match="rank 3: timed out waiting for the allreduce"):
        wait_collective(_TimedOut(), "the allreduce", rank=3, nccl=False, timeout=7)
    with pytest.raises(PeerTimeoutError, match="rank 3: the allreduce failed: connection reset"):
        wait_collective(_Failed(), "the allreduce", rank=3, nccl=True, timeout=7)


def test_every_group_waits_the_runs_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream wait ends only by its group's timeout, and ``new_group`` does not inherit the
    default group's: left alone, a replica's allreduce or a payload that never completes would
    hold an NCCL run for torch's 10 minutes (30 on gloo) instead of ``--timeout``."""
    from pipedream.formats.plan import Plan
    from pipedream.runtime import train

    made: list[tuple[Any, dict[str, Any]]] = []

    def new_group(ranks: Any = None, **kwargs: Any) -> int:
        made.append((ranks, kwargs))
        return len(made)

    monkeypatch.setattr(train.dist, "new_group", new_group)
    plan = Plan.from_dict(
        {
            "format": "pipedream/plan@1",
            "workload": "mlp",
            "workload_args": {},
            "schedule": "1f1b",
            "microbatch_size": 4,
            "microbatches": 2,
            "world_size": 4,
            "stages": [
                {"first_layer": f"l{i}", "last_layer": f"l{i}", "replicas": len(r), "ranks": r}
                for i, r in enumerate([[0], [1, 2], [3]])
            ],
        }
    )
    layout: Any = SimpleNamespace(edges=None, tied_pairs=())
    seven = timedelta(seconds=7)
    groups = train._new_groups(plan, layout, in_order=True, clip=False, timeout=seven)
    replicas, header, payloads, norm = groups
    assert replicas == {1: 1} and header == 2 and norm is None
    assert sorted(payloads) == [(0, 1), (0, 2), (1, 0), (1, 3), (2, 0), (2, 3), (3, 1), (3, 2)]
    assert made[:2] == [([1, 2], {"timeout": seven}), (None, {"backend": "gloo", "timeout": seven})]
    assert all(kwargs == {"timeout": seven} for _, kwargs in made[2:]) and len(made) == 10
    made.clear()
    groups = train._new_groups(plan, layout, in_order=False, clip=False, timeout=seven)
    assert groups == ({1: 1}, None, {}, None)
    assert made == [([1, 2], {"timeout": seven})]
    made.clear()  # the clip's group of all ranks waits as long
    groups = train._new_groups(plan, layout, in_order=False, clip=True, timeout=seven)
    assert groups == ({1: 1}, None, {}, 2)
    assert made == [([1, 2], {"timeout": seven}), (None, {"timeout": seven})]
