"""Cutting a workload model into stage modules whose parameter names are the model's own.

``nn.Sequential`` models are cut between children without tracing; any other model is traced
with ``torch.export`` and cut at module boundaries of its graph (see ``pipedream.graph``).

A parameter that layers of several stages use (tied weights) belongs to the first of those
stages; each later one holds a copy (:class:`SharedTensor`, the runtime's
:class:`~pipedream.runtime.stage_worker.TiedLinks`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from pipedream.errors import FormatError, WorkloadError
from pipedream.formats.plan import Plan
from pipedream.graph import LayerGraph, StageIO, trace_model
from pipedream.graph.stages import build_stage_module as build_graph_stage
from pipedream.graph.stages import stage_ios, stages_using
from pipedream.model_io import ModelIO
from pipedream.runtime.routing import sequential_ios
from pipedream.runtime.stage_worker import TiedLinks
from pipedream.ties import TiedTensor, find_tied, owned_layers
from pipedream.workload import Workload

__all__ = [
    "SharedTensor",
    "StageLayout",
    "build_stage_module",
    "layer_names",
    "stage_layer_names",
    "stage_layout",
]


@dataclass(frozen=True)
class SharedTensor:
    """A parameter or buffer of the model that layers of several stages use."""

    name: str
    """Its canonical name (the first of its names in the model)."""
    stages: tuple[int, ...]
    """The stages that use it, ascending (two or more); the first owns it."""
    is_parameter: bool
    """A parameter (the copies trade gradients and versions with the owner) or a buffer (each
    stage keeps its own; a checkpoint stores the owner's)."""

    @property
    def owner(self) -> int:
        return self.stages[0]


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
    model: nn.Module
    """The whole model the stage modules are cut from."""
    model_io: ModelIO = field(default_factory=ModelIO)
    """How the model's inputs and output map to the stages' flat tensor lists."""
    tied: tuple[TiedTensor, ...] = ()
    """Every tensor of the model that has several names (checkpoints rebuild all of them)."""
    shared: tuple[SharedTensor, ...] = ()
    """The tensors used by layers of more than one stage."""

    @property
    def tied_pairs(self) -> tuple[tuple[int, int], ...]:
        """(owner stage, copy stage) pairs of the shared parameters (the schedule's ``tied``)."""
        pairs = {
            (shared.owner, stage)
            for shared in self.shared
            if shared.is_parameter
            for stage in shared.stages[1:]
        }
        return tuple(sorted(pairs))

    def tied_links(self, stage: int, module: nn.Module) -> TiedLinks:
        """The shared parameters of ``stage`` by their names in its ``module``."""
        local = _local_names(self.model, module)
        owned: dict[int, list[str]] = {}
        copies: dict[int, list[str]] = {}
        for shared in sorted(self.shared, key=lambda s: s.name):
            if not shared.is_parameter or stage not in shared.stages:
                continue
            if stage == shared.owner:
                for copy in shared.stages[1:]:
                    owned.setdefault(copy, []).append(local[shared.name])
            else:
                copies.setdefault(shared.owner, []).append(local[shared.name])
        return TiedLinks(
            owned={s: tuple(names) for s, names in owned.items()},
            copies={s: tuple(names) for s, names in copies.items()},
        )

    def stored_elsewhere(self, stage: int, module: nn.Module) -> set[str]:
        """Names in ``module``'s state dict of shared tensors that an earlier stage owns (a
        checkpoint stores each tensor once: in its owner's file)."""
        tensors = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        others = {
            id(tensors[shared.name])
            for shared in self.shared
            if stage in shared.stages and stage != shared.owner
        }
        state = module.state_dict(keep_vars=True)
        return {name for name, tensor in state.items() if id(tensor) in others}


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
        tied = find_tied(model)
        stage_of = {layer: s for s, group in enumerate(groups) for layer in group}
        shared = []
        for tensor in tied:
            stages = sorted({stage_of[names[i]] for i in owned_layers(names, tensor.names)})
            if len(stages) > 1:
                shared.append(SharedTensor(tensor.name, tuple(stages), tensor.is_parameter))
        return StageLayout(
            names,
            sequential_ios(plan.num_stages),
            None,
            lambda s: build_stage_module(model, groups[s]),
            model,
            tied=tied,
            shared=tuple(shared),
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
    parameters = dict(model.named_parameters())
    shared = tuple(
        SharedTensor(name, tuple(sorted(stages)), name in parameters)
        for name, stages in stages_using(graph, ranges).items()
        if len(stages) > 1
    )
    return StageLayout(
        graph.layers,
        ios,
        edges,
        lambda s: build_graph_stage(graph, model, *ranges[s], ios[s]),
        model,
        model_io=graph.model_io,
        tied=find_tied(model),
        shared=shared,
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


def _local_names(model: nn.Module, module: nn.Module) -> dict[str, str]:
    """Canonical name of each of the model's parameters -> its name in a stage ``module``."""
    local = {id(param): name for name, param in module.named_parameters()}
    return {
        name: local[id(param)] for name, param in model.named_parameters() if id(param) in local
    }


def build_stage_module(model: nn.Module, names: Sequence[str]) -> nn.Sequential:
    """An ``nn.Sequential`` of the named children, keeping their names.

    Its ``state_dict()`` keys are therefore exactly the full model's keys for those layers, so a
    stage's state is a slice of the model's state dict (docs/architecture.md, "The runtime").
    """
    children = dict(model.named_children())
    return nn.Sequential(OrderedDict((name, children[name]) for name in names))
