"""Independent single-process oracles for the schedules' update rules (DESIGN.md section 7).

These use nothing from pipedream.runtime: plain autograd on the whole model, with the weights of
each stage taken from the version the rule prescribes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["stale_sgd_oracle", "stage_param_names"]


def stage_param_names(model: nn.Module, stages: Sequence[Sequence[str]]) -> list[list[str]]:
    out = []
    for layers in stages:
        prefixes = tuple(f"{layer}." for layer in layers)
        out.append([n for n, _ in model.named_parameters() if n.startswith(prefixes)])
    return out


def stale_sgd_oracle(
    model: nn.Module,
    stages: Sequence[Sequence[str]],
    *,
    num_minibatches: int,
    lr: float,
    minibatch: Callable[[int], list[tuple[Tensor, Tensor]]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    staleness: Callable[[int, int], int],
) -> dict[str, Tensor]:
    """Plain SGD where minibatch t's gradient at stage s is taken at W_s^(staleness(t, s)).

    ``minibatch(t)`` returns its microbatches; the gradient is their mean.
    ``W^(t+1) = W^(t) - lr * grad`` with the stage weights of each version as given.
    """
    names = stage_param_names(model, stages)
    history = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    buffers = {n: b for n, b in model.named_buffers()}
    for t in range(num_minibatches):
        params: dict[str, Tensor] = {}
        for s, stage_names in enumerate(names):
            version = staleness(t, s)
            assert 0 <= version <= t
            for name in stage_names:
                params[name] = history[version][name].clone().requires_grad_(True)
        micro = minibatch(t)
        total = None
        for inputs, targets in micro:
            out = functional_call(model, {**params, **buffers}, (inputs,))
            loss = loss_fn(out, targets) / len(micro)
            total = loss if total is None else total + loss
        assert total is not None
        grads = torch.autograd.grad(total, list(params.values()))
        history.append({n: history[t][n] - lr * g for n, g in zip(params, grads)})
    return history[num_minibatches]
