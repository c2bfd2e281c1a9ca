"""A rank whose device runs out of memory ends with one line, not a traceback per rank.

PyTorch's message is long (the allocator's whole state, a link to its documentation). A user
needs the rank, stage and action that failed, the first sentences of PyTorch's message (what
the allocation was and what the device had free), the plan's estimate of the stage's memory,
and the ways to fit: a plan for the device's memory, recomputation, smaller microbatches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pipedream.errors import RunFailure
from pipedream.formats.plan import Plan
from pipedream.formats.units import format_bytes

__all__ = ["DeviceOutOfMemory", "how_to_fit", "said_in_one_line", "torch_summary"]


class DeviceOutOfMemory(RunFailure):
    """A rank's device ran out of memory during an action of ``stage``."""

    def __init__(self, message: str, *, stage: int) -> None:
        super().__init__(message)
        self.stage = stage


def torch_summary(message: str, *, sentences: int = 3) -> str:
    """The first ``sentences`` of PyTorch's out-of-memory message (``CUDA out of memory.
    Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.02 GiB is
    free``), without the allocator's statistics that follow."""
    first_line = message.strip().splitlines()[0] if message.strip() else "out of memory"
    parts = first_line.split(". ")
    return ". ".join(parts[:sentences]).rstrip(".")


def how_to_fit(plan: Plan, stage: int, *, recompute: bool) -> str:
    """The plan's estimate for ``stage``'s workers, and what makes a stage fit its device."""
    estimate = ""
    if plan.prediction is not None and stage < len(plan.prediction.memory_bytes):
        estimate = (
            f"the plan estimated {format_bytes(plan.prediction.memory_bytes[stage])} per worker "
            f"of stage {stage}; "
        )
    fixes = ["plan for the device's memory (pipedream plan ... --memory SIZE)"]
    if not recompute:
        fixes.append("recompute activations (--recompute, or plan --recompute)")
    fixes.append("use smaller or fewer microbatches in flight")
    return estimate + ", ".join(fixes[:-1]) + " or " + fixes[-1]


@contextlib.contextmanager
def said_in_one_line(what: str, *, plan: Plan, stage: int, recompute: bool) -> Iterator[None]:
    """Turn PyTorch's out-of-memory error in the block into a :class:`DeviceOutOfMemory` that
    says ``what`` ran out (``rank 1 ran out of memory on cuda:1 placing stage 1``), PyTorch's
    first sentences and :func:`how_to_fit`."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise DeviceOutOfMemory(
            f"{what} ({torch_summary(str(exc))}); {how_to_fit(plan, stage, recompute=recompute)}",
            stage=stage,
        ) from None
