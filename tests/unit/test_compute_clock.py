"""``ComputeClock``: a rank's compute time, from host clocks on the CPU and CUDA events on a
GPU. The GPU's events are simulated here: a stream whose queued work the GPU finishes later."""

from __future__ import annotations

import pytest
import torch

from pipedream.runtime import compute_clock
from pipedream.runtime.compute_clock import ComputeClock


class _FakeGPU:
    """One stream: ``queued`` ms of work issued so far, of which the GPU has done ``done``."""

    def __init__(self) -> None:
        self.queued = 0.0
        self.done = 0.0
        self.events_made = 0
        self.waits = 0


class _FakeEvent:
    gpu: _FakeGPU

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.gpu.events_made += 1
        self.at: float | None = None

    def record(self) -> None:
        assert self.at is None or self.query(), "recorded again while the GPU had not passed it"
        self.at = self.gpu.queued

    def query(self) -> bool:
        assert self.at is not None
        return self.at <= self.gpu.done

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event the GPU has not passed"
        assert self.at is not None and end.at is not None
        return end.at - self.at

    def synchronize(self) -> None:
        assert self.at is not None
        self.gpu.done = max(self.gpu.done, self.at)
        self.gpu.waits += 1


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> _FakeGPU:
    fake = _FakeGPU()
    event = type("Event", (_FakeEvent,), {"gpu": fake})
    monkeypatch.setattr(compute_clock.torch.cuda, "Event", event)
    return fake


def test_on_a_gpu_it_sums_the_actions_gpu_time_without_waiting_and_reuses_its_events(
    gpu: _FakeGPU,
) -> None:
    """300 actions of 2 ms with 1 ms between them on the GPU, which runs 3 actions behind the
    host: their 600 ms are summed, read as the GPU passes them (no wait before the end), and
    10 events serve them all: the pairs of the 4 actions the GPU has not passed and of the one
    being recorded, each recorded again once read (not 600 events made and destroyed)."""
    clock = ComputeClock(torch.device("cuda"))
    for _ in range(300):
        clock.start()
        gpu.queued += 2.0
        clock.stop()
        gpu.queued += 1.0
        gpu.done = max(0.0, gpu.queued - 9.0)
    assert gpu.waits == 0
    assert clock.seconds == pytest.approx(0.6)
    assert gpu.waits > 0  # the pairs still in flight, read at the end
    assert gpu.events_made == 2 * (4 + 1)


def test_on_the_cpu_it_sums_host_time(monkeypatch: pytest.MonkeyPatch) -> None:
    now = iter([10.0, 10.5, 11.0, 11.25])
    monkeypatch.setattr(compute_clock.time, "perf_counter", lambda: next(now))
    clock = ComputeClock(torch.device("cpu"))
    for _ in range(2):
        clock.start()
        clock.stop()
    assert clock.seconds == pytest.approx(0.75)
