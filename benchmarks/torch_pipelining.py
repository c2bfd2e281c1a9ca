"""The same workloads under ``torch.distributed.pipelining`` (ScheduleGPipe, Schedule1F1B and,
for ``zb-h1``, ScheduleInterleavedZeroBubble with one stage per rank: its ZB1P schedule).

A driver launched with torchrun, one process per stage, gloo on 127.0.0.1::

    python -m torch.distributed.run --standalone --nproc-per-node S \\
        benchmarks/torch_pipelining.py CASES.json OUT.json

``CASES.json`` is a list of cases, each ``{name, workload, workload_args, stages: [[first,
last], ...], schedule: gpipe|1f1b|zb-h1, microbatches, microbatch_size, steps, warmup}``; all
cases of a file have ``len(stages) == S``. Each rank builds the workload exactly as ``pipedream
train`` does, cuts out its stage's layers (manual stage construction: ``PipelineStage`` around
the stage's ``nn.Sequential``, input and output shapes given), and runs ``schedule.step``
followed by the optimizer step, ``steps`` times. The last rank writes, per case, the mean time
per step after ``warmup`` steps to ``OUT.json``. Same data stream, same loss, same optimizer as
ours.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleavedZeroBubble,
)

from pipedream.data import MicrobatchStream
from pipedream.host_memory import configure_host_memory
from pipedream.runtime.gc_freeze import frozen_heap
from pipedream.runtime.stage_layout import build_stage_module, layer_names
from pipedream.workload import load_workload

__all__ = ["SCHEDULES", "run_case"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb-h1": ScheduleInterleavedZeroBubble}
"""Ours -> PyTorch's schedule of the same name (the zero-bubble one takes a list of stages)."""


def _stage_shapes(model: nn.Module, example: torch.Tensor) -> list[Any]:
    """Input of each layer and the last output, for one microbatch (meta-free, real run)."""
    shapes = []
    x = example
    with torch.no_grad():
        for name, layer in model.named_children():
            shapes.append((name, torch.empty_like(x)))
            x = layer(x)
    shapes.append(("<out>", torch.empty_like(x)))
    return shapes


class _OwnOutput(nn.Module):
    """The stage, its output a tensor of its own: PyTorch's split backward detaches the
    stage's outputs in place, which a view (the sleep layers' identity) does not allow."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stage(x)
        return out.clone() if out._is_view() else out


def _batch(stream: MicrobatchStream, step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [stream.microbatch(step * m + j) for j in range(m)]
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


def run_case(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any] | None:
    """Run one case on this rank; the last rank returns the measurement."""
    m, b = case["microbatches"], case["microbatch_size"]
    workload = load_workload(case["workload"], case["workload_args"], microbatch_size=b)
    names = layer_names(workload.model)
    first, last = case["stages"][rank]
    layers = names[names.index(first) : names.index(last) + 1]
    shapes = dict(_stage_shapes(workload.model, workload.example_input))
    following = names.index(last) + 1
    out_example = shapes[names[following]] if following < len(names) else shapes["<out>"]
    module = build_stage_module(workload.model, layers)
    several = SCHEDULES[case["schedule"]] is ScheduleInterleavedZeroBubble
    if several:
        module = _OwnOutput(module)
    # the metadata's requires_grad decides whether activations get gradients and are sent back
    in_example = shapes[layers[0]].requires_grad_(rank > 0 and out_example.is_floating_point())
    stage = PipelineStage(
        module,
        rank,
        world_size,
        torch.device("cpu"),
        input_args=(in_example,),
        output_args=(out_example.requires_grad_(out_example.is_floating_point()),),
    )
    kind = SCHEDULES[case["schedule"]]
    schedule = kind([stage] if several else stage, m, loss_fn=workload.loss_fn)
    optimizer = workload.optimizer(module.parameters())
    stream = MicrobatchStream(workload.dataset, b, seed=0)
    ends = []
    losses: list[torch.Tensor] = []
    for step in range(case["steps"]):
        inputs, targets = _batch(stream, step, m)
        if rank == 0:
            schedule.step(inputs)
        elif rank == world_size - 1:
            schedule.step(target=targets, losses=losses, return_outputs=False)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    dist.barrier()
    if rank != world_size - 1:
        return None
    window = ends[case["warmup"] - 1 :]
    period = (window[-1] - window[0]) * 1000 / (len(window) - 1)
    loss = float(torch.stack(losses[-m:]).mean()) if losses else None
    return {"name": case["name"], "period_ms": period, "steps": len(window) - 1, "loss": loss}


def main(argv: list[str]) -> int:
    cases = json.loads(Path(argv[0]).read_text())
    configure_host_memory()  # the allocator settings of ours: compare schedules, not malloc
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    try:
        for case in cases:
            assert len(case["stages"]) == world_size, (case["name"], world_size)
            with frozen_heap():  # as ours: no full garbage collection pauses the loop
                result = run_case(case, rank, world_size)
            if result is not None:
                results.append(result)
                print(f"torch.distributed.pipelining {result}", flush=True)
                Path(argv[1]).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
