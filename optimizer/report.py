"""Readable text for ``pipedream plan``: the per-stage table, the auto search, the comparison."""

from __future__ import annotations

from pipedream.formats.plan import Plan
from pipedream.formats.profile import Profile
from pipedream.formats.topology import Topology
from pipedream.formats.units import format_bytes
from pipedream.optimizer.baselines import Baseline
from pipedream.optimizer.planner import PlanResult
from pipedream.optimizer.refine import Refined
from pipedream.optimizer.verify import needs_simulation
from pipedream.precision import DEFAULT_PRECISION
from pipedream.schedules import lookup
from pipedream.wording import count

__all__ = ["format_candidates", "format_comparison", "format_summary", "table"]


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 8:
        return ",".join(str(rank) for rank in ranks[:6]) + f",... ({len(ranks)})"
    return ",".join(str(rank) for rank in ranks)


def table(header: list[str], rows: list[list[str]], *, left: int = 1) -> list[str]:
    """Columns padded to width; the first ``left`` columns left-aligned, the others right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        parts = [
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    return [line(header), *(line(row) for row in rows)]


def format_summary(
    result: PlanResult,
    *,
    profile: Profile,
    topology: Topology,
    memory_limit: float | None,
    limit_from_profile: bool = False,
) -> str:
    """The plan as a table: per stage its layers, replicas, ranks, predicted ms and memory.
    ``limit_from_profile``: the memory limit is that of the device the profile was measured
    on (no ``--memory`` or topology ``memory`` was given), which the last line says."""
    plan, prediction = result.plan, result.plan.prediction
    assert prediction is not None
    names = profile.layer_names
    rows = []
    for index, (stage, leaf) in enumerate(zip(plan.stages, result.evaluation.leaves)):
        memory = format_bytes(leaf.memory_bytes)
        if memory_limit is not None and leaf.memory_bytes > memory_limit:
            memory += " !"
        rows.append(
            [
                str(index),
                f"{names[leaf.first]} .. {names[leaf.last]} ({leaf.last - leaf.first + 1})",
                str(stage.replicas),
                _ranks(stage.ranks),
                f"{leaf.cost.compute_ms:.3f}",
                f"{leaf.cost.allreduce_ms:.3f}",
                f"{leaf.cost.transfer_ms:.3f}",
                f"{leaf.time_ms:.3f}" + (" *" if index == prediction.bottleneck else "  "),
                memory,
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
    levels = result.cluster.num_levels
    outer = " plus the outer levels' allreduce and transfers" if levels > 1 else ""
    speedup = prediction.data_parallel_time_per_minibatch_ms / prediction.time_per_minibatch_ms
    lines = [
        f"{profile.workload}: {len(profile.layers)} layers on {topology.describe()}",
        f"schedule {plan.schedule}, {plan.microbatches} x {plan.microbatch_size} samples per "
        f"minibatch, "
        + (
            f"{profile.precision} (autocast, as profiled), "
            if profile.precision != DEFAULT_PRECISION
            else ""
        )
        + f"cost model {prediction.cost_model}",
        "",
        *table(header, rows, left=2),
        f"(times per {per}; compute includes the allreduce and overlaps the transfers, so a "
        f"stage takes the larger{outer}; * = bottleneck)",
        "",
        f"predicted time per minibatch: {prediction.time_per_minibatch_ms:.3f} ms "
        f"-> {prediction.throughput_samples_per_s:.1f} samples/s "
        f"(bottleneck: stage {prediction.bottleneck}" + _how_predicted(plan),
        f"data parallel on {result.cluster.num_workers} workers: "
        f"{prediction.data_parallel_time_per_minibatch_ms:.3f} ms per minibatch "
        f"(this plan is {speedup:.2f}x as fast)",
    ]
    lines += _search_lines(result.refined)
    lines += _tied_lines(result, profile)
    if plan.steps_multiple > 1:
        counts = ", ".join(str(c) for c in sorted({s.replicas for s in plan.stages} - {1}))
        lines.append(
            f"runs of this plan: --steps and --checkpoint-every multiples of "
            f"{plan.steps_multiple} (the replica counts {counts}: each replica updates in turn)"
        )
    if memory_limit is not None:
        lines.append(
            f"memory limit per worker: {format_bytes(memory_limit)} "
            + (
                f"(the memory of {profile.device}, where the profile was measured; --memory "
                "sets another), "
                if limit_from_profile
                else "("
            )
            + "checked against the estimate weights x versions + gradients + optimizer state "
            "+ activations x in flight" + ("" if limit_from_profile else ")")
        )
    return "\n".join(lines)


def _how_predicted(plan: Plan) -> str:
    """The end of the prediction's line: why its time is simulated, or that it could not be."""
    assert plan.prediction is not None
    if plan.prediction.method != "simulated":
        if plan.num_stages == 1:  # verify.one_stage_ms: the simulation's time, not simulated
            return "; one stage: exact, with its updates and the runtime's cost per action)"
        if needs_simulation(plan):  # the formula stands: too big to simulate
            return "; by the formula: too big to simulate, which may give more)"
        return ")"
    record = lookup(plan.schedule)
    if record.several_stages_per_rank:
        why = "each worker runs several stages, in the order the schedule interleaves them"
    elif record.splits_backward:
        why = "the formula does not know how the backward splits"
    elif plan.num_stages == 1:
        why = "chosen over the pipelines by simulating each"
    else:
        why = "the formula idealizes a pipeline's round trips and uneven stages"
    return f"; simulated: {why})"


def _search_lines(refined: Refined | None) -> list[str]:
    """What the local search by simulation tried, and what it gained."""
    if refined is None or refined.tried == 0:
        return []
    head = (
        f"local search by simulation: {refined.tried} plan{'s' if refined.tried > 1 else ''} tried"
    )
    if refined.simulated < refined.tried:
        head += f" ({refined.simulated} simulated, {refined.ruled_out} ruled out by a lower bound)"
    if refined.time_ms < refined.start_ms:
        gained = (
            f", from {refined.start_ms:.3f} ms (the fastest of the candidates simulated "
            f"before it) to this plan's {refined.time_ms:.3f} ms"
        )
    else:
        gained = ", none faster"
    stopped = "; it stopped at its budget" if refined.budget_spent else ""
    return [f"{head}{gained}{stopped}"]


def _tied_lines(result: PlanResult, profile: Profile) -> list[str]:
    """Where the plan puts each tied parameter, and what trading it costs."""
    leaves = result.evaluation.leaves
    index = {name: i for i, name in enumerate(profile.layer_names)}
    lines = []
    for tied in profile.tied:
        stages = sorted(
            {
                number
                for layer in tied.layers
                for number, leaf in enumerate(leaves)
                if leaf.first <= index[layer] <= leaf.last
            }
        )
        head = f"tied {tied.name} ({format_bytes(tied.bytes)}, layers {', '.join(tied.layers)})"
        if len(stages) == 1:
            lines.append(f"{head}: all in stage {stages[0]}, nothing to trade")
            continue
        owner, copies = stages[0], stages[1:]
        # a copy on its owner's workers (the V's last stage) hands over in memory
        beside = [
            s for s in copies if result.plan.stages[s].ranks == result.plan.stages[owner].ranks
        ]
        away = [s for s in copies if s not in beside]
        line = f"{head}: owned by stage {owner}, copied on {_stages(copies)}"
        if away:
            costs = ", ".join(f"stage {s} {leaves[s].cost.tied_ms:.3f} ms" for s in [owner, *away])
            per = "microbatch" if result.plan.microbatches > 1 else "minibatch"
            line += (
                f"; each update trades the copies' gradient and the new version ({costs} per "
                f"{per}, in stage ms)"
            )
        if beside:
            line += f"; {_stages(beside)} on the owner's workers: handed over in memory"
        lines.append(line)
    return lines


def _stages(numbers: list[int]) -> str:
    return f"stage{'s' if len(numbers) > 1 else ''} {', '.join(str(s) for s in numbers)}"


def format_candidates(result: PlanResult, *, microbatch_size: int) -> str:
    """The schedules and microbatch counts ``--schedule auto`` tried, best first."""
    rows, reasons = [], []
    for outcome in result.candidates:
        if outcome.tree is None:  # why, in full below the table (a cut sentence said too little)
            rows.append([outcome.schedule, str(outcome.microbatches), "-", "-", "not planned"])
            reasons.append(f"{outcome.schedule} x {outcome.microbatches}: {outcome.problem}")
            continue
        speed = outcome.microbatches_per_ms * microbatch_size * 1e3
        rows.append(
            [
                outcome.schedule,
                str(outcome.microbatches),
                f"{outcome.time_per_minibatch_ms:.3f}",
                f"{speed:.1f}",
                "chosen" if outcome is result.candidates[0] else "",
            ]
        )
    header = ["schedule", "microbatches", "ms/minibatch", "samples/s", ""]
    lines = ["--schedule auto tried:", *table(header, rows), *reasons]
    if result.not_compared:
        lines.append(f"not compared: {result.not_compared}")
    if result.refined is not None and result.refined.tried:
        lines.append(
            "(only the chosen row was searched beside by simulation; the others are the plans "
            "proposed for them, simulated)"
        )
    return "\n".join(lines)


def format_comparison(
    result: PlanResult,
    found: list[Baseline],
    *,
    microbatch_size: int,
    memory_limit: float | None,
    baseline_schedule: str | None = None,
    baselines_simulated: bool = False,
) -> str:
    """The plan next to the baselines (same microbatches and cost model; same schedule unless
    ``baseline_schedule`` names the one the baselines ran under). ``baselines_simulated``: the
    baselines' times are simulated, as the plan's; a simulated plan next to baselines that
    are not says so."""
    plan = result.plan
    assert plan.prediction is not None
    mine = plan.prediction.time_per_minibatch_ms
    samples = microbatch_size * plan.microbatches
    own = Baseline(f"optimizer ({plan.schedule})", result.evaluation, mine)
    rows = []
    for entry in [*found, own]:
        if entry.evaluation is None:
            rows.append([entry.name, "-", "-", "-", "-", "-", f"n/a: {entry.note[:50]}"])
            continue
        leaves = entry.evaluation.leaves
        workers = plan.world_size if entry is own else sum(leaf.replicas for leaf in leaves)
        shape = "-".join(str(leaf.replicas) for leaf in leaves)
        if len(shape) > 24:
            shape = shape[:21] + "..."
        peak = max(leaf.memory_bytes for leaf in leaves)
        fits = "" if memory_limit is None else (" ok" if peak <= memory_limit else " over")
        rows.append(
            [
                entry.name,
                str(workers),
                f"{len(leaves)} ({shape})",
                f"{entry.time_per_minibatch_ms:.3f}",
                f"{samples * 1e3 / entry.time_per_minibatch_ms:.1f}",
                format_bytes(peak) + fits,
                f"{entry.time_per_minibatch_ms / mine:.2f}x",
            ]
        )
    header = [
        "configuration",
        "workers",
        "stages (replicas)",
        "ms/minibatch",
        "samples/s",
        "max memory/worker",
        "time vs optimizer",
    ]
    under = (
        f"baselines under {baseline_schedule}, the same update rule with one stage per worker"
        if baseline_schedule
        else f"schedule {plan.schedule}"
    )
    simulated = plan.prediction.method == "simulated"
    if baselines_simulated:
        how = "; every time simulated" if simulated else "; the baselines' times simulated"
    elif simulated or plan.num_stages == 1:
        own = "simulated" if simulated else "exact (one stage)"
        how = f"; the optimizer's time {own}, the baselines' by formula (too big to simulate)"
    else:
        how = ""
    title = (
        f"comparison ({under}, {count(plan.microbatches, 'microbatch')}, cost model "
        f"{plan.prediction.cost_model}{how}; baselines ignore the memory limit):"
    )
    return "\n".join([title, *table(header, rows)])
