"""A densely connected MLP workload (``dense_mlp:build``): block ``k`` reads the concatenation
of the input and every earlier block's output, so that with one block per stage every stage
sends to every later one, the most messages between two receives a pipeline can have."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from pipedream.workload import Workload
from pipedream.workloads.common import optimizer_factory

__all__ = ["DenseMLP", "build"]


class DenseMLP(nn.Module):
    """``blocks`` Linear+ReLU blocks, each fed every earlier feature, and a linear head."""

    def __init__(self, blocks: int, width: int, features: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(features + k * width, width) for k in range(blocks))
        self.head = nn.Linear(features + blocks * width, 1)

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for block in self.blocks:
            features.append(torch.relu(block(torch.cat(features, dim=1))))
        return self.head(torch.cat(features, dim=1))


def build(
    blocks: int = 6, width: int = 8, features: int = 8, samples: int = 256, microbatch_size: int = 4
) -> Workload:
    """The same weights and data on every call: a regression onto ``tanh(sum(x))``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DenseMLP(blocks, width, features)
        inputs = torch.randn(samples, features)
        example = torch.randn(microbatch_size, features)
    return Workload(
        model=model,
        example_input=example,
        loss_fn=nn.functional.mse_loss,
        dataset=TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).tanh()),
        optimizer=optimizer_factory("sgd", lr=0.05, momentum=0.0),
        description=f"dense MLP of {blocks} blocks",
    )
