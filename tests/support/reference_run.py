"""Run a plan's action tables in one process with the reference executor."""

from __future__ import annotations

import torch

from pipedream.data import MicrobatchStream
from pipedream.formats.plan import Plan, StagePlan
from pipedream.precision import SCALES_LOSS
from pipedream.runtime.loss_scale import LossScaler
from pipedream.runtime.reference_executor import run_reference
from pipedream.runtime.routing import input_needs_grad, sequential_ios
from pipedream.runtime.stage_layout import StageLayout, build_stage_module, stage_layout
from pipedream.runtime.stage_worker import StageWorker, WorkerConfig
from pipedream.schedules import PipelineSpec, build_tables, spec_from_plan
from pipedream.ties import expand_aliases
from pipedream.workload import load_workload

__all__ = ["reference_layout_weights", "reference_weights"]


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


def reference_layout_weights(
    workload: str,
    workload_args: dict[str, str],
    stages: list[list[str]],
    *,
    schedule: str,
    microbatches: int,
    steps: int,
    microbatch_size: int,
    replicas: list[int] | None = None,
    layers: list[str] | None = None,
    recompute: bool = False,
    seed: int = 0,
    placement: list[int] | None = None,
    precision: str = "fp32",
    clip: float | None = None,
) -> dict[str, torch.Tensor]:
    """The model's state dict (every name of a tied tensor included) after the reference
    executor ran ``steps`` minibatches of the plan, its stages cut as ``pipedream train`` cuts
    them (:func:`~pipedream.runtime.stage_layout.stage_layout`: traced models, tied parameters).
    ``placement``: the rank of every stage, where ranks run several stages (one model per rank,
    as one process has); with ``replicas`` (the same for every stage) copy ``j`` of the
    pipeline runs on ranks ``j P .. j P + P - 1``; ``precision`` as ``train --precision`` (fp16
    with its loss scale), ``clip`` as ``train --clip-grad-norm``."""
    replicas = replicas or [1] * len(stages)
    plan_stages, rank = [], 0
    copy_ranks = len(set(placement)) if placement else 0  # a pipeline copy's ranks
    for index, (group, count) in enumerate(zip(stages, replicas)):
        if placement:  # copy j of the pipeline on ranks j P .. j P + P - 1
            ranks = tuple(placement[index] + j * copy_ranks for j in range(count))
        else:
            ranks = tuple(range(rank, rank + count))
        plan_stages.append(StagePlan(group[0], group[-1], count, ranks))
        rank += count
    if placement:
        rank = copy_ranks * replicas[0]
    plan = Plan(
        workload=workload,
        workload_args=dict(workload_args),
        schedule=schedule,
        microbatch_size=microbatch_size,
        microbatches=microbatches,
        world_size=rank,
        stages=tuple(plan_stages),
        layers=None if layers is None else tuple(layers),
    )

    def layout_of() -> StageLayout:
        built = load_workload(workload, workload_args, microbatch_size=microbatch_size)
        return stage_layout(built, plan, source="plan")

    first = layout_of()
    scaler = LossScaler(torch.device("cpu")) if precision in SCALES_LOSS else None
    spec = spec_from_plan(
        plan, 0, steps, first.edges, first.tied_pairs, global_norm=clip is not None or bool(scaler)
    )
    tables = build_tables(spec)
    workers: dict[int, dict[int, StageWorker]] = {}
    layouts: dict[int, StageLayout] = {}
    for stage, entry in enumerate(plan_stages):
        for rank in entry.ranks:  # every rank its own model, as every process has
            layout = layouts[rank] = layouts.get(rank) or layout_of()
            module = layout.build(stage)
            built = load_workload(workload, workload_args, microbatch_size=microbatch_size)
            workers.setdefault(rank, {})[stage] = StageWorker(
                WorkerConfig(
                    stage,
                    len(plan_stages),
                    microbatches,
                    recompute=recompute,
                    precision=precision,
                    replicas=entry.replicas,
                ),
                module,
                tables[rank],
                optimizer_factory=built.optimizer,
                loss_fn=built.loss_fn,
                data=MicrobatchStream(built.dataset, microbatch_size, seed),
                model_io=layout.model_io,
                tied=layout.tied_links(stage, module),
                input_grads=input_needs_grad(layout.ios[stage]),
                lr_schedule=built.lr_schedule,
                loss_scale=scaler.scale if scaler and stage == len(plan_stages) - 1 else None,
            )
    run_reference(tables, workers, first.ios, clip=clip, scaler=scaler)
    merged: dict[str, torch.Tensor] = {}
    for stage, entry in enumerate(plan_stages):
        rank = entry.ranks[0]
        skip = layouts[rank].stored_elsewhere(stage, workers[rank][stage].module)
        state = workers[rank][stage].module.state_dict()
        merged.update({k: v for k, v in state.items() if k not in skip})
    return expand_aliases(merged, [tensor.names for tensor in first.tied])
