"""A deterministic, seeded stream of microbatches over a workload's dataset.

Every rank that needs data (the first stage for inputs, the last stage for targets) builds its
own :class:`MicrobatchStream` with the same seed, so labels never travel through the pipeline:
microbatch ``i`` is the same on every rank. The order is a fresh seeded permutation per epoch.

A :class:`~torch.utils.data.TensorDataset` of (inputs, targets) is indexed with one gather per
tensor; any other dataset item by item (then stacked). Both give the same tensors; the gather
is one call where item by item costs a Python call and a small tensor per sample, which the
first and the last stage would pay on every forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

__all__ = ["MicrobatchStream", "collate", "torch_seed"]


class MicrobatchStream:
    """Microbatch ``i`` = samples ``i*b .. i*b+b-1`` of the epoch-wise shuffled dataset."""

    def __init__(self, dataset: Dataset[tuple[Any, Any]], batch_size: int, seed: int):
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        if self.num_samples == 0:
            raise ValueError("the workload's dataset is empty")
        self._epoch = -1
        self._order: Tensor = torch.empty(0, dtype=torch.long)
        self._tensors: tuple[Tensor, Tensor] | None = None
        if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
            self._tensors = (dataset.tensors[0], dataset.tensors[1])

    def _permutation(self, epoch: int) -> Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(torch_seed(self.seed * 1_000_003 + epoch))
            self._order = torch.randperm(self.num_samples, generator=generator)
            self._epoch = epoch
        return self._order

    def _indices(self, index: int) -> Tensor:
        """Dataset indices of microbatch ``index``'s samples, in order."""
        parts = []
        position, end = index * self.batch_size, (index + 1) * self.batch_size
        while position < end:  # one slice per epoch the microbatch touches
            epoch, offset = divmod(position, self.num_samples)
            count = min(end - position, self.num_samples - offset)
            parts.append(self._permutation(epoch)[offset : offset + count])
            position += count
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def sample_indices(self, index: int) -> list[int]:
        """Dataset indices of microbatch ``index``'s samples, in order."""
        return [int(i) for i in self._indices(index)]

    def _fields(self, index: int, fields: tuple[int, ...]) -> list[Any]:
        """The stacked ``fields`` (0: inputs, 1: targets) of microbatch ``index``."""
        if self._tensors is not None:
            indices = self._indices(index)
            return [self._tensors[field][indices] for field in fields]
        items = [self.dataset[i] for i in self.sample_indices(index)]  # each item read once
        return [collate([item[field] for item in items]) for field in fields]

    def inputs(self, index: int) -> Any:
        """Inputs of microbatch ``index`` (stacked along a new batch dimension; a tuple or dict
        of tensors where the dataset's inputs are)."""
        return self._fields(index, (0,))[0]

    def targets(self, index: int) -> Any:
        """Targets of microbatch ``index`` (stacked along a new batch dimension)."""
        return self._fields(index, (1,))[0]

    def microbatch(self, index: int) -> tuple[Any, Any]:
        """Inputs and targets of microbatch ``index``."""
        inputs, targets = self._fields(index, (0, 1))
        return inputs, targets


def collate(values: list[Any]) -> Any:
    """Samples stacked along a new first dimension: tensors (or what ``torch.as_tensor`` takes)
    stacked, tuples and dicts of them stacked entry by entry."""
    first = values[0]
    if isinstance(first, dict):
        return {key: collate([value[key] for value in values]) for key in first}
    if isinstance(first, tuple):
        return tuple(collate(list(parts)) for parts in zip(*values))
    return torch.stack([torch.as_tensor(value) for value in values])


def torch_seed(seed: int) -> int:
    """``seed`` as torch's generators take it: any integer, reduced to 64 bits the way torch
    wraps a negative one (so every seed torch accepted keeps its draws, and a larger one no
    longer overflows)."""
    return seed % (1 << 64)
