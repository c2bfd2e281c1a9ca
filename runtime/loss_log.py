"""The last stage's losses, read from the device in batches.

Reading a loss on the host (``float(loss)``, ``bool(torch.isfinite(loss))``) waits for the GPU to
finish everything queued before it: once per microbatch, that keeps the GPU from running ahead
of the Python code that feeds it. So on a GPU the last stage keeps each microbatch's loss where it
was computed and reads them all with one transfer every :data:`GPU_READ_EVERY` updates and at
the end of every segment (before a checkpoint is written): there it checks that they are finite
(:class:`~pipedream.runtime.stage_worker.NonFiniteLossError` names the first microbatch that is not)
and logs each update's mean loss with the host time at which the update was issued. On the CPU,
where a read costs nothing, it reads after every update.

``--on-nonfinite skip`` must decide at once (the microbatch's gradient travels back as a skip),
so there the worker still checks every loss when it is computed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipedream.runtime.metrics import MetricsLogger
from pipedream.runtime.stage_worker import NonFiniteLossError

__all__ = ["GPU_READ_EVERY", "LossLog"]

GPU_READ_EVERY = 32
"""Updates between two reads of the losses on a GPU."""


@dataclass
class _Update:
    step: int
    microbatches: list[int]
    losses: list[Tensor]
    issued: float
    cpu: float
    """The issuing thread's CPU time at the update (``time.thread_time()``)."""
    grad_norm: Tensor | None = None
    """The whole model's gradient norm before clipping (``--clip-grad-norm``, fp16)."""
    skipped: bool = False
    """fp16 skipped the update for an overflow."""


class LossLog:
    """Losses of the updates not yet read, and where they go once read."""

    def __init__(
        self, logger: MetricsLogger | None, *, microbatches: int, device: torch.device
    ) -> None:
        self.logger = logger
        self.microbatches = microbatches
        self.read_every = 1 if device.type == "cpu" else GPU_READ_EVERY
        self._pending: list[_Update] = []

    def add(
        self,
        step: int,
        losses: Sequence[tuple[int, Tensor]],
        *,
        grad_norm: Tensor | None = None,
        skipped: bool = False,
    ) -> None:
        """An update was issued: its microbatches' losses, ``(microbatch, device tensor)``,
        with a global norm (clipping, fp16) the whole model's gradient norm (a device tensor),
        and whether fp16 skipped it for an overflow."""
        if losses:
            microbatches = [microbatch for microbatch, _ in losses]
            tensors = [loss for _, loss in losses]
            issued, cpu = time.perf_counter(), time.thread_time()
            update = _Update(step, microbatches, tensors, issued, cpu, grad_norm, skipped)
            self._pending.append(update)
        if len(self._pending) >= self.read_every:
            self.read()

    def read(self) -> None:
        """Read the pending losses in one transfer, check them, log each update's mean."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        norms = [u.grad_norm.float() for u in pending if u.grad_norm is not None]
        flat = torch.stack(
            [loss.float() for u in pending for loss in u.losses] + norms
        ).tolist()  # one transfer
        read_norms = iter(flat[len(flat) - len(norms) :])
        position = 0
        for update in pending:
            values = flat[position : position + len(update.losses)]
            position += len(update.losses)
            for microbatch, value in zip(update.microbatches, values):
                if not math.isfinite(value):
                    raise NonFiniteLossError(
                        f"non-finite loss ({value}) at microbatch {microbatch} "
                        f"(minibatch {microbatch // self.microbatches})"
                    )
            extra: dict[str, Any] = {}
            if update.grad_norm is not None:
                norm = next(read_norms)
                extra["grad_norm"] = norm if math.isfinite(norm) else None
            if update.skipped:
                extra["skipped"] = True
            if self.logger is not None:
                self.logger.log(
                    update.step,
                    sum(values) / len(values),
                    extra or None,
                    at=update.issued,
                    cpu_at=update.cpu,
                )
