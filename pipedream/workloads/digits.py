"""``digits``: an MLP classifier on scikit-learn's bundled 8x8 handwritten digits.

The data ship with scikit-learn (1797 images, 10 classes; nothing is downloaded). A seeded
held-out split (``test_fraction``, stratified by class) gives a real accuracy to report, so the
demo shows that pipeline training -- asynchronous, with stale weights -- still learns. A
``test_fraction`` whose rounding per class leaves either split empty is refused.
Inputs are the 64 pixel values standardized with the training split's mean and std.

Layers (the Sequential's children): ``"0"`` .. ``"{layers-1}"`` are ``Linear+ReLU`` blocks,
``"{layers}"`` is the linear head producing 10 logits. The defaults (3 blocks + head = 4 layers,
one per stage of a 4-stage pipeline) reach 97-99% test accuracy after 300 minibatches of 32
with Adam, also when stage 0 uses weights 3 updates stale as in PipeDream's 4-stage schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from pipedream.data import torch_seed
from pipedream.errors import WorkloadError
from pipedream.workload import Workload
from pipedream.workloads.common import check_sizes, optimizer_factory, warmup_decay

__all__ = ["NUM_CLASSES", "NUM_FEATURES", "DigitsSplit", "accuracy", "build", "load_split"]

NUM_FEATURES = 64
"""Pixels per image (8x8)."""
NUM_CLASSES = 10
"""Digits 0-9."""


@dataclass(frozen=True)
class DigitsSplit:
    """Standardized train and held-out test tensors."""

    train_inputs: Tensor
    """``[N_train, 64]`` float32, standardized with the training mean and std."""
    train_targets: Tensor
    """``[N_train]`` long class labels."""
    test_inputs: Tensor
    """``[N_test, 64]`` float32, standardized with the *training* statistics."""
    test_targets: Tensor
    """``[N_test]`` long class labels."""


def load_split(*, test_fraction: float, seed: int) -> DigitsSplit:
    """Load the digits, split off a stratified seeded test set, standardize the inputs."""
    if not 0.0 < test_fraction < 1.0:
        raise WorkloadError(
            f"digits: test_fraction must be between 0 and 1 (exclusive), got {test_fraction}"
        )
    from sklearn.datasets import load_digits  # imported here: sklearn is slow to import

    data = load_digits()
    inputs = torch.tensor(data.data, dtype=torch.float32)
    targets = torch.tensor(data.target, dtype=torch.long)
    generator = torch.Generator().manual_seed(torch_seed(seed))
    test_parts, train_parts = [], []
    for label in range(NUM_CLASSES):
        # Per-class split so every digit is equally represented in the test set.
        members = torch.nonzero(targets == label)[:, 0]
        members = members[torch.randperm(len(members), generator=generator)]
        num_test = round(test_fraction * len(members))
        test_parts.append(members[:num_test])
        train_parts.append(members[num_test:])
    _check_split(test_fraction, [len(part) for part in test_parts], targets)
    train_index = torch.cat(train_parts).sort().values
    test_index = torch.cat(test_parts).sort().values
    mean = inputs[train_index].mean(dim=0)
    # Border pixels are always 0 in training: leave them at 0 instead of dividing by 0.
    std = inputs[train_index].std(dim=0)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    standardized = (inputs - mean) / std
    return DigitsSplit(
        train_inputs=standardized[train_index].contiguous(),
        train_targets=targets[train_index].contiguous(),
        test_inputs=standardized[test_index].contiguous(),
        test_targets=targets[test_index].contiguous(),
    )


def _check_split(test_fraction: float, test_sizes: list[int], targets: Tensor) -> None:
    """Refuse a ``test_fraction`` whose rounding per class leaves the test or the training split
    empty, with the range that leaves every class in both."""
    num_test = sum(test_sizes)
    if 0 < num_test < len(targets):
        return
    smallest = int(torch.bincount(targets, minlength=NUM_CLASSES).min())
    low = math.ceil(1000 / smallest) / 1000  # every class rounds to at least one test sample
    empty = "no test samples" if num_test == 0 else "no training samples"
    raise WorkloadError(
        f"digits: test_fraction={test_fraction} leaves {empty} of the {len(targets)} (split per "
        f"class, rounded); use a test_fraction from {low:g} to {1 - low:g}"
    )


def accuracy(model: nn.Module, inputs: Tensor, targets: Tensor) -> float:
    """Fraction of ``inputs`` whose arg-max logit is the target (model in eval mode, no grad)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        predictions = model(inputs.to(device)).argmax(dim=-1).cpu()
    model.train(was_training)
    return float((predictions == targets).float().mean())


def build(
    layers: int = 3,
    width: int = 128,
    test_fraction: float = 0.2,
    lr: float = 1e-3,
    momentum: float = 0.0,
    optimizer: str = "adam",
    warmup: int = 0,
    decay: int = 0,
    seed: int = 0,
    data_seed: int = 0,
    microbatch_size: int = 32,
) -> Workload:
    """Build the digits workload; same arguments -> identical weights, split and data.

    ``seed`` fixes the initial weights, ``data_seed`` the train/test split; ``warmup`` and
    ``decay`` schedule the learning rate (:func:`~pipedream.workloads.common.warmup_decay`).
    """
    check_sizes("digits", layers=layers, width=width, microbatch_size=microbatch_size)
    make_optimizer = optimizer_factory(optimizer, lr=lr, momentum=momentum)
    split = load_split(test_fraction=test_fraction, seed=data_seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed))
        blocks = [
            nn.Sequential(nn.Linear(NUM_FEATURES if i == 0 else width, width), nn.ReLU())
            for i in range(layers)
        ]
        model = nn.Sequential(*blocks, nn.Linear(width, NUM_CLASSES))
    example = split.train_inputs[:microbatch_size].clone()
    if len(example) < microbatch_size:  # only for absurd microbatch sizes
        example = example.repeat((microbatch_size + len(example) - 1) // len(example), 1)
        example = example[:microbatch_size]

    def evaluate(trained: nn.Module) -> dict[str, float]:
        """Accuracy on the held-out split (and on the training split, to spot overfitting)."""
        return {
            "test_accuracy": accuracy(trained, split.test_inputs, split.test_targets),
            "train_accuracy": accuracy(trained, split.train_inputs, split.train_targets),
        }

    return Workload(
        model=model,
        example_input=example,
        loss_fn=F.cross_entropy,
        dataset=TensorDataset(split.train_inputs, split.train_targets),
        optimizer=make_optimizer,
        evaluate=evaluate,
        lr_schedule=warmup_decay("digits", warmup, decay),
        description=(
            f"MLP {layers}x{width} on scikit-learn 8x8 digits "
            f"({len(split.train_targets)} train / {len(split.test_targets)} test)"
        ),
    )
