"""A traced stage moved to another device creates its tensors there (position ids included)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipedream.graph import LayerGraph, trace_model
from pipedream.graph.placement import place_module
from pipedream.graph.stages import build_stage_module, stage_ios


class Positions(nn.Module):
    """Token plus position embeddings, the positions made as Hugging Face models make them."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(10, 4)
        self.positions = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 10)

    def forward(self, ids: Tensor) -> Tensor:
        where = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.head(self.tokens(ids) + self.positions(where))


def _stage() -> torch.fx.GraphModule:
    model = Positions()
    graph = LayerGraph(
        trace_model(model, torch.zeros(2, 8, dtype=torch.long)), ["tokens", "positions", "head"]
    )
    (io,) = stage_ios(graph, [(0, 2)])
    return build_stage_module(graph, model, 0, 2, io)


def _devices(module: torch.fx.GraphModule) -> set[torch.device]:
    found: set[torch.device] = set()
    for node in module.graph.nodes:
        torch.fx.node.map_aggregate(
            (node.args, node.kwargs),
            lambda v: found.add(v) if isinstance(v, torch.device) else None,
        )
    return found


def test_the_traced_graph_names_the_trace_device() -> None:
    assert _devices(_stage()) == {torch.device("cpu")}


def test_a_placed_stage_creates_its_tensors_on_its_device() -> None:
    meta = torch.device("meta")
    stage = place_module(_stage(), meta)
    assert _devices(stage) == {meta}
    assert all(p.device == meta for p in stage.parameters())
    (out,) = stage(torch.zeros(2, 8, dtype=torch.long, device=meta))
    assert out.device == meta and out.shape == (2, 8, 10)


def test_placing_on_the_trace_device_changes_nothing() -> None:
    stage = _stage()
    code = stage.code
    place_module(stage, torch.device("cpu"))
    assert stage.code == code
