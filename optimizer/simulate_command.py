"""``pipedream simulate``: a plan's predicted timeline, as a text grid and optionally a PNG.

::

    pipedream simulate PLAN [--profile PROFILE] [--topology TOPO | --bandwidth B]
                            [--latency MS] [--host-bandwidth B] [--duplex F] [--per-rank F]
                            [--[no-]interface] [--send-overhead MS] [--send-overhead-per-mib MS]
                            [--recv-overhead MS] [--spread] [--message-spread R,R,...]
                            [--steps K]
                            [--width SLOTS] [--png FILE] [--trace RUN_DIR [--trace-skip N]]

The per-layer costs come from ``--profile``, else from the profile the plan records (written
by ``pipedream plan``, relative to the plan file), which must be of the plan's workload and
microbatch size (other ``workload_args`` get a note); the bandwidths from ``--topology`` or
``--bandwidth``, else the cluster the plan records, else one level at 1e9 bytes/s. It prints
the grid (ranks x time slots, bubbles as ``.``), the simulated steady-state time per minibatch
next to the plan's own prediction, and each rank's busy share (with ``--spread``, every
forward and backward drawn from the profile's ``pass_spread``, and with ``--message-spread``
every message's transfer time drawn from the ratios given, the mean time per minibatch
instead: :mod:`~pipedream.optimizer.simulator`). Without them it also prints the mean time
per minibatch with every action and message 5% longer or shorter at random, and calls the
fixed steady state fragile where that is more than 3% away
(:func:`~pipedream.optimizer.simulator.jittered`: stages without slack that late actions hold
up, and cycles of microbatches that the tables leave free to drift against each other, which
fixed times hold at the fill's offset). With ``--trace`` it also sets the simulation beside
the run of the plan it predicts (``pipedream train --trace``): the run's
time per minibatch, each stage's profiled and measured action times, and the plan simulated
again with the measured ones (:mod:`~pipedream.optimizer.measured`; drawn from the same spread
with ``--spread``), which tells a profile that was off from a model that is. No torch.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence

from pipedream.errors import PlanningError
from pipedream.formats.plan import Plan, load_plan, profile_path
from pipedream.formats.profile import PassSpread, Profile, load_profile
from pipedream.formats.topology import DEFAULT_BANDWIDTH, Topology, load_topology
from pipedream.formats.trace import RankTrace, load_traces
from pipedream.optimizer.command import bandwidth_option
from pipedream.optimizer.measured import MeasuredRun, measure_run, measured_work
from pipedream.optimizer.messages import link_times
from pipedream.optimizer.simulator import (
    FRAGILE,
    JITTER,
    Event,
    Network,
    Timeline,
    default_steps,
    jittered,
    simulate,
    stage_work,
)
from pipedream.optimizer.timeline import draw_timeline, format_timeline
from pipedream.optimizer.verify import INTERFACE
from pipedream.schedules import Op
from pipedream.wording import count

__all__ = [
    "check_profile",
    "concurrency_note",
    "format_jitter",
    "format_measured",
    "format_report",
    "run",
    "workload_args_note",
]


def _profile(args: argparse.Namespace, plan: Plan) -> tuple[Profile, str]:
    """The profile of the layers' costs, and how the messages name it; refused where it is of
    another workload or microbatch size than the plan (:func:`check_profile`)."""
    if args.profile is not None:
        profile, source = load_profile(args.profile), f"--profile {args.profile}"
    else:
        path = profile_path(plan, args.plan)
        if path is None:
            raise PlanningError(
                f"{args.plan} does not record the profile it was made from (a hand-written "
                "plan?); pass --profile PROFILE"
            )
        if not path.exists():
            raise PlanningError(
                f"{args.plan} was made from the profile {plan.profile}, which is not at {path}; "
                "pass --profile PROFILE"
            )
        profile, source = load_profile(path), f"the profile {path}"
    check_profile(profile, source, plan, args.plan, recorded=args.profile is None)
    return profile, source


def check_profile(
    profile: Profile, source: str, plan: Plan, plan_source: str, *, recorded: bool = False
) -> None:
    """Raise :class:`PlanningError` where ``profile`` (named ``source``; ``recorded``: the one
    the plan records) measured another workload or another microbatch size than ``plan``
    trains: its costs are then not the plan's, and the times simulated from them meaningless."""
    if profile.workload != plan.workload:
        raise PlanningError(
            f"{source}: measured the workload {profile.workload}, but {plan_source} trains "
            f"{plan.workload}; pass --profile with a profile of {plan.workload}"
        )
    if profile.microbatch_size != plan.microbatch_size:
        again = f"profile again with --microbatch-size {plan.microbatch_size}"
        fix = (
            f"{again} and pass that with --profile"
            if recorded
            else f"pass the profile the plan was made from, or {again}"
        )
        raise PlanningError(
            f"{source}: measured microbatches of {profile.microbatch_size} samples, but "
            f"{plan_source} trains microbatches of {plan.microbatch_size}; {fix}"
        )


def workload_args_note(profile: Profile, source: str, plan: Plan, plan_source: str) -> str:
    """A note where ``profile`` was measured with other workload options than ``plan`` records
    (a plan records those of the profile it was made from), else an empty string.

    Not a refusal: options such as ``lr``, ``seed`` or ``samples`` leave every layer's costs as
    they are (a plan edited to train at another ``lr`` simulates from its own profile), and an
    option given with its default value is the same model as one left out. Options of the
    model's sizes do change them, which nothing but the user can tell apart here."""
    keys = sorted(set(profile.workload_args) | set(plan.workload_args))
    differ = [
        f"{key}: {profile.workload_args.get(key, 'its default')} in the profile, "
        f"{plan.workload_args.get(key, 'its default')} in the plan"
        for key in keys
        if profile.workload_args.get(key) != plan.workload_args.get(key)
    ]
    if not differ:
        return ""
    return (
        f"note: {source} was measured with other workload_args than {plan_source} records "
        f"({'; '.join(differ)}); the times below are right only if these options leave the "
        "layers as they are (as lr or seed do, unlike sizes): else profile with the plan's"
    )


def precision_note(profile: Profile, source: str, plan: Plan, plan_source: str) -> str:
    """A note where ``profile`` was measured in another precision than ``plan`` trains in,
    else an empty string (the layers' times and bytes are those of the profile's)."""
    if profile.precision == plan.precision:
        return ""
    return (
        f"note: {source} was measured in {profile.precision}, and {plan_source} trains in "
        f"{plan.precision}: the times below are {profile.precision}'s; profile with "
        f"--precision {plan.precision} to simulate the plan's runs"
    )


def run_settings_notes(
    traces: Sequence[RankTrace], profile: Profile, plan: Plan, run_dir: str
) -> list[str]:
    """Notes where the traced run trained otherwise than the simulation assumes: taking the
    global gradient norm, in another precision than the profile's, or recomputing where the
    plan does not (or the reverse)."""
    notes = []
    if any(event.op is Op.CLIP for trace in traces for event in trace.events):
        notes.append(
            f"note: every update of the run in {run_dir} waited for the whole model's gradient "
            "norm (--clip-grad-norm, or fp16's loss scale): the simulation leaves out that "
            "allreduce over all ranks, one number per update"
        )
    run = traces[0].run if traces else None
    if run is None:  # a trace written before runs recorded it
        return notes
    if run.precision != profile.precision:
        notes.append(
            f"note: the run in {run_dir} trained in {run.precision}, and the profile was "
            f"measured in {profile.precision}: profile with --precision {run.precision} to "
            "simulate that run"
        )
    if run.recompute and not plan.recompute:
        notes.append(
            f"note: the run in {run_dir} recomputed activations in backward (--recompute), and "
            "the plan does not: a plan from `plan --recompute` simulates that run"
        )
    elif plan.recompute and not run.recompute:
        notes.append(
            f"note: the run in {run_dir} did not recompute activations, and the plan does "
            "(recompute: true): the simulation counts second forwards that the run did not run"
        )
    return notes


def _topology(args: argparse.Namespace, plan: Plan) -> Topology:
    if args.topology is not None and args.bandwidth is not None:
        raise PlanningError(
            f"both --topology {args.topology} and --bandwidth {args.bandwidth} given; use one"
        )
    if args.topology is not None:
        topology = load_topology(args.topology)
    elif args.bandwidth is not None:
        value = bandwidth_option("--bandwidth", args.bandwidth, "1e9")
        topology = Topology.single_level(plan.world_size, value)
    else:
        topology = plan.topology or Topology.single_level(plan.world_size, DEFAULT_BANDWIDTH)
    if topology.num_workers < plan.world_size:
        raise PlanningError(
            f"the topology has {topology.num_workers} workers but the plan needs "
            f"{plan.world_size}; give the cluster the plan runs on"
        )
    return topology


def _host_bandwidth(args: argparse.Namespace) -> float | None:
    text = getattr(args, "host_bandwidth", None)
    return None if text is None else bandwidth_option("--host-bandwidth", text, "2e9")


def _duplex(args: argparse.Namespace) -> float | None:
    value = getattr(args, "duplex", None)
    if value is not None and not 1 <= value <= 2:
        raise PlanningError(
            f"--duplex {value}: must be between 1 (a link's two directions share its "
            "bandwidth) and 2 (full duplex)"
        )
    return value


def _per_rank(args: argparse.Namespace) -> float | None:
    value = getattr(args, "per_rank", None)
    if value is not None and not (math.isfinite(value) and value > 0):
        raise PlanningError(
            f"--per-rank {value}: must be a positive multiple of a link's bandwidth, e.g. 1 "
            "(a rank moves one link's worth in and out together)"
        )
    return value


def _steps(args: argparse.Namespace, plan: Plan) -> int | None:
    if args.steps is None:
        return None  # the simulator finds its steady state
    multiple = plan.steps_multiple
    if args.steps < 1 or args.steps % multiple:
        fix = multiple * max(1, math.ceil(args.steps / multiple))
        raise PlanningError(
            f"--steps {args.steps}: must be a positive multiple of {multiple} (every replica of "
            f"every stage runs whole minibatches); use --steps {fix}"
        )
    return int(args.steps)


MAX_ACTIONS = 2_000_000
"""Forward and backward actions a simulation from the command line runs at most (seconds, and
a few hundred MB of events); the planner's own simulations stop far sooner."""


def _max_minibatches(plan: Plan, steps: int | None, network: Network) -> int:
    """The longest run the simulation may take; refuses a plan whose shortest run is longer,
    naming what makes it long: the steps asked for, the microbatches, the replica counts."""
    per_minibatch = 2 * plan.world_size * plan.microbatches
    needed = steps if steps is not None else default_steps(plan, network)
    if needed * per_minibatch <= MAX_ACTIONS:
        return MAX_ACTIONS // per_minibatch
    period = plan.steps_multiple
    fixes = []
    fitting = MAX_ACTIONS // per_minibatch // period * period
    if steps is not None and fitting >= period:
        fixes.append(f"--steps {fitting}")
    if plan.microbatches > 1:
        fixes.append("fewer microbatches per minibatch (plan --microbatches)")
    if period > 1 and (steps is None or fitting < period):  # runs are counted in periods
        replicas = [stage.replicas for stage in plan.stages]
        fixes.append(
            f"replica counts with a smaller least common multiple: {replicas} repeat only every "
            f"{period} minibatches (training needs --steps in multiples of it too)"
        )
    if not fixes:
        fixes.append("fewer workers")
    raise PlanningError(
        f"simulating this plan takes {needed} minibatches of "
        f"{count(plan.microbatches, 'microbatch')} on {plan.world_size} ranks, "
        f"{needed * per_minibatch:,} forwards and backwards (at most {MAX_ACTIONS:,}); use "
        f"{', or '.join(fixes)}"
    )


def _trace_skip(args: argparse.Namespace) -> int | None:
    skip = getattr(args, "trace_skip", None)
    if skip is not None and getattr(args, "trace", None) is None:
        raise PlanningError(f"--trace-skip {skip} needs --trace RUN_DIR (the run to measure)")
    if skip is not None and skip < 0:
        raise PlanningError(f"--trace-skip {skip}: must be >= 0 minibatches")
    return skip


def _message_spread(args: argparse.Namespace) -> tuple[float, ...] | None:
    """``--message-spread``'s ratios, else None; one clear error for a bad one."""
    text = getattr(args, "message_spread", None)
    if text is None:
        return None
    ratios = []
    for item in text.split(","):
        try:
            ratio = float(item)
        except ValueError:
            ratio = math.nan
        if not math.isfinite(ratio) or ratio <= 0:
            raise PlanningError(
                f"--message-spread {text!r}: {item.strip()!r} is not a positive ratio; give "
                "each message time over their median, comma-separated, e.g. 0.9,1.0,1.4"
            )
        ratios.append(ratio)
    return tuple(ratios)


def _drawn_description(spread: PassSpread | None, messages: tuple[float, ...] | None) -> str:
    """What a drawn simulation drew, for the report."""
    parts = []
    if spread is not None:
        parts.append("every forward and backward drawn from the profile's pass_spread (--spread)")
    if messages is not None:
        parts.append(
            f"every message's transfer time from {len(messages)} ratio(s), "
            f"{min(messages):.2f}x-{max(messages):.2f}x (--message-spread)"
        )
    return "; ".join(parts)


def _spread(args: argparse.Namespace, profile: Profile) -> PassSpread | None:
    """The profile's spread of whole passes with ``--spread``, else None."""
    if not getattr(args, "spread", False):
        return None
    if profile.spread is None:
        raise PlanningError(
            f"--spread: the profile of {profile.workload} records no pass_spread (imported, or "
            "written by an older pipedream profile); profile it again, or leave --spread out"
        )
    return profile.spread


def format_report(
    timeline: Timeline, plan: Plan, drawn: str = "", *, enough_steps: int | None = None
) -> str:
    """The simulated time next to the plan's prediction, and the busy share of each rank
    (``drawn``: what the simulation drew from a spread, said when it did; ``enough_steps``:
    the minibatches a run needs for its fill, a steady state and its drain, suggested where
    the run was too short for them)."""
    first, last = timeline.measured
    n = timeline.num_minibatches
    if timeline.drawn:
        where = f"the mean between minibatches {first} and {last} of {n}"
    elif timeline.steady:
        where = f"steady state between minibatches {first} and {last} of {n}"
    elif timeline.from_start:
        every = f"all {count(n, 'minibatch')}" if n > 1 else count(n, "minibatch")
        where = f"the average over {every} from the start, fill and drain included"
    else:
        where = f"the average between minibatches {first} and {last} of {n}, after the fill"
    lines = [f"simulated time per minibatch: {timeline.time_per_minibatch_ms:.3f} ms ({where})"]
    if timeline.drawn:
        lines.append(drawn)
    elif timeline.from_start:
        more = "more minibatches with --steps"
        if enough_steps is not None and enough_steps > n:
            more = f"at least --steps {enough_steps}"
        lines.append(
            f"no steady state: {count(n, 'minibatch')} {'is' if n == 1 else 'are'} too few for "
            f"the pipeline's fill, a steady state and its drain; simulate {more}, or leave "
            "--steps out (the simulator then runs until its steady state shows)"
        )
    elif not timeline.steady:
        lines.append(
            "no steady cycle showed (the average over the window above): simulate more "
            "minibatches with --steps"
        )
    if plan.prediction is not None:
        predicted = plan.prediction.time_per_minibatch_ms
        ratio = timeline.time_per_minibatch_ms / predicted
        fill = "; the simulated time includes the fill" if timeline.from_start else ""
        lines.append(
            f"plan's prediction ({plan.prediction.cost_model} cost model): {predicted:.3f} ms "
            f"(simulated / predicted = {ratio:.3f}{fill})"
        )
    ranks = dict.fromkeys(rank for stage in plan.stages for rank in stage.ranks)
    busy = [f"{rank}: {100 * timeline.busy_fraction(rank):.0f}%" for rank in ranks]
    lines.append("busy share per rank (the rest is bubbles and waiting): " + ", ".join(busy))
    return "\n".join(lines)


def format_jitter(timeline: Timeline, noisy: Timeline, *, steps_given: bool = False) -> str:
    """The fixed simulation next to the jittered one (:func:`jittered`), and whether the fixed
    steady state is fragile (the two more than :data:`FRAGILE` apart). The two are compared
    only where the fixed run's time is its steady state, or the simulator's own run's average
    (``steps_given``: the run's length was ``--steps``, and one that reached no steady state
    averages over what it had, the fill too where it is too short)."""
    head = (
        f"with every action and message {100 * JITTER:.0f}% longer or shorter at random "
        f"(seeded): {noisy.time_per_minibatch_ms:.3f} ms per minibatch"
    )
    window = f"the mean between minibatches {noisy.measured[0]} and {noisy.measured[1]}"
    if not timeline.steady and (steps_given or timeline.from_start):
        return (
            f"{head} ({window}; not compared with the fixed time above, which is no steady state)"
        )
    change = noisy.time_per_minibatch_ms / timeline.time_per_minibatch_ms - 1
    line = f"{head} ({change:+.1%}; {window})"
    if abs(change) > FRAGILE:
        line += (
            "\nthe fixed steady state is fragile: small timing noise moves it (a late action "
            "holds up stages that have no slack; cycles of microbatches that only share ranks "
            "drift against each other, and messages that then overlap slow each other down); "
            "a real run, never free of noise, is likely nearer the jittered time"
        )
    return line


_ACTIONS = (("F", "forward"), ("B", "backward"), ("U", "update"), ("S", "send"))


def _window(timeline: Timeline) -> tuple[float, float]:
    """The simulation's steady window: its start and end (ms)."""
    first, last = timeline.measured
    return timeline.completions_ms[first] if first > 0 else 0.0, timeline.completions_ms[last]


def _window_events(timeline: Timeline, stage: int) -> tuple[list[Event], float]:
    """The events of ``stage`` inside the simulation's steady window, and its length (ms)."""
    start, end = _window(timeline)
    events = [
        e for e in timeline.events if e.stage == stage and start <= e.start_ms and e.end_ms <= end
    ]
    return events, end - start


def _simulated_means(timeline: Timeline, stage: int) -> dict[str, float]:
    """Mean milliseconds of each kind of action the simulation charged ``stage`` in its steady
    window (as the run's are measured in its own); a split backward's as the mean input
    half plus the mean weight half, as the run's is measured."""
    durations: dict[str, list[float]] = {}
    for event in _window_events(timeline, stage)[0]:
        durations.setdefault(event.kind, []).append(event.end_ms - event.start_ms)
    means = {kind: statistics.fmean(values) for kind, values in durations.items()}
    if "B" not in means and "I" in means and "W" in means:
        means["B"] = means["I"] + means["W"]
    return means


def _simulated_shares(timeline: Timeline, stage: int) -> tuple[float, float]:
    """Shares of the steady window ``stage``'s ranks spend posting receives ahead (``R``) and
    waiting for earlier sends to leave (``W``) in the simulation: the parts of the run's time
    between actions that it models."""
    events, length = _window_events(timeline, stage)
    ranks = {e.rank for e in events}
    if not ranks or length <= 0:
        return 0.0, 0.0
    spent = {kind: sum(e.end_ms - e.start_ms for e in events if e.kind == kind) for kind in "RH"}
    return spent["R"] / length / len(ranks), spent["H"] / length / len(ranks)


def format_measured(timeline: Timeline, replay: Timeline, run: MeasuredRun, run_dir: str) -> str:
    """The simulation beside the run it predicts (``--trace``): the measured time per
    minibatch, each stage's simulated and measured mean action times, each link's simulated
    and measured message times, and the ``replay`` (the plan simulated with the measured
    action times)."""
    measured = run.time_per_minibatch_ms
    unit = "minibatches"
    if run.minibatches_per_update > 1:
        unit = f"updates of the last stage ({run.minibatches_per_update} minibatches each)"
    left_out = f"the first {run.left_out} left out"
    if run.run_start:
        left_out = f"the run resumed at {run.run_start}, its first {run.left_out} left out"
    if run.across_checkpoints:
        left_out += f", and {run.across_checkpoints} across checkpoints"
    lines = [
        f"measured by the run in {run_dir}: {measured:.3f} ms per minibatch (the mean of "
        f"{run.intervals} interval(s) between {unit} {run.first_minibatch} and "
        f"{run.last_minibatch}; {left_out}); simulated / measured "
        f"= {timeline.time_per_minibatch_ms / measured:.3f}",
        "mean ms per action, simulated from the profile / measured by the run (and the "
        "share of the time spent between actions, in the executor's own work, of which the "
        "simulation models posting receives ahead, --recv-overhead, and waiting for earlier "
        "sends to leave; the run's trace records both):",
    ]
    for number, stage in enumerate(run.stages):
        simulated = _simulated_means(timeline, number)
        values = {"F": stage.forward_ms, "B": stage.backward_ms, "U": stage.update_ms}
        values["S"] = stage.send_ms
        parts = []
        for kind, name in _ACTIONS:
            got, expected = values[kind], simulated.get(kind)
            if got is None or expected is None:
                continue
            ratio = f" (x{got / expected:.2f})" if expected > 0 else ""
            parts.append(f"{name} {expected:.2f} / {got:.2f}{ratio}")
        if stage.between is not None and parts:
            posting, reclaiming = _simulated_shares(timeline, number)
            text = f"between actions {posting + reclaiming:.1%} / {stage.between:.1%} of the time"
            if stage.posting is not None and stage.reclaiming is not None:
                text += (
                    f" (posting receives {posting:.1%} / {stage.posting:.1%}, waiting for "
                    f"sends {reclaiming:.1%} / {stage.reclaiming:.1%})"
                )
            parts.append(text)
        lines.append(f"  stage {number}: " + (", ".join(parts) or "no actions in the window"))
    lines += _format_links(timeline, run)
    replayed = replay.time_per_minibatch_ms
    lines.append(
        f"simulated with the run's own forward, backward and update times: {replayed:.3f} ms per "
        f"minibatch (simulated / measured = {replayed / measured:.3f}): the profile accounts for "
        f"the step from {timeline.time_per_minibatch_ms / measured:.3f}, the model of the "
        "schedule and the network for what remains"
    )
    return "\n".join(lines)


def _format_links(timeline: Timeline, run: MeasuredRun) -> list[str]:
    """Each link's median message time, simulated / measured (:mod:`~pipedream.optimizer.
    messages`), for the links on which the run's receivers waited."""
    if not run.links:
        return []
    simulated = {
        (x.source, x.destination, x.kind): x
        for x in link_times(timeline.messages, *_window(timeline))
    }
    lines = [
        "median ms from the post of a send to the message's arrival, simulated / measured, "
        "over the messages whose receiver waited for them (how many):"
    ]
    for link in run.links:
        name = f"  stage {link.source} -> {link.destination} {link.kind}: "
        model = simulated.get((link.source, link.destination, link.kind))
        if model is None:
            lines.append(name + f"none waited / {link.median_ms:.2f} ({link.count} messages)")
            continue
        ratio = f"x{link.median_ms / model.median_ms:.2f}; " if model.median_ms > 0 else ""
        lines.append(
            name + f"{model.median_ms:.2f} / {link.median_ms:.2f} "
            f"({ratio}{model.count} / {link.count} messages)"
        )
    return lines


def concurrency_note(profile: Profile, plan: Plan, topology: Topology) -> str:
    """A note when a CPU profile was measured beside fewer processes than the ranks that will
    share a host (the innermost level's unit), else an empty string: their contention is then
    missing from the layers' times (``pipedream profile --concurrent``)."""
    per_host = min(topology.levels[0].workers, plan.world_size)
    if profile.device != "cpu" or profile.concurrent >= per_host:
        return ""
    return (
        f"note: the profile was measured by {count(profile.concurrent, 'process')} training "
        f"at once, but up to {per_host} ranks share a host ({topology.levels[0].name}) here; on "
        f"CPUs the layers then run slower than profiled: profile with --concurrent {per_host}"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``pipedream simulate``; returns the exit status."""
    plan = load_plan(args.plan)
    for option, value in (
        ("--latency", args.latency),
        ("--send-overhead", args.send_overhead),
        ("--send-overhead-per-mib", args.send_overhead_per_mib),
        ("--recv-overhead", args.recv_overhead),
    ):
        if value < 0 or not math.isfinite(value):
            raise PlanningError(f"{option} {value}: must be >= 0 milliseconds")
    if args.width < 1:
        raise PlanningError(f"--width {args.width}: must be at least 1 slot")
    message_spread = _message_spread(args)
    per_rank = _per_rank(args)
    profile, source = _profile(args, plan)
    topology = _topology(args, plan)
    steps = _steps(args, plan)
    skip = _trace_skip(args)
    run_dir: str | None = getattr(args, "trace", None)
    measured, traces = None, []
    if run_dir is not None:  # read before simulating: a wrong directory fails fast
        traces = load_traces(run_dir)
        measured = measure_run(traces, plan, skip=skip)
    work = stage_work(plan, profile)
    network = Network.from_topology(
        topology,
        latency_ms=args.latency,
        unit_capacity=_host_bandwidth(args),
        send_ms=args.send_overhead,
        send_ms_per_mib=args.send_overhead_per_mib,
        duplex=_duplex(args),
        recv_ms=args.recv_overhead,
        per_rank=per_rank,
        interface=getattr(args, "interface", INTERFACE),
        message_spread=message_spread,
    )
    spread = _spread(args, profile)
    longest = _max_minibatches(plan, steps, network)
    timeline = simulate(
        plan, work, network, num_minibatches=steps, max_minibatches=longest, spread=spread
    )
    print(
        f"{plan.workload}: schedule {plan.schedule}, {count(plan.num_stages, 'stage')} on "
        f"{count(plan.world_size, 'rank')}, {count(plan.microbatches, 'microbatch')} per "
        f"minibatch, {count(timeline.num_minibatches, 'minibatch')} on {topology.describe()}"
    )
    for note in (
        workload_args_note(profile, source, plan, args.plan),
        precision_note(profile, source, plan, args.plan),
        concurrency_note(profile, plan, topology),
        *(run_settings_notes(traces, profile, plan, run_dir) if run_dir is not None else ()),
    ):
        if note:
            print(note)
    print()
    print(format_timeline(timeline, plan, width=args.width))
    print()
    drawn = _drawn_description(spread, network.message_spread)
    print(format_report(timeline, plan, drawn, enough_steps=default_steps(plan, network)))
    if not timeline.drawn:
        noisy = jittered(plan, work, network)
        print(format_jitter(timeline, noisy, steps_given=steps is not None))
    if measured is not None:
        print()
        replayed = measured_work(work, measured)
        replay = simulate(plan, replayed, network, num_minibatches=steps, spread=spread)
        print(format_measured(timeline, replay, measured, str(run_dir)))
    if args.png is not None:
        draw_timeline(timeline, plan, args.png)
        print(f"wrote {args.png}")
    return 0
