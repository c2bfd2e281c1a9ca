"""``pipedream plan``: profile + cluster -> plan YAML and a readable summary.

::

    pipedream plan PROFILE (--workers N [--bandwidth B] | --topology TOPO)
                   [--schedule NAME|auto] [--microbatches M] [--straight] [--memory X]
                   [--cost-model symmetric|pipedream] [--fewer-workers] [--no-search] [--compare]
                   -o PLAN

``--workers N --bandwidth B`` is a one-level cluster (PipeDream's default bandwidth, 1e9
bytes/s, when ``--bandwidth`` is left out); ``--topology`` gives several levels, innermost
first. ``--memory`` (or the topology's ``memory``) limits each worker's estimated memory (see
:mod:`pipedream.optimizer.memory`). The plan records the profile's path (relative to the plan
file) and the cluster, so that ``pipedream simulate PLAN`` needs nothing else. Every user
mistake raises :class:`~pipedream.errors.PlanningError` (or ``FormatError`` for a bad file),
which the CLI prints as one line with exit status 2.

Nothing here imports torch: planning is pure arithmetic over the profile.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from pipedream.errors import PlanningError
from pipedream.formats.plan import Plan, save_plan
from pipedream.formats.profile import Profile, load_profile
from pipedream.formats.topology import (
    DEFAULT_BANDWIDTH,
    MAX_LEVEL_WORKERS,
    Topology,
    load_topology,
)
from pipedream.formats.units import MIN_BANDWIDTH, parse_bandwidth, parse_bytes
from pipedream.optimizer.baselines import baselines, simulated_baselines
from pipedream.optimizer.cost_model import LayerCosts
from pipedream.optimizer.planner import (
    AUTO,
    DEFAULT_SCHEDULE,
    PlanOptions,
    PlanResult,
    plan_profile,
)
from pipedream.optimizer.report import format_candidates, format_comparison, format_summary
from pipedream.optimizer.search import Request
from pipedream.optimizer.verify import simulated_ms
from pipedream.schedules import lookup

__all__ = ["bandwidth_option", "options_from_args", "run", "topology_from_args"]


def topology_from_args(args: argparse.Namespace) -> Topology:
    """The cluster from ``--workers``/``--bandwidth`` or ``--topology`` (exactly one of them)."""
    workers, bandwidth, path = args.workers, args.bandwidth, args.topology
    if workers is not None and path is not None:
        raise PlanningError(
            f"both --workers {workers} and --topology {path} given; use --workers N "
            "[--bandwidth B] for one level, or --topology FILE, not both"
        )
    if path is not None:
        if bandwidth is not None:
            raise PlanningError(
                f"--bandwidth {bandwidth} does not apply to --topology {path}; set the "
                "bandwidth of each level in the topology file"
            )
        return load_topology(path)
    if workers is None:
        raise PlanningError(
            "no cluster given; use --workers N [--bandwidth B] (one level) or --topology FILE"
        )
    if workers < 1:
        raise PlanningError(f"--workers {workers}: must be at least 1")
    if workers > MAX_LEVEL_WORKERS:
        raise PlanningError(
            f"--workers {workers}: one level holds at most {MAX_LEVEL_WORKERS} workers (the "
            "dynamic program grows with the square of a level's workers); describe a larger "
            "cluster in levels with --topology, e.g. GPUs per server, then servers"
        )
    value = DEFAULT_BANDWIDTH
    if bandwidth is not None:
        value = bandwidth_option("--bandwidth", bandwidth, "1e9 or '10 GB/s'")
    return Topology.single_level(workers, value)


def bandwidth_option(option: str, text: str, example: str) -> float:
    """``text`` as bytes/s (units allowed), at least :data:`MIN_BANDWIDTH`; one clear error
    naming ``option`` otherwise."""
    try:
        value = parse_bandwidth(text)
    except ValueError as exc:
        raise PlanningError(f"{option}: {exc}") from None
    if value < MIN_BANDWIDTH:
        raise PlanningError(
            f"{option} {text!r}: must be at least {MIN_BANDWIDTH:g} byte/s, e.g. {example}"
        )
    return value


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    """The planner options of the parsed command line."""
    memory = None
    if args.memory is not None:
        try:
            memory = parse_bytes(args.memory)
        except ValueError as exc:
            raise PlanningError(f"--memory: {exc}") from None
        if memory <= 0:
            raise PlanningError(f"--memory {args.memory!r}: must be positive, e.g. '16 GiB'")
    return PlanOptions(
        schedule=args.schedule or DEFAULT_SCHEDULE,
        microbatches=args.microbatches,
        straight=bool(args.straight),
        memory=memory,
        cost_model=args.cost_model,
        use_fewer_workers=bool(getattr(args, "fewer_workers", False)),
        virtual_stages=getattr(args, "virtual_stages", None),
        search=not getattr(args, "no_search", False),
        recompute=bool(getattr(args, "recompute", False)),
    )


def _relative(path: str, plan_file: str) -> str:
    """``path`` as seen from the plan file's folder (absolute if that is impossible)."""
    try:
        return os.path.relpath(Path(path).resolve(), Path(plan_file).resolve().parent)
    except ValueError:  # another drive on Windows
        return str(Path(path).resolve())


def run(args: argparse.Namespace) -> int:
    """Run ``pipedream plan``; returns the exit status."""
    options = options_from_args(args)
    topology = topology_from_args(args)
    profile = load_profile(args.profile)
    limit = options.memory if options.memory is not None else topology.memory
    from_profile = limit is None and profile.device_memory is not None
    if limit is None and profile.device_memory is not None:  # the GPU it was measured on
        limit = float(profile.device_memory)
        options = replace(options, memory=limit)
    try:
        result = plan_profile(profile, topology=topology, options=options)
    except PlanningError as exc:
        if from_profile and "--memory" in str(exc):  # a limit the user did not give
            raise PlanningError(
                f"{exc} (the limit per worker is the memory of {profile.device}, where the "
                "profile was measured)"
            ) from None
        raise
    plan = replace(result.plan, profile=_relative(args.profile, args.output), topology=topology)
    save_plan(plan, args.output)
    print(
        format_summary(
            result,
            profile=profile,
            topology=topology,
            memory_limit=limit,
            limit_from_profile=from_profile,
        )
    )
    if result.candidates:
        print()
        print(format_candidates(result, microbatch_size=profile.microbatch_size))
    _note_fewer(result, profile, topology, options)
    default_bandwidth = args.topology is None and args.bandwidth is None
    if default_bandwidth and profile.device.startswith("cuda") and topology.num_workers > 1:
        assumed = f"{DEFAULT_BANDWIDTH / 1e9:g} GB/s"
        print(
            f"note: no --bandwidth given, so the plan assumes {assumed} between workers, while "
            f"the profile was measured on {profile.device}: GPUs of one node exchange at tens to "
            "hundreds of GB/s (NVLink, PCIe); give --bandwidth, or --topology for several nodes"
        )
    if args.compare:
        costs = LayerCosts.from_profile(profile, recompute=options.recompute)
        request = Request(costs, topology, options.cost_model)
        # the baselines give every stage its own workers: a placed schedule's are 1f1b's
        placed = lookup(plan.schedule).several_stages_per_rank
        under = "1f1b" if placed else plan.schedule
        found = baselines(request, cluster=result.cluster, schedule=under)
        simulated = None
        if plan.prediction is not None and _exact(plan):
            # like with like: the baselines' tables simulated as the plan's were (or as exact
            # as a single stage's formula, verify.one_stage_ms)
            simulated = simulated_baselines(
                found,
                profile,
                topology,
                cluster=result.cluster,
                schedule=under,
                recompute=options.recompute,
            )
        print()
        print(
            format_comparison(
                result,
                simulated or found,
                microbatch_size=profile.microbatch_size,
                memory_limit=limit,
                baseline_schedule=under if placed else None,
                baselines_simulated=simulated is not None,
            )
        )
    print(f"wrote {args.output}")
    return 0


def _note_fewer(
    result: PlanResult, profile: Profile, topology: Topology, options: PlanOptions
) -> None:
    """Say so when fewer workers are predicted to be as fast (a second, cheap DP run).

    Only on one level, and not for the flush schedules and ``auto``: there a second search
    costs as much as the first.
    """
    plan = result.plan
    if (
        options.use_fewer_workers
        or plan.world_size <= 1
        or result.cluster.num_levels > 1
        or lookup(plan.schedule).flushes
        or options.schedule == AUTO
    ):
        return
    # without the local search: the note compares the dynamic program's plans, at half the cost
    fewer_options = replace(
        options, use_fewer_workers=True, microbatches=plan.microbatches, search=False
    )
    fewer = plan_profile(profile, topology=topology, options=fewer_options).plan
    if fewer.world_size >= plan.world_size:
        return
    times = _alike_ms(plan, fewer, profile=profile, topology=topology)
    if times is not None and times[1] <= times[0] * (1 + 1e-9):
        print(
            f"note: {fewer.world_size} workers are predicted to be as fast; the other "
            f"{plan.world_size - fewer.world_size} add nothing under this cost model "
            "(--fewer-workers plans for fewer)"
        )


def _alike_ms(*plans: Plan, profile: Profile, topology: Topology) -> list[float] | None:
    """The predicted times of ``plans``, all by a pipeline's formula or all as simulated (None
    where one of them is too big to simulate)."""
    predictions = [plan.prediction for plan in plans if plan.prediction is not None]
    if len(predictions) == len(plans) and len({_exact(plan) for plan in plans}) == 1:
        return [p.time_per_minibatch_ms for p in predictions]
    times = [simulated_ms(plan, profile, topology) for plan in plans]
    known = [t for t in times if t is not None]
    return known if len(known) == len(plans) else None


def _exact(plan: Plan) -> bool:
    """Whether the plan's prediction is what its simulation gives: simulated, or of a single
    stage (:func:`~pipedream.optimizer.verify.one_stage_ms`); else the formula of a
    pipeline, which leaves out the updates and the runtime's cost per action."""
    assert plan.prediction is not None
    return plan.prediction.method == "simulated" or plan.num_stages == 1
