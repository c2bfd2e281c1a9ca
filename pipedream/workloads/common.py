"""Pieces shared by the built-in workloads."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pipedream.errors import WorkloadError

__all__ = ["OPTIMIZERS", "check_sizes", "decay_groups", "optimizer_factory", "warmup_decay"]

OPTIMIZERS = ("sgd", "adam", "adamw")


def check_sizes(workload: str, **sizes: int) -> None:
    """Refuse the first of ``sizes`` (option name: value) below 1, naming the option."""
    for name, value in sizes.items():
        if value < 1:
            raise WorkloadError(f"{workload}: {name} must be >= 1, got {value}")


ADAMW_WEIGHT_DECAY = 0.01
"""AdamW's weight decay where none is given (PyTorch's default); SGD and Adam: 0."""


def optimizer_factory(
    name: str, *, lr: float, momentum: float = 0.0, weight_decay: float | None = None
) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """Return a function that builds optimizer ``name`` over a set of parameters, with
    ``weight_decay`` (None: :data:`ADAMW_WEIGHT_DECAY` for AdamW, 0 for the others) on the
    parameters :func:`decay_groups` decays."""
    if name not in OPTIMIZERS:
        raise WorkloadError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
    if not (math.isfinite(lr) and lr > 0):
        raise WorkloadError(f"learning rate must be a positive number, got lr={lr}; e.g. lr=0.01")
    if not (math.isfinite(momentum) and 0 <= momentum < 1):
        raise WorkloadError(f"momentum must be in [0, 1), got momentum={momentum}; e.g. 0.9")
    if weight_decay is None:
        weight_decay = ADAMW_WEIGHT_DECAY if name == "adamw" else 0.0
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise WorkloadError(f"weight decay must be >= 0, got weight_decay={weight_decay}; e.g. 0.1")
    decay = weight_decay

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        groups = decay_groups(params, decay)
        if name == "sgd":
            return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=decay)
        if name == "adam":
            return torch.optim.Adam(groups, lr=lr, weight_decay=decay)
        return torch.optim.AdamW(groups, lr=lr, weight_decay=decay)

    return build


def decay_groups(
    params: Iterable[nn.Parameter], weight_decay: float
) -> list[nn.Parameter] | list[dict[str, Any]]:
    """``params`` as an optimizer's parameter groups: with ``weight_decay`` on the matrices
    (weights of linear layers, embeddings, convolutions: two or more dimensions) and none on
    the vectors (biases, the gains and shifts of LayerNorm and RMSNorm), as Megatron-LM,
    nanoGPT and Hugging Face's ``Trainer`` decay them: shrinking a norm's gain or a bias
    towards 0 is not regularization. Without decay, one group of them all. A group that
    would be empty (a stage of norms only) is left out."""
    params = list(params)
    if not weight_decay:
        return params
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay}] if matrices else []
    return groups + ([{"params": vectors, "weight_decay": 0.0}] if vectors else [])


DECAY_FLOOR = 0.1
"""Where :func:`warmup_decay`'s cosine ends: a tenth of the learning rate."""


def warmup_decay(workload: str, warmup: int = 0, decay: int = 0) -> Callable[[int], float] | None:
    """The learning-rate factor of minibatch ``t`` (``Workload.lr_schedule``): a linear warm-up
    over the first ``warmup`` minibatches (``(t + 1) / warmup``), then a cosine from 1 down to
    :data:`DECAY_FLOOR` over ``decay`` minibatches, which stays; None for neither (the
    optimizer's learning rate throughout)."""
    for name, value in (("warmup", warmup), ("decay", decay)):
        if value < 0:
            raise WorkloadError(f"{workload}: {name} must be >= 0 minibatches, got {value}")
    if not warmup and not decay:
        return None

    def factor(t: int) -> float:
        if t < warmup:
            return (t + 1) / warmup
        if not decay:
            return 1.0
        progress = min(1.0, (t - warmup) / decay)
        return DECAY_FLOOR + (1 - DECAY_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
