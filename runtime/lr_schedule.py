"""A workload's learning-rate schedule (``Workload.lr_schedule``) applied at every update.

The schedule maps a minibatch index ``t`` to a factor of every parameter group's learning
rate, as ``torch.optim.lr_scheduler.LambdaLR``'s ``lr_lambda`` does for a plain loop that steps
its scheduler once per minibatch: the update that applies minibatch ``t``'s gradients uses
``lr x schedule(t)``. A stage of ``r`` replicas applies minibatches ``t .. t + r - 1`` (one from
each replica) in one update, which uses ``schedule(t)``. ``t`` counts from the start of training,
a resumed run's too, so a resumed run follows the schedule where it left off.

The factor is set just for the step and the learning rate put back after it: the optimizer's
state and a checkpoint keep the workload's own learning rate, and a resume compares settings
with the workload's as without a schedule.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator

import torch

from pipedream.errors import WorkloadError

__all__ = ["LrSchedule", "scheduled_lr"]

LrSchedule = Callable[[int], float]
"""Minibatch index -> factor of the learning rate (``Workload.lr_schedule``)."""


@contextlib.contextmanager
def scheduled_lr(
    optimizer: torch.optim.Optimizer, schedule: LrSchedule | None, minibatch: int
) -> Iterator[None]:
    """Within the block, every parameter group's learning rate times ``schedule(minibatch)``
    (nothing changes without a schedule)."""
    if schedule is None:
        yield
        return
    factor = schedule(minibatch)
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):  # numpy's too
        raise WorkloadError(
            f"the workload's lr_schedule({minibatch}) returned {factor!r}, not a number; it "
            "must return the factor of the learning rate at that minibatch"
        )
    if not (math.isfinite(factor) and factor >= 0):
        raise WorkloadError(
            f"the workload's lr_schedule({minibatch}) returned {factor}; the factor of the "
            "learning rate must be a finite number >= 0"
        )
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr * float(factor)
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr
