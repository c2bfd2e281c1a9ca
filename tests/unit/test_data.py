"""The microbatch stream: its order, epoch wrap-around, and the gather path for tensor datasets."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from pipedream.data import MicrobatchStream


class _Items(Dataset[tuple[Tensor, Tensor]]):
    """The same samples as a TensorDataset, but indexed one item at a time."""

    def __init__(self, inputs: Tensor, targets: Tensor):
        self.inputs, self.targets = inputs, targets
        self.reads = 0

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        self.reads += 1
        return self.inputs[index], self.targets[index]


def _samples() -> tuple[Tensor, Tensor]:
    inputs = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    return inputs, torch.arange(10) * 7


def test_order_is_the_seeded_permutation_of_each_epoch() -> None:
    stream = MicrobatchStream(TensorDataset(*_samples()), 4, seed=3)
    first = torch.randperm(10, generator=torch.Generator().manual_seed(3 * 1_000_003)).tolist()
    second = torch.randperm(10, generator=torch.Generator().manual_seed(3 * 1_000_003 + 1))
    assert stream.sample_indices(0) == first[:4]
    assert stream.sample_indices(1) == first[4:8]
    # microbatch 2 = samples 8..11: the last two of epoch 0, the first two of epoch 1
    assert stream.sample_indices(2) == first[8:] + second[:2].tolist()
    inputs, targets = stream.microbatch(2)
    assert targets.tolist() == [7 * i for i in stream.sample_indices(2)]
    assert inputs[:, 0].tolist() == [3.0 * i for i in stream.sample_indices(2)]


def test_tensor_dataset_gather_equals_item_by_item() -> None:
    inputs, targets = _samples()
    fast = MicrobatchStream(TensorDataset(inputs, targets), 4, seed=0)
    items = _Items(inputs, targets)
    slow = MicrobatchStream(items, 4, seed=0)
    for index in range(8):  # a few epochs, with microbatches across their boundaries
        for mine, theirs in zip(fast.microbatch(index), slow.microbatch(index)):
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
            assert torch.equal(mine, theirs)
        assert torch.equal(fast.inputs(index), slow.inputs(index))
        assert torch.equal(fast.targets(index), slow.targets(index))


def test_generic_dataset_reads_each_item_once_per_microbatch() -> None:
    items = _Items(*_samples())
    MicrobatchStream(items, 4, seed=0).microbatch(0)
    assert items.reads == 4


def test_microbatch_larger_than_the_dataset_spans_epochs() -> None:
    stream = MicrobatchStream(TensorDataset(*_samples()), 25, seed=1)
    indices = stream.sample_indices(0)
    assert len(indices) == 25 and sorted(indices[:10]) == list(range(10))
    assert sorted(indices[10:20]) == list(range(10))
    assert stream.targets(0).tolist() == [7 * i for i in indices]


def test_any_integer_seeds_the_order_as_torch_wraps_it() -> None:
    """Seeds of 2**63 and more overflowed torch's generator (a traceback from ``--seed``); every
    seed torch took, negative ones included, keeps its order."""
    inputs, targets = _samples()
    dataset = TensorDataset(inputs, targets)
    for seed in (-3, 0, 5, 2**40):
        stream = MicrobatchStream(dataset, 10, seed)
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(seed * 1_000_003))
        assert torch.equal(stream.microbatch(0)[1], targets[expected])
    huge = MicrobatchStream(dataset, 10, 10**30)
    wrapped = torch.Generator().manual_seed((10**30 * 1_000_003) % 2**64)
    assert torch.equal(huge.microbatch(0)[1], targets[torch.randperm(10, generator=wrapped)])


def test_workloads_take_any_integer_seed() -> None:
    from pipedream.workloads.mlp import build

    small, huge = build(seed=3, samples=8), build(seed=3 + 2**64, samples=8)
    assert all(torch.equal(a, b) for a, b in zip(small.model.parameters(), huge.model.parameters()))
