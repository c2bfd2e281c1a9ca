"""The ``sleep`` workload: its layers really sleep in forward and backward, its activations have
exactly the requested size, and its math is the documented identity with zero gradients.

Timing bounds are loose (lower bounds are what a sleep guarantees; the upper bounds only catch
a layer that sleeps far too long), since the test machine is shared.
"""

from __future__ import annotations

import time

import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.errors import WorkloadError
from pipedream.workload import BUILTIN_WORKLOADS, load_workload


def _build(**args: object):
    return load_workload("sleep", {k: str(v) for k, v in args.items()}, microbatch_size=4)


def test_registered_as_builtin() -> None:
    assert BUILTIN_WORKLOADS["sleep"] == "pipedream.workloads.sleep:build"


@pytest.mark.parametrize("activation_bytes", [32 * 1024, 32 * 1024 * 1024])
def test_output_size_is_exact(activation_bytes: int) -> None:
    workload = _build(layers=2, forward_ms=0, backward_ms=0, activation_bytes=activation_bytes)
    inputs, _ = MicrobatchStream(workload.dataset, 4, seed=0).microbatch(0)
    x = inputs
    for layer in workload.model:
        x = layer(x)
        assert x.dtype == torch.float32
        assert x.shape == (4, activation_bytes // 16)
        assert x.numel() * x.element_size() == activation_bytes


def test_layers_sleep_in_forward_and_backward() -> None:
    workload = _build(layers=3, forward_ms=30, backward_ms=60, activation_bytes=4096)
    inputs, targets = MicrobatchStream(workload.dataset, 4, seed=0).microbatch(0)
    start = time.perf_counter()
    output = workload.model(inputs)
    forward = time.perf_counter() - start
    loss = workload.loss_fn(output, targets)
    start = time.perf_counter()
    loss.backward()
    backward = time.perf_counter() - start
    assert 0.09 <= forward < 0.09 * 4 + 0.5, forward
    assert 0.18 <= backward < 0.18 * 4 + 0.5, backward


def test_a_sleep_ends_at_its_deadline_not_when_the_kernel_wakes_it(monkeypatch) -> None:
    """A sleep is cut short by the kernel's learnt lateness and the rest is waited for on the
    clock: with a kernel that always oversleeps by 0.3 ms (a stand-in), the first sleeps end
    late by what the lateness estimate lacks, the later ones at their deadline with little
    polling, and none is early."""
    from pipedream.workloads import sleep

    clock = [0.0]
    readings = [0]

    def fake_sleep(seconds: float) -> None:
        clock[0] += seconds + 0.0003

    def fake_clock() -> float:
        readings[0] += 1
        clock[0] += 1e-7
        return clock[0]

    monkeypatch.setattr(sleep.time, "sleep", fake_sleep)
    monkeypatch.setattr(sleep.time, "perf_counter", fake_clock)
    monkeypatch.setattr(sleep, "LATENESS", sleep._Lateness(0.0001))
    overshoot = []
    for _ in range(60):
        start = clock[0]
        readings[0] = 0
        sleep.precise_sleep(0.020)
        overshoot.append(clock[0] - start - 0.020)
    assert all(o >= 0 for o in overshoot)
    assert overshoot[0] == pytest.approx(0.0002, abs=2e-6)  # 0.3 late, 0.1 expected
    assert sleep.LATENESS.seconds == pytest.approx(0.0003, rel=0.01)
    assert max(overshoot[-10:]) < 1e-5  # at the deadline now
    # and the clock was read a few times, not polled for the whole of the lateness
    assert readings[0] < 100


def test_math_is_identity_with_zero_gradients() -> None:
    workload = _build(layers=3, forward_ms=0, backward_ms=0, activation_bytes=64)
    x = torch.randn(4, 4, requires_grad=True)
    assert torch.equal(workload.model[1:](x), x)  # layers after the first are the identity
    inputs, targets = MicrobatchStream(workload.dataset, 4, seed=0).microbatch(0)
    out = workload.model(inputs)
    assert torch.count_nonzero(out) == 0  # the first layer outputs a constant zero activation
    loss = workload.loss_fn(out, targets)
    assert loss.item() == 0.0
    loss.backward()
    params = list(workload.model.parameters())
    assert len(params) == 3  # one scalar weight per layer, so the runtime has state to update
    assert all(p.grad is not None and p.grad.item() == 0.0 for p in params)
    before = [p.detach().clone() for p in params]
    optimizer = workload.optimizer(params)
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize(
    "args",
    [
        {"activation_bytes": 10},  # not a multiple of 4 * microbatch_size
        {"activation_bytes": 0},
        {"layers": 0},
        {"forward_ms": -1},
    ],
)
def test_bad_options(args: dict[str, object]) -> None:
    with pytest.raises(WorkloadError, match="sleep"):
        _build(**args)
