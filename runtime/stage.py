"""Cutting a workload model into stage modules whose parameter names are the model's own.

``nn.Sequential`` models are cut between children without tracing; any other model is traced
with ``torch.export`` and cut at module boundaries of its graph (see ``pipedream.graph``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from pipedream.errors import FormatError, WorkloadError
from pipedream.formats.plan import Plan
from pipedream.graph import LayerGraph, StageIO, trace_model
from pipedream.graph.stages import build_stage_module as build_graph_stage
from pipedream.graph.stages import stage_ios
from pipedream.runtime.routing import sequential_ios
from pipedream.workload import Workload

__all__ = ["StageLayout", "build_stage_module", "layer_names", "stage_layer_names", "stage_layout"]


@dataclass(frozen=True)
class StageLayout:
    """How a plan cuts a workload's model: layers, stage wiring and stage modules."""

    layers: list[str]
    """All layer names, in execution order."""
    ios: list[StageIO]
    """What each stage takes from and sends to which stage."""
    edges: tuple[tuple[int, int], ...] | None
    """Stage pairs that exchange tensors (None: a plain chain)."""
    build: Callable[[int], nn.Module]
    """Builds the module of a stage (sharing the model's parameter tensors)."""


def layer_names(model: nn.Module) -> list[str]:
    """The layers of an ``nn.Sequential`` workload model: its children."""
    assert isinstance(model, nn.Sequential)
    return [name for name, _ in model.named_children()]


def stage_layout(workload: Workload, plan: Plan, *, source: str) -> StageLayout:
    """Cut the model as the plan says: an ``nn.Sequential`` between its children directly; any
    other model, or finer layers (``pipedream profile --depth``), through the model's
    ``torch.export`` graph at the plan's layer granularity."""
    model = workload.model
    children = layer_names(model) if isinstance(model, nn.Sequential) else None
    if children is not None and (plan.layers is None or list(plan.layers) == children):
        names = children
        groups = stage_layer_names(plan, names, source=source)
        return StageLayout(
            names,
            sequential_ios(plan.num_stages),
            None,
            lambda s: build_stage_module(model, groups[s]),
        )
    program = trace_model(model, workload.example_input)
    names = list(plan.layers) if plan.layers else LayerGraph.auto_layer_names(program, model)
    try:
        graph = LayerGraph(program, names)
    except WorkloadError as exc:
        if not plan.layers:
            raise
        raise FormatError(
            source,
            "layers",
            f"do not match the traced model: {exc}",
            "re-run `pipedream profile` and `pipedream plan` for this workload and its arguments",
        ) from None
    groups = stage_layer_names(plan, graph.layers, source=source)
    index = {name: i for i, name in enumerate(graph.layers)}
    ranges = [(index[g[0]], index[g[-1]]) for g in groups]
    ios = stage_ios(graph, ranges)
    edges = tuple(sorted({(io.stage, c) for io in ios for c, _ in io.consumers}))
    return StageLayout(
        graph.layers,
        ios,
        edges,
        lambda s: build_graph_stage(graph, model, *ranges[s], ios[s]),
    )


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
