"""``pipedream plan``: profile + cluster -> plan YAML and a readable summary.

::

    pipedream plan PROFILE (--workers N [--bandwidth B] | --topology TOPO) [--schedule NAME]
                   [--microbatches M] [--straight] [--memory X] [--cost-model pipedream]
                   [--compare] -o PLAN

``--workers N --bandwidth B`` is a one-level cluster (PipeDream's default bandwidth, 1e9
bytes/s, when ``--bandwidth`` is left out). ``--memory`` (or the topology's ``memory``) limits
each worker's estimated memory (see :mod:`pipedream.optimizer.memory`). Every user mistake
raises :class:`~pipedream.errors.PlanningError` (or ``FormatError`` for a bad file), which the
CLI prints as one line with exit status 2.

Nothing here imports torch: planning is pure arithmetic over the profile.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from pipedream.errors import PlanningError
from pipedream.formats.plan import save_plan
from pipedream.formats.profile import load_profile
from pipedream.formats.topology import DEFAULT_BANDWIDTH, Topology, load_topology
from pipedream.formats.units import format_bytes, parse_bandwidth, parse_bytes
from pipedream.optimizer.planner import FLUSH_SCHEDULES, PlanOptions, make_plan, network_level
from pipedream.optimizer.report import format_comparison, format_summary

__all__ = ["options_from_args", "run", "topology_from_args"]


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
    value = DEFAULT_BANDWIDTH
    if bandwidth is not None:
        try:
            value = parse_bandwidth(bandwidth)
        except ValueError as exc:
            raise PlanningError(f"--bandwidth: {exc}") from None
        if value <= 0:
            raise PlanningError(
                f"--bandwidth {bandwidth!r}: must be positive, e.g. 1e9 or '10 GB/s'"
            )
    return Topology.single_level(workers, value)


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
        schedule=args.schedule,
        microbatches=args.microbatches,
        straight=bool(args.straight),
        memory=memory,
        cost_model=args.cost_model,
        # not a CLI flag (yet); honoured if the parser grows one
        use_fewer_workers=bool(getattr(args, "fewer_workers", False)),
    )


def run(args: argparse.Namespace) -> int:
    """Run ``pipedream plan``; returns the exit status."""
    options = options_from_args(args)
    topology = topology_from_args(args)
    level = network_level(topology)
    profile = load_profile(args.profile)
    plan = make_plan(profile, topology=topology, options=options)
    save_plan(plan, args.output)
    print(format_summary(plan, profile=profile, level=level))
    if _worth_checking_fewer(options, plan.world_size):
        fewer_options = replace(options, use_fewer_workers=True, microbatches=plan.microbatches)
        fewer = make_plan(profile, topology=topology, options=fewer_options)
        assert plan.prediction is not None and fewer.prediction is not None
        if fewer.world_size < plan.world_size and (
            fewer.prediction.time_per_minibatch_ms
            >= plan.prediction.time_per_minibatch_ms * (1 - 1e-9)
        ):
            print(
                f"note: {fewer.world_size} workers are predicted to be as fast; the other "
                f"{plan.world_size - fewer.world_size} add nothing under this cost model"
            )
    if options.memory is not None or topology.memory is not None:
        limit = options.memory if options.memory is not None else topology.memory
        assert limit is not None
        print(
            f"memory limit per worker: {format_bytes(limit)} (checked against the estimate "
            "weights x versions + gradients + optimizer state + activations x in flight)"
        )
    if args.compare:
        print()
        print(format_comparison(plan, profile=profile, level=level, options=options))
    print(f"wrote {args.output}")
    return 0


def _worth_checking_fewer(options: PlanOptions, world_size: int) -> bool:
    """Whether to look for a plan as fast on fewer workers (a second, cheap DP run).

    Skipped for the flush schedules, whose search over stage counts costs ``S`` times more.
    """
    return (
        not options.use_fewer_workers and world_size > 1 and options.schedule not in FLUSH_SCHEDULES
    )
