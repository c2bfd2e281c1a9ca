"""A deterministic, seeded stream of microbatches over a workload's dataset.

Every rank that needs data (the first stage for inputs, the last stage for targets) builds its
own :class:`MicrobatchStream` with the same seed, so labels never travel through the pipeline:
microbatch ``i`` is the same on every rank. The order is a fresh seeded permutation per epoch.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["MicrobatchStream"]


class MicrobatchStream:
    """Microbatch ``i`` = samples ``i*b .. i*b+b-1`` of the epoch-wise shuffled dataset."""

    def __init__(self, dataset: Dataset[tuple[Tensor, Tensor]], batch_size: int, seed: int):
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        if self.num_samples == 0:
            raise ValueError("the workload's dataset is empty")
        self._epoch = -1
        self._order: Tensor = torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.num_samples, generator=generator)
            self._epoch = epoch
        return self._order

    def sample_indices(self, index: int) -> list[int]:
        start = index * self.batch_size
        out = []
        for position in range(start, start + self.batch_size):
            epoch, offset = divmod(position, self.num_samples)
            out.append(int(self._permutation(epoch)[offset]))
        return out

    def microbatch(self, index: int) -> tuple[Tensor, Tensor]:
        """Inputs and targets of microbatch ``index`` (stacked along a new batch dimension)."""
        items = [self.dataset[i] for i in self.sample_indices(index)]
        inputs = torch.stack([item[0] for item in items])
        targets = torch.stack([torch.as_tensor(item[1]) for item in items])
        return inputs, targets
