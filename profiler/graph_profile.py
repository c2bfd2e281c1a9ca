"""Profiling any model ``torch.export`` can trace: one measurement per layer of its graph.

The model is exported once, grouped into layers (``pipedream.graph``), and every layer is cut out
as its own module taking exactly the values that reach it, so skip connections are measured
where they cross: ``output_bytes`` of a layer counts every value it sends to any later layer, and
the profile's ``cut_bytes`` counts everything live across each boundary, and its ``values``
say which layer makes each crossing tensor and which layers use it (what a plan's stages send
each other, skip connections included). Under ``bf16`` the layers run in autocast, and a
value's bytes are those of the tensor it then is (bfloat16 after a matmul), not the trace's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipedream.formats.profile import LayerProfile, ProfileValue, TiedParameter
from pipedream.graph import LayerGraph, trace_model
from pipedream.graph.stages import build_stage_module, stage_ios
from pipedream.model_io import first_device
from pipedream.precision import autocast
from pipedream.profiler.chain import ChainLayer, time_chain
from pipedream.profiler.measure import (
    OptimizerFactory,
    UpdateTimer,
    check_repetitions,
    describe_layer,
)

__all__ = ["graph_tied_parameters", "graph_values", "layer_graph", "measure_graph"]


class _Unpack(nn.Module):
    """Calls a multi-input layer module with one tuple (what ``describe_layer`` passes)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return self.inner(*inputs)


def layer_graph(
    model: nn.Module,
    example_input: Any,
    *,
    depth: int | None = None,
    patterns: Sequence[str] = (),
) -> LayerGraph:
    """Trace ``model`` and group it at the chosen granularity (default: top-level children,
    containers such as ``nn.Sequential`` expanded one level)."""
    program = trace_model(model, example_input)
    if patterns:
        names = LayerGraph.pattern_layer_names(program, patterns)
    elif depth is not None:
        names = LayerGraph.depth_layer_names(program, depth)
    else:
        names = LayerGraph.auto_layer_names(program, model)
    return LayerGraph(program, names)


def measure_graph(
    graph: LayerGraph,
    model: nn.Module,
    example_input: Any,
    *,
    warmup: int = 3,
    repeats: int = 10,
    optimizer: OptimizerFactory | None = None,
    passes: list[tuple[float, float]] | None = None,
    precision: str = "fp32",
    value_bytes: dict[str, int] | None = None,
) -> list[LayerProfile]:
    """Measure every layer of ``graph`` on the values it sees when ``example_input`` runs in
    ``precision`` (:mod:`pipedream.precision`).

    Bytes and memory come from each layer module alone, the times from whole passes through the
    chain of layer modules (:mod:`pipedream.profiler.chain`); each timed pass's forward and
    backward milliseconds are appended to ``passes`` when given, and the bytes of every value
    the layers made to ``value_bytes``.
    """
    check_repetitions(warmup, repeats)
    count = len(graph.layers)
    ios = stage_ios(graph, [(i, i) for i in range(count)])
    inputs_by_name = dict(zip(graph.input_names, graph.model_io.flatten_inputs(example_input)))
    values: dict[str, Tensor] = dict(inputs_by_name)
    profiles, chain, modules = [], [], []
    counted: set[int] = set()
    device = first_device(example_input)
    for index, io in enumerate(ios):
        module = build_stage_module(graph, model, index, index, io)
        inputs = tuple(values[name] for name in io.inputs)
        with torch.no_grad(), autocast(precision, device):
            outputs = module(*inputs)
        values.update(zip(io.outputs, outputs))
        described = describe_layer(
            graph.layers[index],
            _Unpack(module),
            inputs,
            warmup=warmup,
            repeats=repeats,
            optimizer=optimizer,
            counted=counted,
            precision=precision,
        )
        shapes = ", ".join(str(list(t.shape)) for t in outputs)
        operations = sum(1 for n in graph.nodes if graph.layer_of[n.name] == index)
        profiles.append(dataclasses.replace(described, type=f"{operations} ops -> {shapes}"))
        chain.append(ChainLayer(module, tuple(io.inputs), tuple(io.outputs)))
        modules.append(module)
    timer = UpdateTimer(modules, optimizer) if optimizer is not None else None
    times = time_chain(
        chain,
        inputs_by_name,
        model.parameters(),
        device=device,
        warmup=warmup,
        repeats=repeats,
        after_backward=timer,
        passes=passes,
        precision=precision,
    )
    if value_bytes is not None:
        sizes = {name: t.numel() * t.element_size() for name, t in values.items()}
        value_bytes.update(sizes)
    updates: list[float | None] = [None] * count
    if timer is not None:
        updates = list(timer.shares(skip=warmup))
    return [
        dataclasses.replace(profile, forward_ms=forward, backward_ms=backward, update_ms=update)
        for profile, (forward, backward), update in zip(profiles, times, updates)
    ]


def graph_tied_parameters(graph: LayerGraph, model: nn.Module) -> list[TiedParameter]:
    """The parameters that several layers of ``graph`` use (tied weights, shared modules)."""
    params = dict(model.named_parameters())
    users: dict[str, list[str]] = {}
    for index, layer in enumerate(graph.layers):
        for name in graph.layer_state_names(index):
            if name in params:
                users.setdefault(name, []).append(layer)
    return [
        TiedParameter(name, tuple(layers), params[name].numel() * params[name].element_size())
        for name, layers in users.items()
        if len(layers) > 1
    ]


def graph_values(
    graph: LayerGraph, measured: Mapping[str, int] | None = None
) -> list[ProfileValue]:
    """Every tensor of ``graph`` that a later layer or the loss uses, in graph order: the
    wiring :func:`pipedream.graph.stage_ios` gives the stages of any plan. Their bytes are the
    trace's, or ``measured`` ones where given (:func:`measure_graph`'s ``value_bytes``)."""
    sizes = measured or {}
    returned = set(graph.output_names)
    last = len(graph.layers) - 1
    values = []
    for node in graph.program.graph.nodes:
        if node.name not in graph.input_names and node.name not in graph.layer_of:
            continue
        made = graph.defined_in(node.name)
        used = sorted(
            {graph.layer_of[u.name] for u in node.users if u.name in graph.layer_of} - {made}
        )
        loss = node.name in returned
        if not used and not (loss and made < last):
            continue  # it never leaves its layer's stage
        values.append(
            ProfileValue(
                name=node.name,
                bytes=sizes[node.name] if node.name in sizes else graph.value_bytes(node.name),
                made_by=None if made == -1 else graph.layers[made],
                used_by=tuple(graph.layers[layer] for layer in used),
                loss=loss,
                grad=node.name in graph.differentiable,
            )
        )
    return values
