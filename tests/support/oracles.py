"""Independent single-process oracles for the schedules' update rules (DESIGN.md section 7).

They use nothing from pipedream.runtime: plain autograd on the whole, unsplit model, with each
stage's weights taken from the version the rule prescribes, and a torch optimizer applying the
update to the latest weights (so momentum and Adam state live with the latest weights, as in
the runtime).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["plain_training", "stage_param_names", "stale_oracle"]

Batch = tuple[Tensor, Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def stage_param_names(model: nn.Module, stages: Sequence[Sequence[str]]) -> list[list[str]]:
    out = []
    for layers in stages:
        prefixes = tuple(f"{layer}." for layer in layers)
        out.append([n for n, _ in model.named_parameters() if n.startswith(prefixes)])
    return out


def stale_oracle(
    model: nn.Module,
    stages: Sequence[Sequence[str]],
    *,
    num_minibatches: int,
    minibatch: Callable[[int], list[Batch]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    staleness: Callable[[int, int], int],
    optimizer: OptimizerFactory,
) -> dict[str, Tensor]:
    """Train where minibatch t's gradient at stage s is taken at W_s^(staleness(t, s)).

    ``minibatch(t)`` returns its microbatches; the gradient is the mean of their losses'.
    ``W^(t+1) = step(W^(t), grad)``; versions are snapshots after each update.
    """
    names = stage_param_names(model, stages)
    live = {n: nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
    opt = optimizer(list(live.values()))
    history = [{n: p.detach().clone() for n, p in live.items()}]
    buffers = dict(model.named_buffers())
    for t in range(num_minibatches):
        params: dict[str, Tensor] = {}
        for s, stage_names in enumerate(names):
            version = staleness(t, s)
            assert 0 <= version <= t
            for name in stage_names:
                params[name] = history[version][name].clone().requires_grad_(True)
        micro = minibatch(t)
        total = sum(
            loss_fn(functional_call(model, {**params, **buffers}, (x,)), y) / len(micro)
            for x, y in micro
        )
        grads = torch.autograd.grad(total, list(params.values()))
        for name, grad in zip(params, grads):
            live[name].grad = grad
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append({n: p.detach().clone() for n, p in live.items()})
    return history[num_minibatches]


def plain_training(
    model: nn.Module,
    *,
    num_updates: int,
    batch: Callable[[int], Batch],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    optimizer: OptimizerFactory,
) -> dict[str, Tensor]:
    """Ordinary single-process training: forward the whole batch, backward, step."""
    opt = optimizer(model.parameters())
    for k in range(num_updates):
        inputs, targets = batch(k)
        loss = loss_fn(model(inputs), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
