"""``mlp``: a stack of Linear+ReLU blocks regressing a fixed random teacher network.

Layers (the Sequential's children): ``"0"`` .. ``"{layers-1}"`` are ``Linear+ReLU`` blocks,
``"{layers}"`` is the linear head. Data: Gaussian inputs, targets from a seeded teacher MLP plus
a little noise, so the loss falls steadily and the optimum is known to be reachable.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipedream.data import torch_seed
from pipedream.workload import Workload
from pipedream.workloads.common import check_sizes, optimizer_factory, warmup_decay

__all__ = ["build"]


def _block(width_in: int, width_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width_in, width_out), nn.ReLU())


def build(
    layers: int = 8,
    width: int = 64,
    in_features: int = 16,
    out_features: int = 4,
    samples: int = 4096,
    lr: float = 0.05,
    momentum: float = 0.0,
    optimizer: str = "sgd",
    warmup: int = 0,
    decay: int = 0,
    seed: int = 0,
    microbatch_size: int = 32,
) -> Workload:
    """Build the MLP workload; every call with the same arguments gives identical weights.
    ``warmup`` and ``decay`` schedule the learning rate (:func:`~pipedream.workloads.common.
    warmup_decay`)."""
    check_sizes(
        "mlp",
        layers=layers,
        width=width,
        in_features=in_features,
        out_features=out_features,
        samples=samples,
        microbatch_size=microbatch_size,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed))
        blocks = [_block(in_features if i == 0 else width, width) for i in range(layers)]
        model = nn.Sequential(*blocks, nn.Linear(width, out_features))
        teacher = nn.Sequential(nn.Linear(in_features, 32), nn.Tanh(), nn.Linear(32, out_features))
        inputs = torch.randn(samples, in_features)
        with torch.no_grad():
            targets = teacher(inputs) + 0.01 * torch.randn(samples, out_features)
        example = torch.randn(microbatch_size, in_features)

    return Workload(
        model=model,
        example_input=example,
        loss_fn=nn.functional.mse_loss,
        dataset=TensorDataset(inputs, targets),
        optimizer=optimizer_factory(optimizer, lr=lr, momentum=momentum),
        lr_schedule=warmup_decay("mlp", warmup, decay),
        description=f"MLP {layers}x{width} on synthetic regression ({samples} samples)",
    )
