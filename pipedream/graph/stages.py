"""Stage modules cut from a layer graph: an ``fx.GraphModule`` per contiguous layer range.

A stage module takes its input values and returns its output values as a tuple; its parameters
and buffers are the model's own tensors under the model's own names, so the weight-version
swap (weight stashing) and ``state_dict()`` (checkpoints) work exactly as for ``nn.Sequential``
stages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx, nn

from pipedream.errors import WorkloadError
from pipedream.graph.layers import LayerGraph, StageIO

__all__ = ["build_stage_module", "stage_ios", "stages_using"]


def stage_ios(graph: LayerGraph, ranges: Sequence[tuple[int, int]]) -> list[StageIO]:
    """What every stage receives from and sends to which stage, for layer ranges (inclusive).

    The first stage reads every model input from the data; an input that a later stage uses is
    sent to it by the first stage, as a skip connection is. A model output made before the last
    stage is sent to the last stage, which hands all of them to the loss.
    """
    stage_of_layer = {}
    for stage, (first, last) in enumerate(ranges):
        for layer in range(first, last + 1):
            stage_of_layer[layer] = stage
    num_stages = len(ranges)
    last_stage = num_stages - 1

    def stage_of_value(value: str) -> int:
        layer = graph.defined_in(value)
        return 0 if layer == -1 else stage_of_layer[layer]

    # producer stage -> consumer stage -> values, in graph order
    sends: dict[int, dict[int, list[str]]] = {s: {} for s in range(num_stages)}

    def send(value: str, producer: int, consumer: int) -> None:
        if consumer < producer:
            raise WorkloadError(f"value {value} flows backwards between stages")
        if consumer > producer:
            values = sends[producer].setdefault(consumer, [])
            if value not in values:
                values.append(value)

    returned = set(graph.output_names)
    for node in graph.program.graph.nodes:
        if node.name not in graph.input_names and node.name not in graph.layer_of:
            continue
        producer = stage_of_value(node.name)
        for user in node.users:
            if user.op == "output" or user.name not in graph.layer_of:
                continue
            send(node.name, producer, stage_of_layer[graph.layer_of[user.name]])
        if node.name in returned:
            send(node.name, producer, last_stage)
    ios = []
    for stage in range(num_stages):
        producers = tuple((p, tuple(sends[p][stage])) for p in range(stage) if stage in sends[p])
        inputs = tuple(v for _, values in producers for v in values)
        if stage == 0:
            producers = ((-1, graph.input_names),)
            inputs = graph.input_names
        consumers = tuple((c, tuple(values)) for c, values in sorted(sends[stage].items()))
        if stage == last_stage:
            outputs: tuple[str, ...] = graph.output_names
        else:
            outputs = tuple(dict.fromkeys(v for _, values in consumers for v in values))
        no_grad = frozenset(v for v in (*inputs, *outputs) if v not in graph.differentiable)
        ios.append(StageIO(stage, inputs, producers, outputs, consumers, no_grad))
    return ios


def stages_using(graph: LayerGraph, ranges: Sequence[tuple[int, int]]) -> dict[str, list[int]]:
    """Canonical name of every parameter and buffer -> the stages whose layers use it."""
    stage_of_layer = {}
    for stage, (first, last) in enumerate(ranges):
        for layer in range(first, last + 1):
            stage_of_layer[layer] = stage
    users: dict[str, list[int]] = {}
    for layer in range(len(graph.layers)):
        for name in graph.layer_state_names(layer):
            stages = users.setdefault(name, [])
            if stage_of_layer[layer] not in stages:
                stages.append(stage_of_layer[layer])
    return users


def _attach(root: nn.Module, name: str, value: object) -> None:
    """Put ``value`` at the dotted path ``name`` below ``root``, creating holders: a parameter
    or a buffer (which moves with the stage), a module, or another constant as an attribute."""
    *parents, leaf = name.split(".")
    module = root
    for part in parents:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(value, nn.Parameter):
        module.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(leaf, value)
    elif isinstance(value, nn.Module):
        module.add_module(leaf, value)
    else:
        setattr(module, leaf, value)


def build_stage_module(
    graph: LayerGraph, model: nn.Module, first: int, last: int, io: StageIO
) -> fx.GraphModule:
    """The GraphModule running layers ``first..last`` (inclusive) on ``io.inputs``.

    Parameters and buffers are the ``model``'s own tensor objects (shared, not copied).
    """
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    saved = set(model.state_dict(keep_vars=True))
    constants = graph.program.constants
    root = nn.Module()
    new = fx.Graph()
    env: dict[str, fx.Node] = {}
    for value in io.inputs:
        env[value] = new.placeholder(value)

    def lookup(node: fx.Node) -> fx.Node:
        if node.name in env:
            return env[node.name]
        if node.op == "get_attr":
            # the body of a region (no_grad, autocast) the graph calls, or a constant of a
            # higher-order op (the pytree spec a flat_apply calls with, as an index inside
            # torch.vmap makes: transformers 4's attention masks)
            target = str(node.target)
            if not _has_path(root, target):
                value: object = graph.program.graph_module
                for part in target.split("."):
                    value = getattr(value, part)
                _attach(root, target, value)
            env[node.name] = new.get_attr(target)
            return env[node.name]
        target = graph.tensor_names.get(node.name)
        if target is None:
            raise AssertionError(f"stage {io.stage} needs {node.name}, which it does not get")
        if target not in state and target not in constants:
            raise AssertionError(f"unknown model tensor {target}")
        if not _has_path(root, target):
            _attach(root, target, state[target] if target in state else constants[target])
        env[node.name] = new.get_attr(target)
        return env[node.name]

    for node in graph.nodes:
        if first <= graph.layer_of[node.name] <= last:
            env[node.name] = new.node_copy(node, lookup)
    new.output(tuple(env[value] for value in io.outputs))
    module = fx.GraphModule(root, new, class_name=f"Stage{io.stage}")
    # buffers the model keeps out of its state dict (and constants) stay out of the stage's
    for name, _ in module.named_buffers():
        if name not in saved:
            path, _, leaf = name.rpartition(".")
            module.get_submodule(path)._non_persistent_buffers_set.add(leaf)
    return module


def _has_path(root: nn.Module, name: str) -> bool:
    module: object = root
    for part in name.split("."):
        if not hasattr(module, part):
            return False
        module = getattr(module, part)
    return True
