"""Simulator accuracy: ``pipedream simulate``'s time per minibatch vs the measured one.

    python benchmarks/simulator_accuracy.py      (after sleep_pipeline.py and real_compute.py)

For every plan those two benchmarks ran, the layers are profiled with ``pipedream profile``
(the same workload options; the profile carries the optimizer step and the runtime's cost per
action) and the plan is simulated with ``pipedream simulate --profile`` on a network calibrated
on this machine by ``sleep_pipeline.py`` (:func:`network`): latency = the one-way time of a
32 KiB gloo message (``gloo_p2p.py``), bandwidth = 32 MiB / the one-way time of a 32 MiB one,
the host's copy capacity shared by concurrent messages (``gloo_host.py``,
``--host-bandwidth``), and what posting a send and a receive ahead holds a rank
(``gloo_p2p.py``, ``--send-overhead``, ``--recv-overhead``). A 32 MiB case's message time
and capacity come from all the calibrations with as many processes as its ranks that the
sleep benchmark took around its cases within the hour (:func:`session_around`; those right
before and after the case alone give a column of their own). The measured time is read
again from the runs' traces (for the mlp cases, which ran in several rounds, the medians of
the rounds). Target: within 10%. Each case is also replayed: simulated again with the costs
its run's actions took (``pipedream simulate --trace``), which tells the profile's share of an
error from the model's. Refreshes the ``simulator`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml
from common import (
    RUNS,
    machine_lines,
    profile_workload,
    run_command,
    update_intervals_ms,
    write_section,
)
from gloo_host import capacity
from real_compute import (
    MICROBATCH_SIZE,
    OURS,
    PROFILE_AFTER,
    PROFILE_BEFORE,
    PROFILE_REPEATS,
    ROUNDS,
    case_directory,
    case_name,
)
from sleep_pipeline import (
    DISAGREE,
    HOST_CALIBRATIONS,
    SIZES,
    cases,
    gloo_p2p_path,
    host_calibration_path,
    read_gloo_p2p,
)
from sleep_pipeline import MICROBATCH_SIZE as SLEEP_MICROBATCH

from pipedream.formats.trace import load_traces

__all__ = ["main"]

_SIMULATED = re.compile(r"simulated time per minibatch: ([0-9.]+) ms")
_REPLAYED = re.compile(r"simulated with the run's own [a-z, ]+ times: ([0-9.]+) ms")
_JITTERED = re.compile(r"longer or shorter at random \(seeded\): ([0-9.]+) ms")
PIPEDREAM = [sys.executable, "-m", "pipedream.cli"]
QUIET = "one after quiet"
"""The ``gloo_host.py`` pattern that gives the sleep cases' message time."""


def _profiles(
    directory: Path, plan: dict[str, Any], microbatch_size: int, commands: list[str]
) -> list[Path]:
    """The profiles taken right before and right after the case's run, if its benchmark took
    them (real compute: the shared machine's speed drifts over minutes); else one per set of
    workload options, taken once per run of this script."""
    adjacent = [directory / PROFILE_BEFORE, directory / PROFILE_AFTER]
    if any(path.exists() for path in adjacent):
        return [path for path in adjacent if path.exists()]
    args = plan["workload_args"]
    key = "-".join(f"{k}{v}" for k, v in sorted(args.items()))
    path = RUNS / "simulator" / f"profile-{plan['workload']}-{key}.yaml"
    if not path.exists():
        command = profile_workload(plan["workload"], args, microbatch_size, path)
        commands.append(command.shell())
        if command.returncode != 0:
            raise RuntimeError(command.output[-2000:])
    return [path]


def _simulate(
    plan_path: Path,
    profile: Path,
    network: list[str],
    skip: int,
    commands: list[str],
    *,
    drawn: list[str] | None,
) -> tuple[float, float | None, float | None] | None:
    """The simulated time per minibatch, the replay: the plan simulated again with the
    forward, backward and update times its run measured (``--trace``; the same window as
    :func:`_measured`), and the time with every action and message 5% longer or shorter at
    random (what ``pipedream simulate`` prints beside a fixed simulation). ``drawn``: every
    forward and backward drawn from the profile's spread of whole passes (``--spread``), with
    these options added (:func:`message_spread`), and neither of the other two (None)."""
    argv = [*PIPEDREAM, "simulate", str(plan_path), "--profile", str(profile), *network]
    if drawn is not None:
        argv += ["--spread", *drawn]
    else:
        argv += ["--trace", str(plan_path.parent / "run"), "--trace-skip", str(skip)]
    command = run_command(argv, timeout=300)
    commands.append(command.shell())
    match, replayed = _SIMULATED.search(command.output), _REPLAYED.search(command.output)
    noisy = _JITTERED.search(command.output)
    fixed_ok = drawn is not None or (replayed is not None and noisy is not None)
    if command.returncode != 0 or match is None or not fixed_ok:
        print(f"  simulate {plan_path}: FAILED {command.output[-1500:]}", file=sys.stderr)
        return None
    return (
        float(match.group(1)),
        None if replayed is None else float(replayed.group(1)),
        None if noisy is None else float(noisy.group(1)),
    )


def send_overhead(post_ms: dict[int, float]) -> tuple[float, float]:
    """``--send-overhead`` and ``--send-overhead-per-mib`` from ``P2P.send``'s post times
    (``gloo_p2p.py``): the line through the small and the large message's.

    >>> [round(ms, 4) for ms in send_overhead({32768: 0.15, 33554432: 2.63})]
    [0.1476, 0.0776]
    """
    small, large = SIZES["small"], SIZES["large"]
    per_mib = max(0.0, (post_ms[large] - post_ms[small]) / ((large - small) / 2**20))
    return max(0.0, post_ms[small] - small / 2**20 * per_mib), per_mib


def timed_calibrations(directory: Path) -> list[tuple[float, dict[str, Any]]]:
    """The ``gloo_host.py`` runs ``sleep_pipeline.py`` took right before and after the case in
    ``directory``, and a third where those two disagreed (its 32 MiB cases; none for the
    others), each with when its file was written."""
    paths = [host_calibration_path(directory, when) for when in HOST_CALIBRATIONS]
    return [(p.stat().st_mtime, json.loads(p.read_text())) for p in paths if p.exists()]


def session_calibration(calibrations: list[dict[str, Any]]) -> dict[str, Any]:
    """One calibration from all the ``gloo_host.py`` runs with the same number of processes
    that ``sleep_pipeline.py`` took (two or three around each 32 MiB case, about 17 per number
    of processes in a run): every timed repeat of each pattern pooled, each pattern's time their
    median, the host's capacity from those times (:func:`gloo_host.capacity`).

    Why pool: on a loaded host one calibration's repeats of a 32 MiB message can spread widely,
    so the two around a case measure it only roughly, and the speed a case's run saw is no
    closer to them than to the whole session's. Pooling every repeat of the session gives a
    steadier estimate; the calibrations around each case alone still get a column of their own
    in the results, for comparison.

    >>> pooled = session_calibration([
    ...     {"processes": 2, "ms": {"one": 10.0}, "each_ms": {"one": [9.0, 10.0, 30.0]}},
    ...     {"processes": 2, "ms": {"one": 12.0}, "each_ms": {"one": [11.0, 12.0, 13.0]}},
    ... ])
    >>> pooled["ms"], pooled["capacity_bytes_per_s"], pooled["each_ms"]["one"][-1]
    ({'one': 11.5}, None, 13.0)
    """
    sizes = {calibration["processes"] for calibration in calibrations}
    assert len(sizes) == 1, f"calibrations of different sizes pooled: {sizes}"
    (processes,) = sizes
    each: dict[str, list[float]] = {}
    for calibration in calibrations:
        for name, ms in calibration["ms"].items():
            each.setdefault(name, []).extend(calibration.get("each_ms", {}).get(name, [ms]))
    times = {name: statistics.median(trials) for name, trials in each.items()}
    return {
        "processes": processes,
        "ms": times,
        "capacity_bytes_per_s": capacity(times, processes),
        "each_ms": each,
    }


SESSION_S = 3600.0
"""Calibrations taken within this many seconds (by their files' times) of a case's own are
pooled for it (:func:`session_calibration`): those of the same run of ``sleep_pipeline.py``
(about 50 minutes), not those of cases read back from a run hours apart (``--reuse``)."""


def session_around(
    own: list[tuple[float, dict[str, Any]]], everyone: list[tuple[float, dict[str, Any]]]
) -> dict[str, Any]:
    """:func:`session_calibration` of the calibrations in ``everyone`` (:func:`timed_calibrations`
    of every case) with as many processes as a case's ``own`` and taken within
    :data:`SESSION_S` of their mean time."""
    size = own[0][1]["processes"]
    middle = statistics.fmean(when for when, _ in own)
    return session_calibration(
        [
            calibration
            for when, calibration in everyone
            if calibration["processes"] == size and abs(when - middle) <= SESSION_S
        ]
    )


def network(
    hosts: list[dict[str, Any]],
    latency_ms: float,
    large_ms: float,
    post: tuple[float, float] = (0.0, 0.0),
    recv_post_ms: float = 0.0,
) -> tuple[list[str], str]:
    """``pipedream simulate``'s network options for a case calibrated by ``hosts`` (the
    session's :func:`session_calibration`, or the case's own :func:`timed_calibrations`), and
    what they are: ``latency_ms`` (the 32 KiB time of ``gloo_p2p.py``); with calibrations, the
    32 MiB time (after 40 ms of quiet on the link, where calibrated: the sleep layers leave the
    links quiet between messages), the host's capacity and the links' duplex factor
    (:func:`duplex_factor`) of the ``gloo_host.py`` runs (their medians: the mean of two, the
    middle one of three), each rank moving one link's worth in all
    (``--per-rank 1``: gloo's one transport thread per process); without, ``large_ms`` (the
    32 MiB time of ``gloo_p2p.py``) and links of their own (messages of a few KiB do not load
    the host); the time posting a message holds the sender, ``post`` (:func:`send_overhead`),
    and posting its receive ahead the receiver, ``recv_post_ms``."""
    capacity = duplex = None
    message = "one"
    if hosts:
        if all(QUIET in host["ms"] for host in hosts):
            message = QUIET  # sleep layers leave the links quiet between messages
        large_ms = statistics.median(host["ms"][message] for host in hosts)
        known = [h["capacity_bytes_per_s"] for h in hosts if h["capacity_bytes_per_s"]]
        capacity = statistics.median(known) if known else None
        duplex = duplex_factor(hosts)
    bandwidth = SIZES["large"] / (large_ms / 1000)
    argv = ["--bandwidth", f"{bandwidth:.0f}", "--latency", f"{latency_ms:.3f}"]
    argv += ["--send-overhead", f"{post[0]:.4f}", "--send-overhead-per-mib", f"{post[1]:.4f}"]
    argv += ["--recv-overhead", f"{recv_post_ms:.4f}"]
    described = f"32 MiB in {large_ms:.1f} ms" + (" after quiet" if message != "one" else "")
    if capacity is not None:
        argv += ["--host-bandwidth", f"{capacity:.0f}"]
        described += f", host {capacity / 1e9:.2f} GB/s"
    if duplex is not None:
        argv += ["--duplex", f"{duplex:.3f}"]
        described += f", duplex {duplex:.2f}"
    if hosts:  # messages that load the host: each process's one gloo thread carries them all
        argv += ["--per-rank", "1"]
        described += ", one link per rank"
    else:  # links of their own, without the planner's network interface per rank
        argv += ["--no-interface"]
    return argv, described


def message_spread(hosts: list[dict[str, Any]]) -> list[str]:
    """``pipedream simulate --message-spread`` from the ``gloo_host.py`` runs around a case
    (:func:`timed_calibrations`): every timed repeat of each of their patterns over that
    pattern's median (how much one message's time varied from the next on this host, with as
    many processes as the case); no options where they did not record their repeats (older
    calibrations, and cases without any).

    >>> message_spread([{"each_ms": {"one": [10.0, 12.0, 15.0], "chain of 3": [30.0, 60.0, 33.0]}}])
    ['--message-spread', '0.8333,1,1.25,0.9091,1.818,1']
    """
    ratios = []
    for host in hosts:
        for trials in host.get("each_ms", {}).values():
            middle = statistics.median(trials)
            ratios += [f"{trial / middle:.4g}" for trial in trials]
    return ["--message-spread", ",".join(ratios)] if ratios else []


def duplex_factor(hosts: list[dict[str, Any]]) -> float:
    """What a link moves both ways at once, in multiples of one way (``pipedream simulate
    --duplex``): ``2 x one / both ways`` of the ``gloo_host.py`` runs (their median), within
    [1, 2].

    >>> duplex_factor([{"ms": {"one": 12.5, "both ways": 20.0}}])
    1.25
    """
    factors = [2 * host["ms"]["one"] / host["ms"]["both ways"] for host in hosts]
    return min(2.0, max(1.0, statistics.median(factors)))


def _measured(run_dir: Path, skip: int) -> list[float] | None:
    """The run's intervals between minibatches in its steady window (ms), None if it has
    none."""
    try:
        return update_intervals_ms(load_traces(run_dir), skip=skip)
    except Exception as exc:  # a case that failed or was not run
        print(f"  {run_dir}: no measurement ({exc})", file=sys.stderr)
        return None


def spread(rounds: list[list[float]]) -> str:
    """How much single minibatches varied: each interval against its run's mean, the lowest
    and the highest over the rounds, after how many intervals were measured in each.

    >>> spread([[90.0, 110.0], [100.0, 100.0]])
    '2 x 2: -10% .. +10%'
    """
    relative = [value / statistics.fmean(values) - 1 for values in rounds for value in values]
    counts = sorted({len(values) for values in rounds})
    count = "/".join(str(n) for n in counts)
    prefix = f"{len(rounds)} x {count}" if len(rounds) > 1 else count
    return f"{prefix}: {min(relative):+.0%} .. {max(relative):+.0%}"


def main() -> int:
    shutil.rmtree(RUNS / "simulator", ignore_errors=True)  # profile afresh on every run
    p2p = read_gloo_p2p(gloo_p2p_path())
    latency_ms, large_ms = p2p.one_way_ms[SIZES["small"]], p2p.one_way_ms[SIZES["large"]]
    post = send_overhead(p2p.post_ms)
    recv_post_ms = p2p.recv_post_ms[SIZES["small"]]
    commands: list[str] = []
    rows = []
    replays_within = 0
    drawn_errors: list[float] = []
    jitter_errors: list[float] = []
    local_errors: list[float] = []
    session_errors: list[float] = []  # the same cases' errors with the session's calibrations
    todo: list[tuple[str, list[Path], int, int]] = []
    for case in cases([2, 4, 8], ["small", "large"]):
        todo.append(
            (case.name, [RUNS / "sleep" / case.name], case.steps_and_skip[1], SLEEP_MICROBATCH)
        )
    everyone = [timed for _, dirs, _, _ in todo for timed in timed_calibrations(dirs[0])]
    for schedule, m, stages, _, skip in OURS:
        name = case_name(schedule, m, stages)
        rounds = [case_directory(name, r) for r in range(ROUNDS)]
        todo.append((name, rounds, skip, MICROBATCH_SIZE))
    for name, directories, skip, microbatch_size in todo:
        pairs = []  # (measured, simulated, replayed, with --spread, jittered) of each round
        local: list[float] = []  # simulated with the calibrations around each round, if any
        intervals = []  # each round's minibatch intervals
        networks = set()
        for directory in directories:
            plan_path = directory / "plan.yaml"
            if not plan_path.exists():
                continue
            window = _measured(directory / "run", skip)
            plan = yaml.safe_load(plan_path.read_text())
            profiles = _profiles(directory, plan, microbatch_size, commands)
            own = timed_calibrations(directory)
            around = [calibration for _, calibration in own]
            hosts = [session_around(own, everyone)] if own else []
            options, described = network(hosts, latency_ms, large_ms, post, recv_post_ms)
            networks.add(described)
            each = [
                _simulate(plan_path, path, options, skip, commands, drawn=drawn)
                for drawn in (None, message_spread(hosts))
                for path in profiles
            ]
            alone = None  # simulated with the case's own calibrations, to compare
            if around:
                argv, _ = network(around, latency_ms, large_ms, post, recv_post_ms)
                alone = _simulate(plan_path, profiles[0], argv, skip, commands, drawn=None)
            found = [value for value in each if value is not None]
            if window and found and len(found) == len(each):
                fixed, with_spread = found[: len(profiles)], found[len(profiles) :]
                simulated = statistics.mean(s for s, _, _ in fixed)
                replayed = statistics.mean(r for _, r, _ in fixed if r is not None)
                noisy = statistics.mean(j for _, _, j in fixed if j is not None)
                drawn_ms = statistics.mean(s for s, _, _ in with_spread)
                if alone is not None:
                    local.append(alone[0])
                pairs.append((statistics.fmean(window), simulated, replayed, drawn_ms, noisy))
                intervals.append(window)
        if not pairs:
            continue
        measured = statistics.median(p[0] for p in pairs)
        simulated = statistics.median(p[1] for p in pairs)
        replayed = statistics.median(p[2] for p in pairs)
        drawn_ms = statistics.median(p[3] for p in pairs)
        noisy = statistics.median(p[4] for p in pairs)
        jitter_errors.append(noisy / measured - 1)
        drawn_errors.append(drawn_ms / measured - 1)
        error, replay_error = simulated / measured - 1, replayed / measured - 1
        replays_within += abs(replay_error) <= 0.10
        verdict = "met" if abs(error) <= 0.10 else f"**missed by {abs(error) - 0.10:.2f}**"
        by_round = ", ".join(f"{p[1] / p[0] - 1:+.1%}" for p in pairs) if len(pairs) > 1 else ""
        local_ms = statistics.median(local) if local else None
        if local_ms is not None:
            local_errors.append(local_ms / measured - 1)
            session_errors.append(error)
        local_cell = "" if local_ms is None else f"{local_ms:.1f} ({local_errors[-1]:+.1%})"
        rows.append(
            f"| {name} | {'; '.join(sorted(networks))} | {measured:.1f} | {spread(intervals)} | "
            f"{simulated:.1f} | {error:+.1%} | {by_round} | "
            f"{noisy:.1f} ({jitter_errors[-1]:+.1%}) | "
            f"{drawn_ms:.1f} ({drawn_errors[-1]:+.1%}) "
            f"| {local_cell} | {replayed:.1f} | {replay_error:+.1%} | {verdict} |"
        )
        print(
            f"  {name}: measured {measured:.1f} ms, simulated {simulated:.1f} ms ({error:+.1%}), "
            f"replayed {replayed:.1f} ms ({replay_error:+.1%})"
        )
    within = sum("| met |" in row for row in rows)
    drawn_within = sum(abs(error) <= 0.10 for error in drawn_errors)
    jitter_within = sum(abs(error) <= 0.10 for error in jitter_errors)
    local_within = sum(abs(error) <= 0.10 for error in local_errors)
    session_within = sum(abs(error) <= 0.10 for error in session_errors)
    body = [
        "## Simulator accuracy: predicted vs measured time per minibatch",
        "",
        *machine_lines(),
        "- regenerate: `python benchmarks/simulator_accuracy.py` (after the two benchmarks above)",
        "",
        "Each plan run above, simulated by `pipedream simulate PLAN --profile PROFILE` with the "
        "workload profiled by `pipedream profile` (default repetitions; for the mlp cases, "
        f"{PROFILE_REPEATS} timed passes, about as long as a run's measured window, "
        "right before and right after each run, as the machine's speed drifts, with "
        "`--concurrent` = the run's ranks: a co-runner trains beside the profiler as the other "
        "stage does in the run; the simulated time is the mean of the two) and the network "
        "calibrated on this machine (gloo, one way): "
        f"{latency_ms:.2f} ms latency per message (`gloo_p2p.py`), and for the "
        "32 MiB cases the time of one message after 40 ms of quiet on its link (ping-pong, "
        "each end holding the message 40 ms; these sleep pipelines' links are quiet between "
        "messages; with 2 processes that was a median 1.27x one sent right after a barrier), the "
        "links' duplex factor (`--duplex`: 2 x one message / two sent each "
        "way at once) and the host's copy capacity shared by "
        "concurrent messages (`gloo_host.py` with as many processes as the case has ranks: "
        "every calibration of that size the sleep benchmark took within "
        f"{SESSION_S / 60:.0f} minutes of the case's own, two right before and right "
        "after each case and a third where those two disagreed by more than "
        f"{DISAGREE}x, their repeats pooled: one calibration's repeats spread too widely "
        "for the few around a case to be a good measure of it; those alone are the column "
        "with the calibrations around the case), each rank moving one link's worth in and out "
        "together "
        "(`--per-rank 1`: gloo carries all of a process's messages on one thread); the other "
        "cases' messages, a few KiB, take 32 MiB in "
        f"{large_ms:.1f} ms (`gloo_p2p.py`) and do not load the host. Posting a message "
        f"holds the sender {post[0]:.3f} ms plus {post[1]:.4f} ms per MiB "
        "(`--send-overhead`, `--send-overhead-per-mib`: the line through the times the "
        "runtime's `P2P.send` took for a 32 KiB and a 32 MiB message in `gloo_p2p.py`'s "
        "exchange between 2 processes, in which each end, after a "
        f"{p2p.quiet_ms:.0f} ms sleep (its action), posts the receive of its next message "
        "ahead and then its send, as the runtime does after an action), and posting a receive "
        f"ahead holds the receiver {recv_post_ms:.3f} ms (`--recv-overhead`: "
        "`P2P.post_recv` of a 32 KiB message there; "
        f"{p2p.recv_post_ms[SIZES['large']]:.3f} ms for 32 MiB). "
        "The profiles carry each layer's optimizer step and the runtime's cost per action, "
        "and how much their whole passes varied; with spread = the same simulation with "
        "every forward and backward drawn from that spread (`--spread`, seeded; the mean over "
        "the last 64 minibatches before the drain, after 64 more past the fill), as a "
        "pipeline's stages vary and hold each other up, and for the 32 MiB cases every "
        "message's transfer drawn from how much the messages of those calibrations "
        "varied (`--message-spread`: each timed repeat of each `gloo_host.py` "
        "pattern over that pattern's median), as a late message holds up its receiver. "
        "Measured = the same steady-state time per minibatch as "
        f"above, from the traces. The mlp cases ran {ROUNDS} times (see above): measured and "
        "simulated are the medians of the rounds, each round simulated with the profiles "
        "taken right before and after it. "
        "With 5% jitter = what `pipedream simulate` prints beside the fixed simulation: the "
        "mean time per minibatch with every forward, backward and message 5% longer or shorter "
        "at random (seeded), where tables that leave cycles of microbatches free to drift "
        "against each other show what fixed times hide (the cycles stay at the fill's offset). "
        f"Within 10% in {within} of {len(rows)} cases (with 5% jitter: {jitter_within}; with "
        f"spread: {drawn_within}; the {len(local_errors)} 32 MiB cases with the calibrations "
        f"around each case alone: {local_within}, against {session_within} with the session's). "
        "Replayed = the plan simulated again "
        "with the forward, backward and update times its run measured, in the same window "
        "(`pipedream simulate --trace RUN_DIR --trace-skip N`, the median of the rounds): what "
        "the replay misses is the model's (schedule, network), the step from the simulated "
        f"error to the replay's is the profile's. Replay within 10% in {replays_within} of "
        f"{len(rows)} cases. Single minibatches = the intervals the measured time averages "
        "(per round), the lowest and the highest against their run's mean: how much the "
        "measurement itself varied.",
        "",
        "| case | network | measured ms | single minibatches | simulated ms | error "
        "| error of each round | with 5% jitter ms (error) | with spread ms (error) "
        "| with the calibrations around the case ms (error) "
        "| replayed ms | replay error | target (within 10%) |",
        "|---|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "<details><summary>Commands run</summary>",
        "",
        "```",
        *commands,
        "```",
        "",
        "</details>",
    ]
    write_section("simulator", "\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
