"""A traced model whose graph reads constants that are neither tensors nor modules splits into
stages that compute what the model computes.

transformers 4 builds its attention masks by indexing inside ``torch.vmap`` under
``TransformGetItemToIndex``; ``torch.export`` records each such index as a ``flat_apply`` of a
``TreeSpec`` held on the graph module. A stage built from that graph took every attribute it
read for a module or a tensor, and failed ("`function_const_func_spec0` is not an nn.Module").
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipedream.graph import LayerGraph, trace_model
from pipedream.graph.placement import place_module
from pipedream.graph.stages import build_stage_module, stage_ios

wrapped = pytest.importorskip("torch._dynamo._trace_wrapped_higher_order_op")


class VmappedMask(nn.Module):
    """Two linear layers; the second sees the first's output under a mask made by indexing a
    boolean vector inside ``torch.vmap``, as transformers 4 makes a padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.first(x)
        keep = x[0] > 0
        with wrapped.TransformGetItemToIndex():
            mask = torch.vmap(lambda i: keep[i])(torch.arange(4))
        return self.second(hidden * mask)


@pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 9),
    reason="torch.export of torch 2.8 cannot trace an index inside torch.vmap",
)
def test_stages_of_a_graph_with_a_treespec_constant_compute_the_model() -> None:
    torch.manual_seed(0)
    model = VmappedMask()
    x = torch.randn(2, 4)
    graph = LayerGraph(trace_model(model, x), ["first", "second"])
    getattrs = [n.target for n in graph.program.graph.nodes if n.op == "get_attr"]
    held = [type(getattr(graph.program.graph_module, str(t))).__name__ for t in getattrs]
    assert "TreeSpec" in held  # what the case is about: a constant that is not a tensor
    ios = stage_ios(graph, [(0, 0), (1, 1)])
    stages = [
        place_module(build_stage_module(graph, model, i, i, io), torch.device("cpu"))
        for i, io in enumerate(ios)
    ]
    sent = dict(zip(ios[0].outputs, stages[0](x), strict=True))
    received = [x if name in ios[0].inputs else sent[name] for name in ios[1].inputs]
    (out,) = stages[1](*received)
    want = model(x)
    assert torch.equal(out, want)
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    want.sum().backward()
    assert grads.keys() == {n for n, _ in model.named_parameters()}
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())


def test_a_constant_at_a_dotted_path_is_held_where_the_graph_reads_it() -> None:
    """A get_attr target below a holder ("holder.spec"): the stage's root gets the holder, as
    for a tensor, so GraphModule finds the constant by walking the path (and a tensor there is a
    buffer, which moves with the stage to its device)."""
    from torch import fx
    from torch.utils._pytree import tree_flatten

    from pipedream.graph.stages import _attach

    spec = tree_flatten((1, [2]))[1]
    root = nn.Module()
    _attach(root, "holder.spec", spec)
    _attach(root, "holder.scale", torch.tensor(2.0))
    graph = fx.Graph()
    x = graph.placeholder("x")
    read = graph.call_function(str, (graph.get_attr("holder.spec"),))
    graph.output((graph.call_function(torch.mul, (x, graph.get_attr("holder.scale"))), read))
    module = fx.GraphModule(root, graph)
    out, text = module(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0)) and text == str(spec)
    assert [name for name, _ in module.named_buffers()] == ["holder.scale"]
