"""Readable text for ``pipedream plan``: the per-stage table and the baseline comparison."""

from __future__ import annotations

from dataclasses import replace

from pipedream.errors import PlanningError
from pipedream.formats.plan import Plan
from pipedream.formats.profile import Profile
from pipedream.formats.topology import Level, Topology
from pipedream.formats.units import format_bytes
from pipedream.optimizer.cost_model import CostModel, LayerCosts
from pipedream.optimizer.partition import StageSpan
from pipedream.optimizer.planner import PlanOptions, build_plan, evaluate, make_plan

__all__ = ["format_comparison", "format_summary", "plan_spans"]


def plan_spans(plan: Plan, *, profile: Profile) -> tuple[StageSpan, ...]:
    """The plan's stages as layer-index spans of ``profile``."""
    return tuple(
        StageSpan(profile.index_of(s.first_layer), profile.index_of(s.last_layer), s.replicas)
        for s in plan.stages
    )


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(rank) for rank in ranks)


def _table(header: list[str], rows: list[list[str]], *, left: int = 1) -> list[str]:
    """Columns padded to width; the first ``left`` columns left-aligned, the others right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        parts = [
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    return [line(header), *(line(row) for row in rows)]


def format_summary(plan: Plan, *, profile: Profile, level: Level) -> str:
    """The plan as a table: per stage its layers, replicas, ranks, predicted ms and memory."""
    assert plan.prediction is not None
    prediction = plan.prediction
    model = CostModel(level.bandwidth, microbatches=plan.microbatches)
    spans = plan_spans(plan, profile=profile)
    evaluation = evaluate(
        LayerCosts.from_profile(profile), stages=spans, model=model, schedule=plan.schedule
    )
    rows = []
    for index, (stage, span, cost) in enumerate(zip(plan.stages, spans, evaluation.stage_costs)):
        rows.append(
            [
                str(index),
                f"{stage.first_layer} .. {stage.last_layer} ({span.last - span.first + 1})",
                str(stage.replicas),
                _ranks(stage.ranks),
                f"{cost.compute_ms:.3f}",
                f"{cost.allreduce_ms:.3f}",
                f"{cost.transfer_ms:.3f}",
                f"{cost.total_ms:.3f}" + (" *" if index == prediction.bottleneck else "  "),
                format_bytes(prediction.memory_bytes[index]),
            ]
        )
    header = [
        "stage",
        "layers (count)",
        "replicas",
        "ranks",
        "compute ms",
        "of which allreduce",
        "transfer ms",
        "stage ms",
        "memory/worker",
    ]
    per = "microbatch" if plan.microbatches > 1 else "minibatch"
    speedup = prediction.data_parallel_time_per_minibatch_ms / prediction.time_per_minibatch_ms
    lines = [
        f"{profile.workload}: {len(profile.layers)} layers on {plan.world_size} workers "
        f"@ {level.bandwidth / 1e9:g} GB/s, schedule {plan.schedule}, "
        f"{plan.microbatches} x {plan.microbatch_size} samples per minibatch",
        "",
        *_table(header, rows, left=2),
        f"(times per {per}; compute includes the allreduce and overlaps the transfers, so a "
        "stage takes the larger; * = bottleneck)",
        "",
        f"predicted time per minibatch: {prediction.time_per_minibatch_ms:.3f} ms "
        f"-> {prediction.throughput_samples_per_s:.1f} samples/s "
        f"(bottleneck: stage {prediction.bottleneck})",
        f"data parallel on {plan.world_size} workers: "
        f"{prediction.data_parallel_time_per_minibatch_ms:.3f} ms per minibatch "
        f"(this plan is {speedup:.2f}x as fast)",
    ]
    return "\n".join(lines)


def format_comparison(plan: Plan, profile: Profile, *, level: Level, options: PlanOptions) -> str:
    """The plan next to baselines: straight pipeline, data parallelism, one worker."""
    model = CostModel(level.bandwidth, microbatches=plan.microbatches)
    num_layers = len(profile.layers)
    last = num_layers - 1
    candidates: list[tuple[str, Plan | str]] = [(f"this plan ({plan.schedule})", plan)]
    if not plan.is_straight:
        straight_options = replace(
            options,
            straight=True,
            microbatches=plan.microbatches,
            use_fewer_workers=True,
            memory=None,
        )
        topology = Topology.single_level(level.workers, level.bandwidth)
        try:
            straight: Plan | str = make_plan(profile, topology=topology, options=straight_options)
        except PlanningError as exc:
            straight = f"n/a: {exc}"
        candidates.append(("straight pipeline", straight))
    candidates.append(
        (
            "data parallel",
            build_plan(
                profile,
                stages=(StageSpan(0, last, level.workers),),
                model=model,
                schedule=plan.schedule,
            ),
        ),
    )
    single = build_plan(
        profile, stages=(StageSpan(0, last, 1),), model=model, schedule=plan.schedule
    )
    candidates.append(("one worker", single))
    assert single.prediction is not None
    base = single.prediction.time_per_minibatch_ms
    rows = []
    for name, candidate in candidates:
        if isinstance(candidate, str):
            rows.append([name, "-", candidate, "-", "-", "-"])
            continue
        assert candidate.prediction is not None
        pred = candidate.prediction
        shape = "-".join(str(stage.replicas) for stage in candidate.stages)
        rows.append(
            [
                name,
                str(candidate.world_size),
                f"{candidate.num_stages} ({shape})",
                f"{pred.time_per_minibatch_ms:.3f}",
                f"{pred.throughput_samples_per_s:.1f}",
                f"{base / pred.time_per_minibatch_ms:.2f}x",
            ]
        )
    header = [
        "configuration",
        "workers",
        "stages (replicas)",
        "ms/minibatch",
        "samples/s",
        "vs one worker",
    ]
    return "\n".join(
        ["comparison (same cost model, no memory limit for baselines):", *_table(header, rows)]
    )
