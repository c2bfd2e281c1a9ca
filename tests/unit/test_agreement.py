"""Ranks agree on how their setup went through the rendezvous store (runtime/agreement.py)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from pipedream.errors import AlreadyReported, PipedreamError
from pipedream.runtime.agreement import agree_on_setup

TIMEOUT = timedelta(seconds=20)


class _SlowReader:
    """A rank's store whose reads come late (a loaded host): each ``get`` waits first."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.store.wait(keys, timeout)

    def get(self, key: str) -> bytes:
        time.sleep(0.3)
        return bytes(self.store.get(key))


@pytest.mark.parametrize("failure", [None, PipedreamError("no such layer 'x'")])
def test_rank_0_hosting_the_store_waits_until_every_rank_has_read(
    failure: PipedreamError | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where rank 0 hosts the store and exits right after agreeing (nothing to do, a refused
    setup), a slower rank read from a closed store: 'Connection reset by peer'."""
    host = dist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT)  # a free port
    port = host.port
    outcome: dict[str, BaseException | None] = {}

    def rank_1() -> None:
        client = dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
        try:
            agree_on_setup(
                _SlowReader(client), failure, rank=1, world_size=2, local_rank=1, timeout=TIMEOUT
            )
            outcome["rank 1"] = None
        except BaseException as exc:  # asserted below, in the test thread
            outcome["rank 1"] = exc

    thread = threading.Thread(target=rank_1)
    thread.start()
    try:
        agree_on_setup(host, failure, rank=0, world_size=2, local_rank=0, timeout=TIMEOUT)
    except AlreadyReported:
        pass
    del host  # rank 0 exits: its store's server stops
    thread.join(timeout=30)
    assert not thread.is_alive()
    if failure is None:
        assert outcome["rank 1"] is None
    else:
        assert isinstance(outcome["rank 1"], AlreadyReported), outcome["rank 1"]
        assert capsys.readouterr().err == "pipedream train: error: no such layer 'x'\n"
