"""A model whose forward has a ``torch.no_grad()`` region (a Hugging Face Llama's rotary
embedding, under Python 3.10) is cut into stages and trains as one process does.

torch.export keeps such a region as a submodule that the graph calls with gradients off
(``wrap_with_set_grad_enabled``). A stage that ran the region failed to build ("stage 0 needs
submod_3, which it does not get"), and the region's result, made from a parameter's output,
was taken to carry a gradient back.
"""

from __future__ import annotations

import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.graph.stages import stage_ios
from pipedream.profiler.graph_profile import layer_graph
from pipedream.workload import load_workload

from oracles import plain_training
from reference_run import reference_layout_weights
from runs import max_rel_diff

WORKLOAD = "no_grad_model:build"
B, M, STEPS = 4, 2, 4


def test_the_region_is_one_operation_of_its_layer_and_its_result_carries_no_gradient() -> None:
    workload = load_workload(WORKLOAD, {}, microbatch_size=B)
    graph = layer_graph(workload.model, workload.example_input)
    assert graph.layers == ["embed", "table", "mid", "head"]
    regions = [n for n in graph.nodes if "wrap_with_set_grad_enabled" in str(n.target)]
    assert len(regions) == 1 and graph.layer_of[regions[0].name] == 1
    (table_output,) = [user.name for user in regions[0].users]  # the region's one result
    (io,) = [io for io in stage_ios(graph, [(0, 1), (2, 3)]) if io.stage == 1]
    assert table_output in io.inputs and len(io.inputs) == 2  # and the embedding's output
    assert io.no_grad & set(io.inputs) == {table_output}


@pytest.mark.parametrize(
    ("stages", "schedule"),
    [
        ([["embed", "table"], ["mid", "head"]], "1f1b"),  # the region's result crosses
        ([["embed"], ["table", "mid"], ["head"]], "gpipe"),  # the region runs in a middle stage
    ],
)
def test_stages_with_a_no_grad_region_train_as_one_process(
    stages: list[list[str]], schedule: str
) -> None:
    got = reference_layout_weights(
        WORKLOAD, {}, stages, schedule=schedule, microbatches=M, steps=STEPS, microbatch_size=B
    )
    workload = load_workload(WORKLOAD, {}, microbatch_size=B)
    data = MicrobatchStream(workload.dataset, B, 0)

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [data.microbatch(k * M + j) for j in range(M)]
        return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])

    want = plain_training(
        workload.model,
        num_updates=STEPS,
        batch=batch,
        loss_fn=workload.loss_fn,
        optimizer=workload.optimizer,
    )
    assert torch.equal(got.pop("table.freq"), workload.model.table.freq)  # a buffer: unchanged
    assert max_rel_diff(got, want) < 1e-5
