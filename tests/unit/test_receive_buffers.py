"""The CPU pool of receive buffers: storage goes out again only once nobody else holds it."""

from __future__ import annotations

import pytest
import torch

from pipedream.runtime import receive_buffers as buffers
from pipedream.runtime.receive_buffers import MAX_TRACKED, MIN_POOLED_BYTES, ReceiveBuffers

CPU = torch.device("cpu")
BIG = (MIN_POOLED_BYTES // 4,)  # float32 elements filling exactly the pooled minimum


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_released_storage_is_handed_out_again_held_storage_is_not() -> None:
    pool = ReceiveBuffers(CPU)
    first = pool.empty(torch.float32, BIG)
    first_address = _address(first)
    second = pool.empty(torch.float32, BIG)  # the first is still held: fresh storage
    assert _address(second) != first_address and pool.allocated == 2
    del first
    third = pool.empty(torch.float32, BIG)
    assert _address(third) == first_address and pool.allocated == 2
    assert (third.dtype, third.shape, third.is_contiguous()) == (torch.float32, BIG, True)
    del third
    like = pool.empty_like(second.to(torch.int32))  # same bytes, another dtype
    assert _address(like) == first_address and like.dtype == torch.int32 and like.shape == BIG


def test_views_and_autograd_keep_storage_out_of_the_pool() -> None:
    pool = ReceiveBuffers(CPU)
    received = pool.empty(torch.float32, BIG).fill_(2.0).requires_grad_()
    address = _address(received)
    loss = (received * received).sum()  # autograd saves the received tensor
    view = received.detach()[:10]
    del received
    assert _address(pool.empty(torch.float32, BIG)) != address  # saved by autograd, viewed
    del loss
    assert _address(pool.empty(torch.float32, BIG)) != address  # still viewed
    del view
    assert _address(pool.empty(torch.float32, BIG)) == address
    assert pool.allocated == 2  # the received one, and the one handed out (and dropped) twice


def test_storage_is_shared_across_dtypes_and_shapes_of_the_same_size() -> None:
    pool = ReceiveBuffers(CPU)
    address = _address(pool.empty(torch.float32, (2, BIG[0] // 2)))  # released at once
    again = pool.empty(torch.int64, (BIG[0] // 2,))
    assert _address(again) == address and again.dtype == torch.int64
    assert again.shape == (BIG[0] // 2,) and pool.allocated == 1
    other_size = pool.empty(torch.float32, (BIG[0] + 1,))
    assert _address(other_size) != address and pool.allocated == 2


def test_small_buffers_and_non_cpu_devices_are_not_pooled() -> None:
    pool = ReceiveBuffers(CPU)
    small = pool.empty(torch.float32, (BIG[0] - 1,))
    del small
    pool.empty(torch.float32, (BIG[0] - 1,))
    assert pool.allocated == 0
    assert not ReceiveBuffers(torch.device("meta")).enabled
    assert ReceiveBuffers(torch.device("meta")).empty(torch.float32, BIG).device.type == "meta"


def test_a_workload_that_keeps_every_buffer_is_followed_up_to_the_limit() -> None:
    pool = ReceiveBuffers(CPU)
    kept = [pool.empty(torch.uint8, (MIN_POOLED_BYTES,)) for _ in range(MAX_TRACKED + 3)]
    assert pool.allocated == MAX_TRACKED + 3
    assert len(pool._storages[MIN_POOLED_BYTES]) == MAX_TRACKED  # the 3 oldest forgotten
    del kept[-1]  # a followed one comes back
    assert pool.empty(torch.uint8, (MIN_POOLED_BYTES,)) is not None
    assert pool.allocated == MAX_TRACKED + 3


@pytest.mark.parametrize("why", ["no reference counts", "PIPEDREAM_KEEP_HOST_MEMORY=0"])
def test_the_pool_can_be_off_and_then_allocates_afresh(
    monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    if why == "no reference counts":
        monkeypatch.setattr(buffers, "_use_count", None)
    else:
        monkeypatch.setenv("PIPEDREAM_KEEP_HOST_MEMORY", "0")
    pool = ReceiveBuffers(CPU)
    assert not pool.enabled
    del_me = pool.empty(torch.float32, BIG)
    del del_me
    pool.empty(torch.float32, BIG)
    assert pool.allocated == 0
