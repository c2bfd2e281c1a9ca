"""Checks in an exported graph (``x.to(dtype)`` exports as ``_assert_tensor_metadata`` of ``x``,
then the conversion) run with the operation after them, whatever module they are recorded under.

torch 2.8 records such a check under the module that made ``x``: a Llama layer's cast of its
input was filed under ``model.embed_tokens``, after ``model.rotary_emb`` had run, and every
Hugging Face Llama, Mistral and Qwen2 model was refused as "layer 'model.embed_tokens' runs again
after layer 'model.rotary_emb'". These tests give a graph the records torch 2.8 writes.
"""

from __future__ import annotations

import torch
from torch import Tensor, fx, nn

from pipedream.graph import LayerGraph, trace_model

B = 4


class Block(nn.Module):
    """Casts its input first, as a transformer layer's norm does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h: Tensor, side: Tensor) -> Tensor:
        return self.linear(h.to(torch.float32)) + side


class Model(nn.Module):
    """An embedding, a module that runs on the raw input (a rotary table), then the block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)
        self.block = Block()
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        side = self.side(x)
        return self.head(self.block(h, side))


def _check_of_block_input(program: torch.export.ExportedProgram) -> fx.Node:
    checks = [
        node
        for node in program.graph.nodes
        if node.op == "call_function" and "_assert_tensor_metadata" in str(node.target)
    ]
    assert len(checks) == 1, checks  # the cast of the block's input
    return checks[0]


def _recorded_as_torch_2_8_does() -> tuple[torch.export.ExportedProgram, fx.Node]:
    program = trace_model(Model(), torch.randn(B, 8))
    check = _check_of_block_input(program)
    producer = check.args[0]
    assert isinstance(producer, fx.Node)
    check.meta["nn_module_stack"] = dict(producer.meta["nn_module_stack"])  # under "embed"
    return program, check


def test_a_check_recorded_under_an_earlier_layer_runs_with_the_operation_it_guards() -> None:
    program, check = _recorded_as_torch_2_8_does()
    graph = LayerGraph(program, ["embed", "side", "block", "head"])
    cast = check.next  # the conversion the check guards, in the block
    assert graph.layer_of[check.name] == graph.layer_of[cast.name] == 2
    # into the block cross the embedding's output and the side branch's, nothing more
    assert graph.crossing(1) == ["linear", "linear_1"] and check.args[0].name == "linear"


def test_a_check_with_a_made_up_module_makes_no_layer() -> None:
    program, check = _recorded_as_torch_2_8_does()
    check.meta["nn_module_stack"] = {
        "hook": ("_empty_nn_module_stack_from_metadata_hook", "torch.nn.Module")
    }
    assert LayerGraph.depth_layer_names(program, 1) == ["embed", "side", "block", "head"]
    assert LayerGraph.pattern_layer_names(program, ["bl*"]) == ["embed", "side", "block", "head"]
