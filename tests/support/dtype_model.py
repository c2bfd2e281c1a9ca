"""A model whose weights are not float32 (``dtype_model:build``, ``dtype=bfloat16`` or
``float64``), as a language model loaded in bfloat16 is: its stages must pass each other
tensors of the model's dtype."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipedream.workload import Workload
from pipedream.workloads.common import optimizer_factory

__all__ = ["build"]


def build(dtype: str = "bfloat16", microbatch_size: int = 4) -> Workload:
    """Linear-ReLU blocks and a head in ``dtype``, learning a sum of the inputs with SGD."""
    kind = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 8, generator=gen).to(kind)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    ).to(kind)
    return Workload(
        model=model,
        example_input=inputs[:microbatch_size],
        loss_fn=nn.functional.mse_loss,
        dataset=TensorDataset(inputs, inputs.sum(1, keepdim=True)),
        optimizer=optimizer_factory("sgd", lr=0.05),
    )
