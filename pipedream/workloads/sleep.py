"""``sleep``: layers that sleep a fixed time in forward and backward, for schedule benchmarks.

Each layer sleeps ``forward_ms`` in forward and ``backward_ms`` in backward (custom autograd
functions) and otherwise does (almost) nothing, so a pipeline of many stages fits on a couple of
CPU cores: the measured time of a run minus its ideal time is the overhead of the schedule, the
runtime and the communication, not contention for compute. ``activation_bytes`` sets the size
of the tensor every layer outputs (and so of every message between stages), e.g. 32 KiB or
32 MiB per microbatch.

Split backwards (zero-bubble schedules): ``weight_ms`` of a layer's ``backward_ms`` is its weight
gradient (``W``), the rest its input gradient (``I``; default: half each). The two parts are
separate autograd nodes (one on the layer's input alone, one on its weight alone), so a whole
backward sleeps ``backward_ms`` and each half of a split one sleeps its part. The first layer,
whose input needs no gradient, spends its whole ``backward_ms`` on the weight.

The math is exact and trivial, chosen so that no step touches a large tensor:

* layer 0 maps the (tiny) input to a constant activation of ``activation_bytes``: a cached
  zero tensor, ``y = 0 * x + 0 * w``;
* every other layer is the identity, returned as a view of its input: ``y = x + 0 * w``;
* the loss is ``0 * <output, 1>`` = 0, so every gradient is exactly zero; the gradient of the
  output is a cached zero tensor, passed through each layer without copying.

Each layer has one scalar weight ``w`` (exact gradient 0) so that the runtime has parameters to
version, stash, average and update like in any other model.

A sleep lasts its nominal time as exactly as the host allows (:func:`precise_sleep`): the
kernel wakes a plain ``time.sleep`` some 0.1 ms late or more (timer slack, scheduling), which
on 20 ms layers would be charged to the runtime as overhead it does not have.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from pipedream.errors import WorkloadError
from pipedream.workload import Workload
from pipedream.workloads.common import optimizer_factory

__all__ = ["LATENESS", "MAX_SLEEP_MS", "SleepLayer", "build", "precise_sleep", "zero_loss"]

MAX_SLEEP_MS = 3_600_000.0
"""A layer's forward or backward sleeps at most an hour (inf and nan reached ``time.sleep``)."""

_ZEROS: dict[tuple[tuple[int, ...], torch.dtype, str], Tensor] = {}


class _Lateness:
    """How late the kernel wakes this process from a sleep: a running mean of the last ones."""

    WEIGHT = 0.1
    """Weight of the newest lateness in the mean (about the last 10 count)."""

    def __init__(self, initial_s: float = 0.0001) -> None:
        self.seconds = initial_s

    def add(self, late_s: float) -> None:
        # one sleep that a busy host delayed by milliseconds would make the next ones early
        late_s = min(max(late_s, 0.0), 4 * self.seconds + 0.0005)
        self.seconds += self.WEIGHT * (late_s - self.seconds)


LATENESS = _Lateness()
"""This process's kernel lateness, learnt by :func:`precise_sleep`."""


def precise_sleep(seconds: float) -> None:
    """Wait ``seconds``: sleep until the kernel's expected lateness before the deadline, then
    poll the clock for what is left.

    The kernel wakes a sleeping process some 0.1 ms late on an idle host, and more when the
    cores are busy. Polling the whole last stretch of every sleep would cost each process that
    much CPU, taken from the others on a host with fewer cores than processes; so the sleep is
    cut short by the running mean of its recent lateness (:data:`LATENESS`) and only what
    remains is polled, a few tens of microseconds in the mean. A host too busy to wake the
    process in time still makes it late: that lateness is real (the host's) and is measured.
    """
    deadline = time.perf_counter() + seconds
    early = LATENESS.seconds
    if seconds > early:
        time.sleep(seconds - early)
        LATENESS.add(time.perf_counter() - (deadline - early))
    while time.perf_counter() < deadline:
        pass


def _cached_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """One zero tensor per shape, dtype and device, never written to after creation.

    Allocating and filling a large tensor costs CPU time (the kernel faults in and zeroes every
    page), which would be charged to the first and last stage on every microbatch.
    """
    key = (shape, dtype, str(device))
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return _ZEROS[key]


class _SleepForward(torch.autograd.Function):
    """``y = x`` (a view; or a constant zero activation) after sleeping the forward; its
    backward passes the gradient on without sleeping (the input's part sleeps in a hook on
    ``x``, the weight's in :class:`_SleepWeight`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight_term: Tensor, layer: SleepLayer) -> Tensor:
        precise_sleep(layer.forward_s)
        ctx.layer = layer
        ctx.x_needs_grad = x.requires_grad
        ctx.term = (weight_term.dtype, weight_term.device)
        if tuple(x.shape) == layer.shape:
            return x.view_as(x)
        return _cached_zeros(layer.shape, weight_term.dtype, weight_term.device).view(layer.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor, None]:
        passes = ctx.x_needs_grad and tuple(grad.shape) == ctx.layer.shape
        dtype, device = ctx.term
        return (grad if passes else None), torch.zeros((), dtype=dtype, device=device), None


class _SleepInput(torch.autograd.Function):
    """``x`` (a view) whose backward, the input's gradient, sleeps the input's part."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        precise_sleep(ctx.seconds)
        return grad, None


class _SleepWeight(torch.autograd.Function):
    """``0 * w``, whose backward (the weight gradient, exactly 0) sleeps the weight's part."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        precise_sleep(ctx.seconds)
        return torch.zeros((), dtype=grad.dtype, device=grad.device), None


class SleepLayer(nn.Module):
    """Sleeps ``forward_ms`` in forward and ``backward_ms`` in backward; outputs ``shape``."""

    def __init__(
        self,
        shape: tuple[int, ...],
        *,
        forward_ms: float,
        backward_ms: float,
        weight_ms: float | None = None,
    ) -> None:
        super().__init__()
        self.shape = tuple(shape)
        self.forward_s = forward_ms / 1000
        self.backward_s = backward_ms / 1000
        self.weight_s = (backward_ms / 2 if weight_ms is None else weight_ms) / 1000
        """Of the backward, the weight gradient's sleep (a split backward's ``W``)."""
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] != self.shape[0]:  # the last microbatch of torch's chunking may differ
            raise ValueError(f"sleep layer expects a microbatch of {self.shape[0]}, got {x.shape}")
        if x.requires_grad:
            # autograd runs this node only for the input's gradient (a whole backward, or a
            # split one's input half), never for the weight's alone
            x = _SleepInput.apply(x, self.backward_s - self.weight_s)
            weight_s = self.weight_s
        else:  # nothing to compute for the input: the whole backward is the weight's
            weight_s = self.backward_s
        weight_term = _SleepWeight.apply(self.weight, weight_s)
        return _SleepForward.apply(x, weight_term, self)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return (
            f"shape={self.shape}, forward_ms={self.forward_s * 1000:g}, "
            f"backward_ms={self.backward_s * 1000:g}"
        )


class _ZeroLoss(torch.autograd.Function):
    """``0 * <output, 1>``: value 0, gradient a cached zero tensor shaped like the output."""

    @staticmethod
    def forward(ctx: Any, output: Tensor) -> Tensor:
        ctx.meta = (tuple(output.shape), output.dtype, output.device)
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        shape, dtype, device = ctx.meta
        return _cached_zeros(shape, dtype, device)


def zero_loss(output: Tensor, target: Tensor) -> Tensor:
    """The sleep workload's loss: exactly 0, with an exactly zero (cached) gradient."""
    del target
    return _ZeroLoss.apply(output)  # type: ignore[no-any-return]


class _TinyDataset(Dataset[tuple[Tensor, Tensor]]):
    """``samples`` items of one float input and one float target (the values never matter)."""

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self._item = (torch.zeros(1), torch.zeros(1))

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self._item


def build(
    layers: int = 4,
    forward_ms: float = 10.0,
    backward_ms: float = 20.0,
    activation_bytes: int = 32 * 1024,
    samples: int = 256,
    lr: float = 0.01,
    microbatch_size: int = 8,
    weight_ms: float | None = None,
) -> Workload:
    """Build the sleep workload: ``layers`` sleep layers whose outputs are ``activation_bytes``.

    ``activation_bytes`` is per microbatch and must be a multiple of ``4 * microbatch_size``
    (float32 values, one row per sample).
    """
    if layers < 1 or samples < 1 or microbatch_size < 1:
        raise WorkloadError(
            f"sleep: layers, samples and microbatch_size must be >= 1, got {layers}, "
            f"{samples}, {microbatch_size}"
        )
    if not all(0 <= ms <= MAX_SLEEP_MS for ms in (forward_ms, backward_ms)):
        raise WorkloadError(
            f"sleep: forward_ms and backward_ms must be 0 to {MAX_SLEEP_MS:.0f} (an hour), got "
            f"{forward_ms}, {backward_ms}"
        )
    if weight_ms is not None and not 0 <= weight_ms <= backward_ms:
        raise WorkloadError(
            f"sleep: weight_ms={weight_ms} must be between 0 and backward_ms={backward_ms} (the "
            "weight gradient's part of the backward)"
        )
    row = 4 * microbatch_size
    if activation_bytes < row or activation_bytes % row:
        raise WorkloadError(
            f"sleep: activation_bytes={activation_bytes} must be a positive multiple of "
            f"4 * microbatch_size = {row} (float32 rows, one per sample); e.g. 32768 or 33554432"
        )
    shape = (microbatch_size, activation_bytes // row)
    model = nn.Sequential(
        *(
            SleepLayer(shape, forward_ms=forward_ms, backward_ms=backward_ms, weight_ms=weight_ms)
            for _ in range(layers)
        )
    )
    return Workload(
        model=model,
        example_input=torch.zeros(microbatch_size, 1),
        loss_fn=zero_loss,
        dataset=_TinyDataset(samples),
        optimizer=optimizer_factory("sgd", lr=lr),
        description=(
            f"{layers} sleep layers ({forward_ms:g} ms forward, {backward_ms:g} ms backward, "
            f"{activation_bytes} bytes out per microbatch)"
        ),
    )
