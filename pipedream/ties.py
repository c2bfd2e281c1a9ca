"""Tied tensors: one parameter (or buffer) that a model reaches under several names.

A language model usually ties its output head to its token embedding (GPT-2, Llama 3.2, Gemma,
T5, BERT's MLM head): ``lm_head.weight`` *is* ``transformer.wte.weight``. ``named_parameters()``
lists such a tensor once, under its first name (the *canonical* name); ``state_dict()`` lists
it under every name. A pipeline that cuts the model between the layers that use it gives each
of those stages a copy; the runtime keeps the copies equal (``docs/architecture.md``, "Tied
parameters"), checkpoints store the tensor once under its canonical name, and the full state
dict is rebuilt with every name (:func:`expand_aliases`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor, nn

__all__ = ["TiedTensor", "alias_map", "expand_aliases", "find_tied", "owned_layers"]

Value = TypeVar("Value")


@dataclass(frozen=True)
class TiedTensor:
    """One tensor of a model reached under several names."""

    names: tuple[str, ...]
    """Every name of the tensor in the model, the canonical one (``named_parameters()``'s)
    first, then the others in ``state_dict()`` order."""
    is_parameter: bool
    """A parameter (trained, its gradients summed over its uses), or a buffer."""
    nbytes: int
    """Size of the tensor."""

    @property
    def name(self) -> str:
        """The canonical name."""
        return self.names[0]


def find_tied(model: nn.Module) -> tuple[TiedTensor, ...]:
    """The tensors of ``model`` that have more than one name, in canonical-name order."""
    groups: dict[int, list[str]] = {}
    tensors: dict[int, tuple[Tensor, bool]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
        tensors[id(param)] = (param, True)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(buffer), []).append(name)
        tensors[id(buffer)] = (buffer, False)
    tied = []
    for key, names in groups.items():
        if len(names) > 1:
            tensor, is_parameter = tensors[key]
            tied.append(
                TiedTensor(tuple(names), is_parameter, tensor.numel() * tensor.element_size())
            )
    return tuple(tied)


def alias_map(tied: Iterable[TiedTensor]) -> dict[str, str]:
    """Every non-canonical name -> its canonical name."""
    return {alias: t.name for t in tied for alias in t.names[1:]}


def expand_aliases(state: Mapping[str, Value], groups: Iterable[Sequence[str]]) -> dict[str, Value]:
    """``state`` with every name of each group of tied names mapped to the value stored under
    one of them (the same object: a state dict with the tie intact)."""
    out = dict(state)
    for names in groups:
        stored = next((name for name in names if name in state), None)
        if stored is None:
            continue
        for name in names:
            out[name] = state[stored]
    return out


def owned_layers(layer_names: Sequence[str], tensor_names: Iterable[str]) -> list[int]:
    """Indices of the layers (module paths) under which any of ``tensor_names`` lies."""
    found = set()
    for name in tensor_names:
        for index, layer in enumerate(layer_names):
            if name.startswith(layer + "."):
                found.add(index)
    return sorted(found)
