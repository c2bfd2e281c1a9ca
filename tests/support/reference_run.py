"""Run a plan's action tables in one process with the reference executor."""

from __future__ import annotations

import torch

from pipedream.data import MicrobatchStream
from pipedream.runtime.reference import run_reference
from pipedream.runtime.routing import sequential_ios
from pipedream.runtime.schedule import PipelineSpec, build_tables
from pipedream.runtime.stage import build_stage_module
from pipedream.runtime.worker import StageWorker, WorkerConfig
from pipedream.workload import load_workload

__all__ = ["reference_weights"]


def reference_weights(
    stages: list[list[str]],
    replicas: list[int],
    *,
    schedule: str,
    microbatches: int,
    steps: int,
    workload_args: dict[str, str],
    microbatch_size: int = 8,
    seed: int = 0,
    recompute: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[int, StageWorker]]:
    """Final merged weights (and the workers) of the reference executor on the same tables."""
    ranks, first = [], 0
    for count in replicas:
        ranks.append(tuple(range(first, first + count)))
        first += count
    spec = PipelineSpec(schedule, tuple(ranks), microbatches, steps)
    tables = build_tables(spec)
    workers = {}
    for stage, stage_ranks in enumerate(ranks):
        for rank in stage_ranks:
            workload = load_workload("mlp", workload_args, microbatch_size=microbatch_size)
            workers[rank] = StageWorker(
                WorkerConfig(stage, len(ranks), microbatches, recompute=recompute),
                build_stage_module(workload.model, stages[stage]),
                tables[rank],
                optimizer_factory=workload.optimizer,
                loss_fn=workload.loss_fn,
                data=MicrobatchStream(workload.dataset, microbatch_size, seed),
            )
    run_reference(tables, workers, sequential_ios(len(ranks)))
    merged: dict[str, torch.Tensor] = {}
    for stage_ranks in ranks:
        merged.update(workers[stage_ranks[0]].module.state_dict())
    return merged, workers
