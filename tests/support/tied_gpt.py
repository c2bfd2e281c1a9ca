"""The small ``gpt`` model whose output head reuses its token embedding, for the tied tests."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipedream.data import MicrobatchStream
from pipedream.workload import load_workload

from oracles import plain_training

__all__ = ["ARGS", "LAYERS", "MICROBATCH", "plain_tied_training"]

ARGS = {
    "layers": "2",
    "dim": "16",
    "heads": "2",
    "seq": "8",
    "vocab": "32",
    "samples": "256",
    "tie": "true",
    "optimizer": "sgd",  # Adam turns float rounding into 1e-4 differences within a few steps
    "lr": "0.5",
    "momentum": "0.5",
}
"""``--workload-arg``s of ``gpt``: the head's weight is ``embed.tok.weight``."""
LAYERS = ["embed", "h0", "h1", "norm", "head"]
"""Its layers."""
MICROBATCH = 4
"""Samples per microbatch."""


def plain_tied_training(
    *,
    steps: int,
    microbatches: int,
    copies: int = 1,
    untie: bool = False,
    clip: float | None = None,
    norms: list[float] | None = None,
) -> dict[str, Tensor]:
    """Single-process training of the tied model, as a pipeline of ``copies`` copies runs
    ``steps`` minibatches of ``microbatches`` microbatches: ``steps / copies`` updates, each
    on ``copies`` consecutive minibatches at once. ``untie``: the head trains a tensor of its
    own (what the runtime did before ties were handled); ``clip``: ``clip_grad_norm_`` to it
    before every step, whose norms go to ``norms``."""
    workload = load_workload("gpt", ARGS)
    data = MicrobatchStream(workload.dataset, MICROBATCH, 0)
    model = workload.model
    if untie:
        model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    per_update = copies * microbatches

    def batch(k: int) -> tuple[Tensor, Tensor]:
        parts = zip(*(data.microbatch(k * per_update + j) for j in range(per_update)))
        inputs, targets = (torch.cat(part) for part in parts)
        return inputs, targets

    return plain_training(
        model,
        num_updates=steps // copies,
        batch=batch,
        loss_fn=workload.loss_fn,
        optimizer=workload.optimizer,
        clip=clip,
        norms=norms,
    )
