"""How a workload's inputs reach its model and the model's output reaches the loss.

A workload's ``example_input`` (and every dataset item's input) is one tensor, a tuple of
tensors (positional arguments) or a dict of tensors (keyword arguments: ``input_ids``,
``attention_mask``, ...); :func:`call_model` calls the model with it as a user would. The model
may return one tensor or any structure of tensors (a tuple, a dict, a Hugging Face
``ModelOutput``); the loss receives exactly that structure.

Stages exchange flat lists of tensors, so a traced model's inputs are flattened in the order of
its exported signature, and the last stage rebuilds the model's output structure from its flat
outputs before it calls the loss (:class:`ModelIO`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from pipedream.errors import WorkloadError

__all__ = [
    "ModelIO",
    "batch_size",
    "call_model",
    "first_device",
    "map_tensors",
    "model_args",
    "tensors_in",
    "to_device",
]


def model_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a model call: a dict is keyword arguments, a tuple or list
    positional arguments, anything else the one positional argument."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def call_model(model: nn.Module | Callable[..., Any], inputs: Any) -> Any:
    """``model(inputs)``, ``model(*inputs)`` or ``model(**inputs)`` (see :func:`model_args`)."""
    args, kwargs = model_args(inputs)
    return model(*args, **kwargs)


def map_tensors(fn: Callable[[Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (tuples, lists, dicts kept)."""
    return pytree.tree_map_only(Tensor, fn, value)


def tensors_in(value: Any) -> list[Tensor]:
    """Every tensor in ``value`` (nested tuples, lists, dicts), in order."""
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, Tensor)]


def to_device(value: Any, device: torch.device) -> Any:
    """``value``'s tensors on ``device``. To a GPU from the CPU they go through pinned memory
    without waiting (``non_blocking``): a plain copy from pageable memory waits for every
    kernel queued before it, which on the first and last stage of a pipeline would stop the
    host once per microbatch."""
    if device.type != "cuda":
        return map_tensors(lambda t: t.to(device), value)

    def move(tensor: Tensor) -> Tensor:
        if tensor.device.type == "cpu":
            return tensor.pin_memory().to(device, non_blocking=True)
        return tensor.to(device)

    return map_tensors(move, value)


def batch_size(inputs: Any) -> int:
    """The leading dimension of the first tensor of ``inputs`` (the samples of a microbatch)."""
    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise WorkloadError(
        "the workload's example_input holds no tensor with a batch dimension; give a tensor, "
        "a tuple or a dict of tensors whose first dimension is the microbatch"
    )


@dataclass(frozen=True)
class ModelIO:
    """The flat tensor lists of a stage pipeline, against the model's own inputs and output.

    Without specs (an ``nn.Sequential``, cut between its children without tracing) the model
    takes one tensor and returns one tensor.
    """

    in_spec: pytree.TreeSpec | None = None
    """The exported ``(args, kwargs)`` structure (None: one tensor)."""
    out_spec: pytree.TreeSpec | None = None
    """The exported output structure (None: one tensor)."""
    num_inputs: int = 1
    """How many tensors the flattened inputs hold."""

    def flatten_inputs(self, inputs: Any) -> list[Tensor]:
        """The model's tensor inputs, in the order the first stage takes them."""
        if self.in_spec is None:
            if not isinstance(inputs, Tensor):
                raise WorkloadError(
                    f"an nn.Sequential model takes one tensor, but the data gives "
                    f"{type(inputs).__name__}; return a tensor input from the dataset, or use "
                    "a model that torch.export traces (several inputs are cut from its graph)"
                )
            return [inputs]
        try:
            leaves = fx_pytree.tree_flatten_spec(model_args(inputs), self.in_spec)
        except Exception as exc:  # pytree raises several types for a structure mismatch
            raise WorkloadError(
                f"the data's inputs do not have the structure of the example input the model "
                f"was traced with ({type(exc).__name__}: {exc}); give every dataset item the "
                "same tuple or dict of tensors as example_input"
            ) from None
        tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        if len(tensors) != self.num_inputs:
            raise WorkloadError(
                f"the data gives {len(tensors)} input tensors, the traced model takes "
                f"{self.num_inputs}; give every dataset item the structure of example_input"
            )
        return tensors

    def unflatten_outputs(self, outputs: list[Tensor]) -> Any:
        """The model's own output (what the loss takes) from the last stage's flat outputs."""
        if self.out_spec is None:
            assert len(outputs) == 1, len(outputs)
            return outputs[0]
        return pytree.tree_unflatten(outputs, self.out_spec)


def first_device(inputs: Any) -> torch.device:
    """The device of the first tensor of ``inputs`` (the CPU if there is none)."""
    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")
