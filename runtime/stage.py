"""Cutting a workload model into stage modules whose parameter names are the model's own."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from pipedream.errors import FormatError, WorkloadError
from pipedream.formats.plan import Plan

__all__ = ["layer_names", "stage_layer_names", "build_stage_module"]


def layer_names(model: nn.Module) -> list[str]:
    """The layers of a workload model: the children of an ``nn.Sequential``."""
    if not isinstance(model, nn.Sequential):
        raise WorkloadError(
            f"the runtime splits nn.Sequential models into stages, got {type(model).__name__}; "
            "wrap the model's layers in an nn.Sequential"
        )
    return [name for name, _ in model.named_children()]


def stage_layer_names(plan: Plan, names: Sequence[str], *, source: str) -> list[list[str]]:
    """The layer names of every stage of ``plan``, checked against the model's ``names``."""
    position = {name: i for i, name in enumerate(names)}
    if plan.layers is not None and list(plan.layers) != list(names):
        raise FormatError(
            source,
            "layers",
            f"the plan lists {len(plan.layers)} layers that differ from the model's "
            f"{len(names)} layers ({names[0]!r}..{names[-1]!r})",
            "re-run `pipedream profile` and `pipedream plan` for this workload and its arguments",
        )
    out = []
    expected = 0
    for index, stage in enumerate(plan.stages):
        for key in ("first_layer", "last_layer"):
            name = getattr(stage, key)
            if name not in position:
                raise FormatError(
                    source,
                    f"stages[{index}].{key}",
                    f"the model has no layer {name!r}",
                    f"use one of the model's layers {names[0]!r}..{names[-1]!r}",
                )
        first, last = position[stage.first_layer], position[stage.last_layer]
        if last < first:
            raise FormatError(
                source,
                f"stages[{index}].last_layer",
                f"{stage.last_layer!r} comes before first_layer {stage.first_layer!r} in the model",
                "a stage is the layer range first_layer..last_layer in model order",
            )
        if first != expected:
            raise FormatError(
                source,
                f"stages[{index}].first_layer",
                f"is {stage.first_layer!r} but must be {names[expected]!r} (the layer after the "
                "previous stage)",
                "stages must be contiguous, in order, and cover every layer once",
            )
        out.append(list(names[first : last + 1]))
        expected = last + 1
    if expected != len(names):
        raise FormatError(
            source,
            "stages",
            f"end at layer {names[expected - 1]!r} but the model continues to {names[-1]!r}",
            f"let the last stage end at {names[-1]!r}",
        )
    return out


def build_stage_module(model: nn.Module, names: Sequence[str]) -> nn.Sequential:
    """An ``nn.Sequential`` of the named children, keeping their names.

    Its ``state_dict()`` keys are therefore exactly the full model's keys for those layers, so a
    stage's state is a slice of the model's state dict (DESIGN.md section 5).
    """
    children = dict(model.named_children())
    return nn.Sequential(OrderedDict((name, children[name]) for name in names))
