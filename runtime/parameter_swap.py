"""Calling a stage module on other tensors than its parameters, at little cost per tensor.

Every forward of a stage runs on a *version* of its weights
(:mod:`pipedream.runtime.weight_versions`): tensors that stand in for the module's parameters
for the length of one call.
``torch.func.functional_call`` does that for any module, but it swaps each tensor in and out
through ``delattr``/``setattr`` with their checks, a cost per tensor and per call that grows with
the number of parameters and matters next to small layers. This swap assigns the tensors
directly, so a call through it costs about what the plain module call costs.

:class:`ParameterSwap` puts the tensors straight into their owners' ``_parameters`` (where
``nn.Module.__getattr__`` finds them) and puts the parameters back when the call ends, also when
it raises. Tied parameters (one ``nn.Parameter`` under several names) all get the tensor given
for the name ``named_parameters()`` lists. A module that overrides ``__setattr__`` may keep
state derived from its parameters up to date there, which a swap that bypasses ``setattr`` would
leave stale (``nn.RNNBase`` keeps ``_flat_weights`` that way; torch 2.x also refreshes them in its
forward, but a user's module need not), so a stage that contains one is called through
``functional_call`` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["ParameterSwap"]


class ParameterSwap:
    """Calls ``module`` with given tensors in place of its parameters (buffers stay)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        canonical = {id(p): name for name, p in module.named_parameters()}
        self.names = frozenset(canonical.values())
        """The names the tensors must be given under (``module.named_parameters()``)."""
        # (owner module, attribute, name of the tensor to put there), aliases included
        self._slots: list[tuple[nn.Module, str, str]] = []
        for name, param in module.named_parameters(remove_duplicate=False):
            path, _, attribute = name.rpartition(".")
            owner = module.get_submodule(path)
            self._slots.append((owner, attribute, canonical[id(param)]))
        self.direct = all(
            type(owner).__setattr__ is nn.Module.__setattr__ for owner in module.modules()
        )
        """Whether tensors go straight into ``_parameters`` (False: ``functional_call``)."""

    def __call__(self, tensors: Mapping[str, Tensor], inputs: Sequence[Any]) -> Any:
        """``module(*inputs)`` with ``tensors[name]`` as the parameter ``name``."""
        assert set(tensors) == self.names, sorted(set(tensors) ^ self.names)
        if not self.direct:
            return functional_call(self.module, dict(tensors), tuple(inputs))
        saved = [owner._parameters[attribute] for owner, attribute, _ in self._slots]
        try:
            for owner, attribute, name in self._slots:
                owner._parameters[attribute] = tensors[name]  # type: ignore[assignment]
            return self.module(*inputs)
        finally:
            for (owner, attribute, _), param in zip(self._slots, saved):
                owner._parameters[attribute] = param
