"""The same workloads under ``torch.distributed.pipelining``: ScheduleGPipe, Schedule1F1B,
ScheduleInterleavedZeroBubble with one stage per rank (its ZB1P schedule) for ``zb-h1``,
ScheduleInterleaved1F1B and ScheduleZBVZeroBubble for ``interleaved-1f1b`` and ``zbv``.

A driver launched with torchrun, one process per rank, gloo on 127.0.0.1::

    python -m torch.distributed.run --standalone --nproc-per-node RANKS \\
        benchmarks/torch_pipelining.py CASES.json OUT.json

``CASES.json`` is a list of cases, each ``{name, workload, workload_args, stages: [[first,
last], ...], placement (the rank of every stage, or null: one stage per rank), schedule,
microbatches, microbatch_size, steps, warmup}``; all cases of a file run on the same number of
ranks. Each rank builds the workload exactly as ``pipedream train`` does, cuts out its stages'
layers (manual stage construction: a ``PipelineStage`` around each stage's ``nn.Sequential``,
input and output shapes given), and runs ``schedule.step`` followed by the optimizer step,
``steps`` times. The rank of the last stage measures, per case, the mean time per step after
``warmup`` steps, and rank 0 writes it to ``OUT.json``. Same data stream, same loss, same
optimizer as ours.
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
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from pipedream.data import MicrobatchStream
from pipedream.host_memory import configure_host_memory
from pipedream.runtime.gc_freeze import frozen_heap
from pipedream.runtime.stage_layout import build_stage_module, layer_names
from pipedream.workload import load_workload

__all__ = ["SCHEDULES", "run_case"]

SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}
"""Ours -> PyTorch's schedule of the same name."""
MULTI = (ScheduleInterleavedZeroBubble, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
"""The ones that take a list of the rank's stages."""
SPLIT = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
"""The ones that split backwards (their stage outputs must not be views)."""


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


def _stage(
    case: dict[str, Any], workload: Any, index: int, own_output: bool
) -> tuple[PipelineStage, nn.Module]:
    """Stage ``index`` of the case's split, as a PipelineStage around its layers."""
    names = layer_names(workload.model)
    first, last = case["stages"][index]
    layers = names[names.index(first) : names.index(last) + 1]
    shapes = dict(_stage_shapes(workload.model, workload.example_input))
    following = names.index(last) + 1
    out_example = shapes[names[following]] if following < len(names) else shapes["<out>"]
    module = build_stage_module(workload.model, layers)
    if own_output:
        module = _OwnOutput(module)
    # the metadata's requires_grad decides whether activations get gradients and are sent back
    in_example = shapes[layers[0]].requires_grad_(index > 0 and out_example.is_floating_point())
    stage = PipelineStage(
        module,
        index,
        len(case["stages"]),
        torch.device("cpu"),
        input_args=(in_example,),
        output_args=(out_example.requires_grad_(out_example.is_floating_point()),),
    )
    return stage, module


def run_case(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any] | None:
    """Run one case on this rank; the rank of the last stage returns the measurement."""
    m, b = case["microbatches"], case["microbatch_size"]
    workload = load_workload(case["workload"], case["workload_args"], microbatch_size=b)
    placement = case.get("placement") or list(range(len(case["stages"])))
    mine = [index for index, owner in enumerate(placement) if owner == rank]
    kind = SCHEDULES[case["schedule"]]
    several = kind in MULTI
    built = [_stage(case, workload, index, own_output=kind in SPLIT) for index in mine]
    stages = [stage for stage, _ in built]
    schedule = kind(stages if several else stages[0], m, loss_fn=workload.loss_fn)
    params = [p for _, module in built for p in module.parameters()]
    optimizer = workload.optimizer(params)
    stream = MicrobatchStream(workload.dataset, b, seed=0)
    first, last = 0 in mine, len(placement) - 1 in mine
    ends = []
    losses: list[torch.Tensor] = []
    for step in range(case["steps"]):
        inputs, targets = _batch(stream, step, m)
        args = (inputs,) if first else ()
        if last:
            schedule.step(*args, target=targets, losses=losses, return_outputs=False)
        else:
            schedule.step(*args)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    dist.barrier()
    if not last:
        return None
    window = ends[case["warmup"] - 1 :]
    period = (window[-1] - window[0]) * 1000 / (len(window) - 1)
    loss = float(torch.stack(losses[-m:]).detach().mean()) if losses else None
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
            ranks = set(case.get("placement") or range(len(case["stages"])))
            assert len(ranks) == world_size, (case["name"], world_size)
            with frozen_heap():  # as ours: no full garbage collection pauses the loop
                result = run_case(case, rank, world_size)
            gathered: list[Any] = [None] * world_size  # from the rank of the last stage
            dist.all_gather_object(gathered, result)
            if rank == 0:
                (measured,) = [r for r in gathered if r is not None]
                results.append(measured)
                print(f"torch.distributed.pipelining {measured}", flush=True)
                Path(argv[1]).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
