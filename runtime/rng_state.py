"""The random number generators a stage's forward draws from: seeded, captured, and replayed.

Every rank seeds its generators at the start of each segment of the run (the stretch between
two checkpoints) from the run's ``--seed``, its rank and the segment's first minibatch
(:func:`seed_segment`): runs are reproducible, the replicas of a stage draw different dropout
masks, and a run resumed from a checkpoint draws what the uninterrupted one drew, with no
generator state in the checkpoint (which the first replica of a stage alone writes).

A forward that draws random numbers (dropout, by far the most common) must draw the same ones
when ``--recompute`` runs it again for its backward, or the gradients belong to another network
than the one whose outputs were sent and whose loss was logged. Two generators matter: the
CPU's, and the stage's GPU's (CUDA tensors draw from their device's generator). Capturing one
costs a copy of its state (a few KiB on the CPU; a seed and an offset on a GPU, read without
waiting for the GPU), so it is done only where needed.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RngState", "capture", "replayed", "restore", "seed_segment", "segment_seed"]


@dataclass(frozen=True)
class RngState:
    """The state of the CPU's generator and, on a GPU, of the stage's device's."""

    cpu: Tensor
    cuda: Tensor | None = None
    cuda_device: int | None = None


def segment_seed(seed: int, rank: int, first_minibatch: int) -> int:
    """The seed of ``rank``'s generators for the segment that starts at ``first_minibatch``."""
    digest = hashlib.sha256(f"pipedream/{seed}/{rank}/{first_minibatch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch takes seeds below 2**63


def seed_segment(seed: int, rank: int, first_minibatch: int) -> None:
    """Seed this process's generators, the CPU's and every GPU's, for a segment (above)."""
    torch.manual_seed(segment_seed(seed, rank, first_minibatch))


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
