"""Independent single-process oracles for the schedules' update rules (docs/schedules.md).

They use nothing from pipedream.runtime: plain autograd on the whole, unsplit model, with each
stage's weights taken from the version the rule prescribes, and a torch optimizer applying the
update to the latest weights (so momentum and Adam state live with the latest weights, as in
the runtime).

Tied parameters follow the documented rule by construction: ``named_parameters()`` lists a
tied tensor once, under its first name, so it belongs to the first stage that uses it; every
use of it in a minibatch takes that stage's version, and autograd sums the gradients of all
uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["plain_training", "replicated_oracle", "stage_param_names", "stale_oracle"]

Batch = tuple[Tensor, Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def stage_param_names(model: nn.Module, stages: Sequence[Sequence[str]]) -> list[list[str]]:
    return _by_stage([n for n, _ in model.named_parameters()], stages)


def _by_stage(names: Sequence[str], stages: Sequence[Sequence[str]]) -> list[list[str]]:
    """``names`` of each stage: those under one of its layers."""
    return [[n for n in names if n.startswith(tuple(f"{x}." for x in layers))] for layers in stages]


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
    clip: float | None = None,
    norms: list[float] | None = None,
) -> dict[str, Tensor]:
    """Ordinary single-process training: forward the whole batch, backward, step; with
    ``clip``, ``clip_grad_norm_`` before each step (the norms it returns go to ``norms``)."""
    opt = optimizer(model.parameters())
    for k in range(num_updates):
        inputs, targets = batch(k)
        loss = loss_fn(model(inputs), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def replicated_oracle(
    model: nn.Module,
    stages: Sequence[Sequence[str]],
    replicas: Sequence[int],
    *,
    num_minibatches: int,
    minibatch: Callable[[int], list[Batch]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    optimizer: OptimizerFactory,
) -> dict[str, Tensor]:
    """Synchronous training of replicated stages (1F1B-RR with a flush per minibatch): stage s
    computes minibatch t at W_s^(t // r_s) and updates once per r_s minibatches with the mean
    of their gradients. The model's buffers that forwards update (batch norm's running
    statistics) end as replica 0 of each stage leaves them: a forward of minibatch t updates
    stage s's only where ``t % r_s == 0``."""
    names = stage_param_names(model, stages)
    buffer_names = _by_stage([n for n, _ in model.named_buffers()], stages)
    live = {n: nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
    optimizers = [optimizer([live[n] for n in stage_names]) for stage_names in names]
    history = [[{n: live[n].detach().clone() for n in stage_names}] for stage_names in names]
    sums = [{n: torch.zeros_like(live[n]) for n in stage_names} for stage_names in names]
    buffers = dict(model.named_buffers())
    for t in range(num_minibatches):
        params: dict[str, Tensor] = {}
        for s, count in enumerate(replicas):
            for name, value in history[s][t // count].items():
                params[name] = value.clone().requires_grad_(True)
        micro = minibatch(t)
        other_replicas = [n for s, r in enumerate(replicas) if t % r for n in buffer_names[s]]
        kept = {n: buffers[n].clone() for n in other_replicas}
        total = sum(
            loss_fn(functional_call(model, {**params, **buffers}, (x,)), y) / len(micro)
            for x, y in micro
        )
        grads = dict(zip(params, torch.autograd.grad(total, list(params.values()))))
        with torch.no_grad():
            for name, value in kept.items():
                buffers[name].copy_(value)
        for s, count in enumerate(replicas):
            for name in names[s]:
                sums[s][name] += grads[name] / count
            if (t + 1) % count == 0:
                for name in names[s]:
                    live[name].grad = sums[s][name]
                optimizers[s].step()
                optimizers[s].zero_grad(set_to_none=True)
                sums[s] = {n: torch.zeros_like(live[n]) for n in names[s]}
                history[s].append({n: live[n].detach().clone() for n in names[s]})
    return {n: p.detach().clone() for n, p in live.items()}
