"""A traced workload with a ``torch.no_grad()`` region in its forward (``no_grad_model:build``),
as a Hugging Face Llama's rotary embedding has: torch.export keeps the region as a submodule that
the graph calls with gradients off, and its result, computed from a parameter's output, carries
no gradient back."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from pipedream.workload import Workload
from pipedream.workloads.common import optimizer_factory

__all__ = ["NoGradModel", "build"]


class Table(nn.Module):
    """A fixed function of its input, computed without gradients (a rotary table's kind)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.5, 1.5, width))

    @torch.no_grad()
    def forward(self, h: Tensor) -> Tensor:
        return torch.cos(h * self.freq)


class NoGradModel(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.table = Table(width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.embed(x))
        scale = self.table(h)
        return self.head(torch.tanh(self.mid(h)) * scale)


def build(width: int = 8, samples: int = 128, microbatch_size: int = 4) -> Workload:
    """The same weights and data on every call: a regression onto ``tanh(sum(x))``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = NoGradModel(width)
        inputs = torch.randn(samples, width)
        example = torch.randn(microbatch_size, width)
    return Workload(
        model=model,
        example_input=example,
        loss_fn=nn.functional.mse_loss,
        dataset=TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).tanh()),
        optimizer=optimizer_factory("sgd", lr=0.1, momentum=0.9),
        description="a model with a no_grad region",
    )
