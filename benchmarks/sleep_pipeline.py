"""Sleep workload: every schedule against the physical limit and torch.distributed.pipelining.

    python benchmarks/sleep_pipeline.py [--stages 2,4,8] [--sizes small,large]

One sleep layer per stage (``forward_ms`` F and ``backward_ms`` B per stage and microbatch),
S = 2, 4, 8 stages, m = 8 and 16 microbatches per minibatch, 32 KiB and 32 MiB activations.
Each case runs through ``./launch.sh PLAN --trace``; the time per minibatch is the mean gap
between the last stage's optimizer updates after the warm-up (from the traces). The ideal is
(m + S - 1)(F + B) per minibatch for the flushing schedules (1f1b, gpipe) and m(F + B) for the
asynchronous ones in steady state (pipedream and pipedream-vs take m = 1 per minibatch).
ScheduleGPipe and Schedule1F1B of torch.distributed.pipelining run the same model on the same
split (``torch_pipelining.py``). Refreshes the ``sleep`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
    REPO,
    RUNS,
    WARM_MESSAGES,
    Command,
    plan_dict,
    run_command,
    steady_period_ms,
    write_plan,
)
from sleep_report import render

from pipedream.formats.plan import load_plan
from pipedream.formats.trace import load_traces
from pipedream.runtime.trace_account import account_run
from pipedream.runtime.trace_export import write_chrome_trace
from pipedream.runtime.trace_plot import matplotlib_available, plot_timeline
from pipedream.schedules import SCHEDULES, lookup

__all__ = ["F_MS", "B_MS", "Case", "main"]

F_MS, B_MS = 20.0, 40.0
"""Sleep per stage and microbatch (ms): ~1 ms of per-action runtime overhead is then ~3%."""
MICROBATCH_SIZE = 8
SIZES = {"small": 32 * 1024, "large": 32 * 1024 * 1024}
FLUSHING = tuple(name for name, schedule in SCHEDULES.items() if schedule.flushes)
ASYNC = ("pipedream", "pipedream-vs", "2bw")
EXAMPLE_TIMELINES = ("small-S4-1f1b-m8", "large-S2-1f1b-m8")
"""Cases always drawn (benchmarks/timelines/), besides the least efficient one of each size."""


@dataclass(frozen=True)
class Case:
    """One benchmark configuration."""

    size: str
    """``small`` (32 KiB) or ``large`` (32 MiB) activations per microbatch."""
    stages: int
    """Pipeline depth S (one rank and one sleep layer per stage)."""
    schedule: str
    """Schedule name."""
    microbatches: int
    """Microbatches per minibatch m (1 for pipedream and pipedream-vs)."""

    @property
    def name(self) -> str:
        return f"{self.size}-S{self.stages}-{self.schedule}-m{self.microbatches}"

    @property
    def ideal_ms(self) -> float:
        m, s = self.microbatches, self.stages
        return (m + s - 1 if self.schedule in FLUSHING else m) * (F_MS + B_MS)

    @property
    def steps_and_skip(self) -> tuple[int, int]:
        """Minibatches to run and updates to leave out before measuring.

        The first minibatch is the pipeline's fill and process start-up, so flushing schedules
        skip one update, 2bw two and asynchronous PipeDream its ``S`` in flight and two more.
        With 32 MiB messages a link warms up for its first ``WARM_MESSAGES`` (``common.py``),
        so updates are also skipped until every link has carried that many (``2 m`` per
        minibatch). PipeDream minibatches are short and vary a lot one by one when 32 MiB
        messages share a few cores, so ``PIPEDREAM_MEASURED`` of them are averaged. Flushing
        and 2bw runs measure the 2 minibatches after the skipped ones with 32 KiB messages
        (they hardly vary), and 7 with 32 MiB messages, whose single minibatches vary by tens
        of percent around their run's mean.
        """
        m = self.microbatches
        large = self.size == "large"
        warm = math.ceil(WARM_MESSAGES / (2 * m)) if large else 0
        measured = 8 if large else 3
        if self.schedule in FLUSHING:
            skip = max(1, warm)
            return skip + measured, skip
        if lookup(self.schedule).microbatches_at_least_stages:  # 2bw: a version one minibatch old
            skip = max(2, warm + 1)
            return skip + measured, skip
        skip = self.stages + 2 + warm
        return skip + PIPEDREAM_MEASURED, skip

    def placement(self) -> list[int] | None:
        """The rank of every stage where ranks run several stages (None: one rank each)."""
        return None

    @property
    def ranks(self) -> int:
        placement = self.placement()
        return self.stages if placement is None else len(set(placement))

    def workload_args(self) -> dict[str, Any]:
        return {
            "layers": self.stages,
            "forward_ms": F_MS,
            "backward_ms": B_MS,
            "activation_bytes": SIZES[self.size],
        }


PIPEDREAM_MEASURED = 60
"""Minibatches a PipeDream (``pipedream``, ``pipedream-vs``) case averages. The 32 MiB cases'
intervals between minibatches vary by a fifth or so (standard deviation over mean), so the mean
of 20 would be known only to several percent, too loose against a 10% target; 60 take a few
seconds more per case."""


def cases(stages: list[int], sizes: list[str]) -> list[Case]:
    out = []
    for size in sizes:
        for s in stages:
            for name, schedule in SCHEDULES.items():
                if schedule.several_stages_per_rank or schedule.splits_backward:  # zero_bubble.py's
                    continue
                counts = (1,) if schedule.one_microbatch else (8, 16)
                out += [Case(size, s, name, m) for m in counts]
    return out


def run_ours(case: Case, *, reuse: bool = False) -> dict[str, Any]:
    """Launch one case with tracing (one retry); return its measurement and the commands (a
    32 MiB case's with the host calibrations right before and after it).

    With ``reuse``, a case whose run directory holds a finished run of the same command is
    read back instead of run again (to finish an interrupted benchmark).
    """
    directory = RUNS / "sleep" / case.name
    stages = [(str(i), str(i)) for i in range(case.stages)]
    plan = plan_dict(
        "sleep",
        case.workload_args(),
        stages,
        schedule=case.schedule,
        microbatch_size=MICROBATCH_SIZE,
        microbatches=case.microbatches,
        placement=case.placement(),
    )
    steps, skip = case.steps_and_skip
    path = directory / "plan.yaml"
    argv = ["./launch.sh", str(path), "--steps", str(steps), "--run-dir", str(directory / "run")]
    argv += ["--trace", "--no-progress", "--timeout", "120"]
    done = directory / "done.txt"
    result: dict[str, Any] = {"case": case}
    if reuse and done.exists() and done.read_text() == " ".join(argv):
        command = None
        result["commands"] = [shell_line(argv)]
        if case.size == "large":  # the calibrations it ran between, read back with it
            before, *after = (
                shell_line(calibration_argv(case.stages, host_calibration_path(directory, when)))
                for when in HOST_CALIBRATIONS
                if host_calibration_path(directory, when).exists()
            )
            result["commands"] = [before, *result["commands"], *after]
    else:
        for _ in range(2):  # a port clash or a shared machine's hiccup should not lose a case
            shutil.rmtree(directory, ignore_errors=True)
            write_plan(plan, path)
            calibrations = []
            if case.size == "large":  # for simulator_accuracy.py: the copy speed drifts
                out = host_calibration_path(directory, HOST_CALIBRATIONS[0])
                calibrations.append(calibrate_host(case.stages, out))
            command = run_command(argv, timeout=300)
            (directory / "output.log").write_text(command.output)
            if command.returncode == 0:
                if case.size == "large":
                    out = host_calibration_path(directory, HOST_CALIBRATIONS[1])
                    calibrations.append(calibrate_host(case.stages, out))
                    if calibrations_disagree(directory):
                        out = host_calibration_path(directory, HOST_CALIBRATIONS[2])
                        calibrations.append(calibrate_host(case.stages, out))
                done.write_text(" ".join(argv))
                break
        result["commands"] = [*calibrations[:1], command.shell(), *calibrations[1:]]
    if command is not None and command.returncode != 0:
        reasons = [line for line in command.output.splitlines() if "pipedream" in line.lower()]
        result["error"] = (reasons or ["exit status " + str(command.returncode)])[-1:]
        print(f"  {case.name}: FAILED twice: {result['error']}", file=sys.stderr)
        return result
    traces = load_traces(directory / "run")
    period, intervals = steady_period_ms(traces, skip=skip)
    result.update(period_ms=period, intervals=intervals, traces=traces)
    # the same window: the last stage's updates after the first ``skip``
    result["accounting"] = account_run(traces, load_plan(path), source=str(path), skip=skip)
    print(f"  {case.name}: {period:.1f} ms/minibatch, efficiency {case.ideal_ms / period:.3f}")
    return result


def run_torch(
    stages: int, group: list[Case], *, reuse: bool = False
) -> tuple[dict[str, float], Command]:
    """All torch.distributed.pipelining cases of one depth in one torchrun launch."""
    directory = RUNS / "sleep" / f"torch-S{stages}"
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "results.json"
    specs = []
    for case in group:
        steps, skip = case.steps_and_skip
        specs.append(
            {
                "name": case.name,
                "workload": "sleep",
                "workload_args": {k: str(v) for k, v in case.workload_args().items()},
                "stages": [[str(i), str(i)] for i in range(stages)],
                "schedule": case.schedule,
                "placement": case.placement(),
                "microbatches": case.microbatches,
                "microbatch_size": MICROBATCH_SIZE,
                "steps": steps,
                "warmup": skip + 1,  # the same steady-state window as ours
            }
        )
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ranks = {case.ranks for case in group}
    assert len(ranks) == 1, ranks
    argv += ["--nproc-per-node", str(ranks.pop()), "benchmarks/torch_pipelining.py"]
    argv += [str(directory / "cases.json"), str(out)]
    cases_json = json.dumps(specs, indent=1)
    names = {spec["name"] for spec in specs}
    if reuse and out.exists() and (directory / "cases.json").read_text() == cases_json:
        found = json.loads(out.read_text())
        if names <= {item["name"] for item in found}:
            return {item["name"]: item["period_ms"] for item in found}, Command(
                tuple(argv), 0, 0.0, ""
            )
    (directory / "cases.json").write_text(cases_json)
    out.unlink(missing_ok=True)
    command = run_command(argv, timeout=600)
    if command.returncode != 0:
        print(f"  torch S={stages}: FAILED {command.output[-3000:]}", file=sys.stderr)
    found = json.loads(out.read_text()) if out.exists() else []
    for item in found:
        print(f"  torch {item['name']}: {item['period_ms']:.1f} ms/minibatch")
    return {item["name"]: item["period_ms"] for item in found}, command


def gloo_p2p_path() -> Path:
    """Where :func:`gloo_message_ms` leaves ``gloo_p2p.py``'s calibration."""
    return RUNS / "sleep" / "gloo-p2p.json"


@dataclass(frozen=True)
class GlooP2P:
    """``gloo_p2p.py``'s calibration: milliseconds per message size (bytes)."""

    one_way_ms: dict[int, float]
    """One message, rank to rank."""
    post_ms: dict[int, float]
    """``P2P.send`` posting it, after the quiet of an action."""
    recv_post_ms: dict[int, float]
    """``P2P.post_recv`` posting its receive ahead, after the quiet of an action."""
    quiet_ms: float
    """The quiet before each timed post."""


def read_gloo_p2p(path: Path) -> GlooP2P:
    """``gloo_p2p.py``'s calibration from ``path``."""
    data = json.loads(path.read_text())
    sizes = ("one_way_ms", "post_ms", "recv_post_ms")
    per_size = ({int(k): v for k, v in data[key].items()} for key in sizes)
    return GlooP2P(*per_size, quiet_ms=float(data["quiet_ms"]))


def gloo_message_ms(*, reuse: bool = False) -> tuple[dict[int, float], Command]:
    """The one-way time of a gloo message per size (``gloo_p2p.py``, run now or reused)."""
    out = gloo_p2p_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    argv += ["2", "benchmarks/gloo_p2p.py", str(out)]
    if reuse and out.exists() and "recv_post_ms" in json.loads(out.read_text()):
        return read_gloo_p2p(out).one_way_ms, Command(tuple(argv), 0, 0.0, "")
    command = run_command(argv, timeout=120)
    return (read_gloo_p2p(out).one_way_ms if command.returncode == 0 else {}), command


HOST_CALIBRATIONS = ("before", "after", "again")
"""When the host's copy capacity is calibrated around each 32 MiB case (``gloo_host.py``): right
before and right after it, and once more right after those two if they disagree
(:func:`calibrations_disagree`). A shared machine's speed drifts within minutes, so one
calibration taken at another time need not say what the case's run saw. The simulator takes
the median of the calibrations (the mean of two)."""
DISAGREE = 1.5
"""Ratio of the message times of the two calibrations around a case beyond which a third one
breaks the tie: where one of the two caught the host in a slow moment, the run between them
moves its messages at neither speed, and their mean would be far off; the median of three
leaves the outlier out."""


def calibrations_disagree(directory: Path) -> bool:
    """Whether the calibrations right before and right after the case in ``directory`` are more
    than :data:`DISAGREE` apart in the time of one message or one after quiet (a burst of other
    work on the host during one of them)."""
    before, after = (
        json.loads(host_calibration_path(directory, when).read_text())["ms"]
        for when in HOST_CALIBRATIONS[:2]
    )
    return any(
        max(before[key], after[key]) > DISAGREE * min(before[key], after[key])
        for key in ("one", "one after quiet")
        if key in before and key in after
    )


def host_calibration_path(directory: Path, when: str) -> Path:
    """Where :func:`calibrate_host` leaves the calibration taken ``when`` a case ran."""
    return directory / f"gloo-host-{when}.json"


def shell_line(argv: list[str]) -> str:
    """``argv`` as the results file lists a command (one read back rather than run now)."""
    return Command(tuple(argv), 0, 0.0, "").shell()


def calibration_argv(stages: int, out: Path) -> list[str]:
    """The command of ``gloo_host.py`` with ``stages`` processes, writing into ``out``."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    return [*argv, str(stages), "benchmarks/gloo_host.py", str(out)]


def calibrate_host(stages: int, out: Path) -> str:
    """Run ``gloo_host.py`` with ``stages`` processes (they share the cores and the cache as
    the pipeline's ranks do) into ``out``; return the command. Raises if it fails."""
    command = run_command(calibration_argv(stages, out), timeout=300)
    if command.returncode != 0:
        raise RuntimeError(command.output[-2000:])
    return command.shell()


def save_timeline(result: dict[str, Any], path: Path) -> None:
    """Chrome trace next to the run; a PNG of two steady minibatches at ``path``."""
    case: Case = result["case"]
    traces = result["traces"]
    write_chrome_trace(traces, RUNS / "sleep" / case.name / "trace.json")
    if not matplotlib_available():
        return
    origin = min(e.start for t in traces for e in t.events)
    last = max(e.stage for t in traces for e in t.events)  # a rank may run several stages
    ends = sorted(
        (e.end - origin) * 1000
        for t in traces
        for e in t.events
        if e.op.value == "U" and e.stage == last
    )
    period = result["period_ms"]
    low = ends[-3] - 0.2 * period if len(ends) >= 3 else 0.0
    high = ends[-1] + 0.05 * period if len(ends) >= 3 else ends[-1]
    title = (
        f"{case.schedule}, S={case.stages}, m={case.microbatches}, {case.size} activations: "
        f"{period:.0f} ms per minibatch vs {case.ideal_ms:.0f} ms ideal"
    )
    plot_timeline(traces, path, title=title, window=(low, high))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="2,4,8", help="comma-separated depths")
    parser.add_argument("--sizes", default="small,large", help="small, large or both")
    parser.add_argument(
        "--reuse", action="store_true", help="read back cases already run with the same command"
    )
    args = parser.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    sizes = [s for s in args.sizes.split(",") if s]
    todo = cases(stages, sizes)
    message_ms, p2p_command = gloo_message_ms(reuse=args.reuse)
    commands = [p2p_command.shell()]
    ours = []
    for case in todo:
        result = run_ours(case, reuse=args.reuse)
        commands += result["commands"]
        ours.append(result)
    torch_ms: dict[str, float] = {}
    for s in stages:
        group = [c for c in todo if c.stages == s and c.schedule in FLUSHING]
        found, command = run_torch(s, group, reuse=args.reuse)
        torch_ms.update(found)
        commands.append(command.shell())
    timelines = REPO / "benchmarks" / "timelines"
    for stale in timelines.glob("sleep-*.png"):
        stale.unlink()
    shown = []
    measured = [r for r in ours if "period_ms" in r]
    pictures = [r for r in measured if r["case"].name in EXAMPLE_TIMELINES]
    for size in sizes:  # and the least efficient case of each size
        mine = [r for r in measured if r["case"].size == size]
        if mine:
            pictures.append(min(mine, key=lambda r: r["case"].ideal_ms / r["period_ms"]))
    for result in pictures:
        path = timelines / f"sleep-{result['case'].name}.png"
        if not path.exists():
            save_timeline(result, path)
            shown.append((result["case"].name, path.relative_to(REPO / "benchmarks")))
    render(ours, torch_ms, message_ms, commands, shown, f_ms=F_MS, b_ms=B_MS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
