"""Splitting a stage's backward into its input-gradient half (I) and weight-gradient half (W).

Zero-bubble schedules run ``I`` as soon as the next stage's gradient arrives, since the
previous stage waits for what it computes, and ``W`` later, in a bubble. ``I`` must not compute
what ``W`` will: the gradient of a module's own weights needs only the module's output gradient,
so ``I`` asks autograd for the gradients of the stage inputs *and* of the outputs of the modules
whose weights ``W`` handles, and ``W`` then asks, module by module, for the weights' gradients
from those outputs (``autograd.grad(output, weights, output_gradient)``: autograd walks only
the module's own operations, as the paths to other tensors are not asked for).

A weight is deferred to ``W`` when exactly one module uses it directly, once per forward: a
weight several modules share (a tied embedding and head), or a module called twice, would reach
its weights through another module's output too, and the module-by-module gradients would
count that path twice. Those weights, the stage's copies of other stages' tied parameters, and
weights no module call records (a traced ``fx.GraphModule`` stage calls operations, not
modules) get their gradients in ``I``. ``I`` then computes every gradient of a stage whose
weights are all of that kind, and ``W`` has nothing left to do: the numbers are the same either
way.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipedream.model_io import tensors_in

__all__ = ["BackwardSplit", "Deferred", "weight_gradients"]

Deferred = dict[nn.Module, list[Any]]
"""A forward's record: module -> its outputs in that forward (one per call)."""


class BackwardSplit:
    """Which weights of a stage wait for ``W``, and the forward hooks that record the outputs
    ``W`` starts from."""

    def __init__(self, module: nn.Module, *, exclude: frozenset[str] = frozenset()) -> None:
        canonical = {id(p): name for name, p in module.named_parameters()}
        uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
        self.weights: dict[nn.Module, tuple[str, ...]] = {}
        """Module -> the names of its own weights that may wait for ``W``."""
        for sub in module.modules():
            names = tuple(
                canonical[id(p)]
                for p in sub.parameters(recurse=False)
                if uses[id(p)] == 1 and canonical[id(p)] not in exclude
            )
            if names:
                self.weights[sub] = names
        self._record: Deferred | None = None
        for sub in self.weights:
            sub.register_forward_hook(self._hook)

    def _hook(self, sub: nn.Module, args: Any, output: Any) -> None:
        if self._record is not None:
            self._record.setdefault(sub, []).append(output)

    @contextlib.contextmanager
    def recording(self) -> Iterator[Deferred]:
        """Record the module outputs of the forward run inside the block."""
        record: Deferred = {}
        self._record = record
        try:
            yield record
        finally:
            self._record = None

    def deferred(self, record: Deferred) -> dict[nn.Module, list[Tensor]]:
        """Of one forward's ``record``: module -> its output tensors that carry gradient, for the
        modules called exactly once (their weights wait for ``W``)."""
        out: dict[nn.Module, list[Tensor]] = {}
        for sub, calls in record.items():
            if len(calls) == 1:
                tensors = [t for t in tensors_in(calls[0]) if t.requires_grad]
                if tensors:
                    out[sub] = tensors
        return out

    def deferred_names(self, outputs: Mapping[nn.Module, Sequence[Tensor]]) -> set[str]:
        return {name for sub in outputs for name in self.weights[sub]}


def weight_gradients(
    split: BackwardSplit,
    outputs: Mapping[nn.Module, Sequence[Tensor]],
    output_grads: Mapping[nn.Module, Sequence[Tensor | None]],
    params: Mapping[str, Tensor],
) -> dict[str, Tensor | None]:
    """``W``: the gradients of the deferred weights, module by module, from the module outputs'
    gradients that ``I`` computed."""
    grads: dict[str, Tensor | None] = {}
    for sub, tensors in outputs.items():
        names = split.weights[sub]
        pairs = [(t, g) for t, g in zip(tensors, output_grads[sub]) if g is not None]
        if not pairs:
            grads.update(dict.fromkeys(names))
            continue
        computed = torch.autograd.grad(
            [t for t, _ in pairs],
            [params[name] for name in names],
            [g for _, g in pairs],
            retain_graph=True,
            allow_unused=True,
        )
        grads.update(zip(names, computed))
    return grads
