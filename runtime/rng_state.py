"""The random number generators a stage's forward draws from: captured, and replayed.

A forward that draws random numbers (dropout, by far the most common) must draw the same ones
when ``--recompute`` runs it again for its backward, or the gradients belong to another network
than the one whose outputs were sent and whose loss was logged. A checkpoint must also hold the
generators' state, so that a resumed run draws what the uninterrupted one would. Two generators
matter: the CPU's, and the stage's GPU's (CUDA tensors draw from their device's generator).
Capturing one costs a copy of its state (a few KiB on the CPU; a seed and an offset on a GPU,
read without waiting for the GPU), so it is done only where needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RngState", "capture", "replayed", "restore"]


@dataclass(frozen=True)
class RngState:
    """The state of the CPU's generator and, on a GPU, of the stage's device's."""

    cpu: Tensor
    cuda: Tensor | None = None
    cuda_device: int | None = None


def capture(device: torch.device) -> RngState:
    """The generators' state now, for a stage on ``device``."""
    if device.type != "cuda":
        return RngState(torch.get_rng_state())
    index = device.index if device.index is not None else torch.cuda.current_device()
    return RngState(torch.get_rng_state(), torch.cuda.get_rng_state(index), index)


def restore(state: RngState) -> None:
    """Set the generators to ``state``."""
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda, state.cuda_device)


@contextlib.contextmanager
def replayed(state: RngState) -> Iterator[None]:
    """Draw from ``state`` inside the block, and leave the generators afterwards as they were
    before it: a recomputed forward repeats the forward's draws without taking numbers from
    the ones that follow."""
    devices = [] if state.cuda_device is None else [state.cuda_device]
    with torch.random.fork_rng(devices=devices):
        restore(state)
        yield
