"""A run's measured time per minibatch and stage costs, and the simulation replayed with them
(``pipedream simulate --trace``), on hand-made traces with known answers."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipedream.cli import main
from pipedream.errors import TraceError
from pipedream.formats import LayerProfile, Plan, Profile, StagePlan, save_plan, save_profile
from pipedream.formats.trace import RankTrace, TraceEvent, plan_identity
from pipedream.optimizer.measured import measure_run, measured_work
from pipedream.optimizer.messages import LinkTimes, link_times
from pipedream.optimizer.simulator import Network, StageWork, simulate
from pipedream.schedules import parse_action

PLAN = Plan(
    "toy",
    "pipedream",
    8,
    1,
    2,
    (StagePlan("a", "a", 1, (0,)), StagePlan("b", "b", 1, (1,))),
)
PERIOD = 0.010
"""Every minibatch of the hand-made run takes 10 ms on both stages."""
# (action kind, start, end) in ms within a minibatch's 10 ms, per stage: stage 0 forwards in
# 2 ms, posts its send in 0.2, waits, backwards in 4 and updates in 1; stage 1 forwards in 3,
# backwards in 5, posts its gradient in 0.5 and updates in 1 (its update ends the minibatch).
PATTERN = {
    0: [("F", 0.0, 2.0), ("SF", 2.0, 2.2), ("RB", 2.2, 4.0), ("B", 4.0, 8.0), ("U", 8.0, 9.0)],
    1: [("RF", 0.0, 0.5), ("F", 0.5, 3.5), ("B", 3.5, 8.5), ("SB", 8.5, 9.0), ("U", 9.0, 10.0)],
}


def events(stage: int, minibatches: int) -> list[tuple[str, float, float]]:
    """The hand-made run's actions of ``stage`` as (name, start s, end s)."""
    out = []
    for k in range(minibatches):
        for kind, start, end in PATTERN[stage]:
            out.append((f"{stage}{kind}{k}", k * PERIOD + start / 1000, k * PERIOD + end / 1000))
    return out


def traces(minibatches: int = 6, plan: Plan = PLAN) -> list[RankTrace]:
    result = []
    for rank in range(plan.world_size):
        evs = []
        for name, start, end in events(rank, minibatches):
            action = parse_action(name)
            evs.append(TraceEvent(name, action.op, action.stage, action.index, start, end))
        result.append(RankTrace(rank, rank, plan.world_size, tuple(evs), f"rank-{rank}.json"))
    return result


def test_measures_the_steady_window_after_the_skipped_minibatches() -> None:
    run = measure_run(traces(6), PLAN, skip=2)
    assert (run.first_minibatch, run.last_minibatch, run.intervals) == (2, 5, 3)
    assert run.time_per_minibatch_ms == pytest.approx(10.0)
    # the actions of minibatches 3, 4 and 5 lie within [end of 2, end of 5]
    first, last = run.stages
    assert (first.forward_ms, first.backward_ms, first.update_ms, first.send_ms) == pytest.approx(
        (2.0, 4.0, 1.0, 0.2)
    )
    assert (last.forward_ms, last.backward_ms, last.update_ms, last.send_ms) == pytest.approx(
        (3.0, 5.0, 1.0, 0.5)
    )
    # stage 0 idles 1 ms after each update, before the next forward (3 of the window's 30 ms);
    # stage 1's actions follow each other without a gap
    assert (first.between, last.between) == pytest.approx((0.1, 0.0))
    # these traces do not say what the executor did between actions
    assert (first.posting, first.reclaiming, last.posting, last.reclaiming) == (None,) * 4


def test_by_default_a_third_of_the_minibatches_is_left_out() -> None:
    assert measure_run(traces(9), PLAN).first_minibatch == 3
    assert measure_run(traces(3), PLAN).first_minibatch == 1
    assert measure_run(traces(2), PLAN).first_minibatch == 0  # two left to measure between


def test_the_replay_runs_the_measured_costs() -> None:
    # PipeDream's steady state runs at the pace of its slowest stage: 3 + 5 + 1 = 9 ms (the
    # hand-made run took 10: its stage 1 also waited and posted sends)
    profiled = [StageWork(20.0, 40.0, 0, 0, update_ms=9.0, copy_ms=3.0, accumulate_ms=2.0)] * 2
    work = measured_work(profiled, measure_run(traces(6), PLAN, skip=2))
    assert work[1] == StageWork(pytest.approx(3.0), pytest.approx(5.0), 0, 0, pytest.approx(1.0))
    network = Network((64,), (1e12,))
    timeline = simulate(PLAN, work, network, num_minibatches=16)
    assert timeline.time_per_minibatch_ms == pytest.approx(9.0)
    # with the profiled costs, 20 + 40 + 9 + 3 (the copy of stage 0's stashed version)
    assert simulate(PLAN, profiled, network, num_minibatches=16).time_per_minibatch_ms > 70


def test_a_cost_the_window_did_not_see_keeps_the_profiled_value() -> None:
    no_updates = [
        RankTrace(
            t.rank, t.stage, t.world_size, tuple(e for e in t.events if e.op.value != "U"), t.path
        )
        if t.stage == 0
        else t
        for t in traces(6)
    ]
    run = measure_run(no_updates, PLAN, skip=2)
    assert run.stages[0].update_ms is None
    profiled = StageWork(1.0, 1.0, 0, 0, update_ms=7.0, copy_ms=3.0)
    assert measured_work([profiled, profiled], run)[0].update_ms == 7.0


def test_a_replicated_last_stage_completes_one_minibatch_per_replica_per_update() -> None:
    # stage 1 on ranks 1 and 2: each update (every 20 ms, on both) completes 2 minibatches
    plan = Plan(
        "toy", "pipedream", 8, 1, 3, (StagePlan("a", "a", 1, (0,)), StagePlan("b", "b", 2, (1, 2)))
    )

    def updates(rank: int) -> tuple[TraceEvent, ...]:
        op = parse_action("1U0").op
        return tuple(
            TraceEvent(f"1U{k}", op, 1, k, 0.020 * k, 0.020 * k + 0.001 * rank) for k in range(6)
        )

    traces_ = [RankTrace(0, 0, 3, (), "r0")]
    traces_ += [RankTrace(rank, 1, 3, updates(rank), f"r{rank}") for rank in (1, 2)]
    run = measure_run(traces_, plan, skip=1)
    assert (run.first_minibatch, run.last_minibatch, run.minibatches_per_update) == (1, 5, 2)
    assert run.time_per_minibatch_ms == pytest.approx(10.0)
    assert run.stages[1].update_ms == pytest.approx(1.5)
    # there, what --trace-skip leaves out and what the errors count are updates
    with pytest.raises(TraceError, match="completed 6 updates; leaving out the first 5 "):
        measure_run(traces_, plan, skip=5)
    with pytest.raises(TraceError, match=r"lack updates \[0\]"):
        measure_run([traces_[0], *(RankTrace(r, 1, 3, updates(r)[1:], "r") for r in (1, 2))], plan)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda ts: ts[:1], "no trace of rank(s) [1]"),
        (lambda ts: [ts[0], RankTrace(1, 0, 2, ts[1].events, "r1")], "puts rank 1 on stage 1"),
        (lambda ts: [ts[0], RankTrace(1, 1, 4, ts[1].events, "r1")], "the plan has 2 ranks"),
        (
            lambda ts: [ts[0], RankTrace(1, 1, 2, ts[1].events[5:], "r1")],
            "lack the updates of minibatches [0]",
        ),
        (lambda ts: [], "no traces"),
    ],
)
def test_traces_of_another_run_are_refused(damage, message: str) -> None:
    with pytest.raises(TraceError, match=re.escape(message)):
        measure_run(damage(traces(6)), PLAN, skip=2)


@pytest.mark.parametrize("skip", [5, 9])
def test_too_few_minibatches_left_says_what_to_do(skip: int) -> None:
    with pytest.raises(TraceError, match="train longer, or leave out fewer"):
        measure_run(traces(6), PLAN, skip=skip)


def checkpointed(
    minibatches: int, stretches: tuple[tuple[int, int], ...], pause: float
) -> list[RankTrace]:
    """The hand-made run in ``stretches`` between checkpoints, each checkpoint pausing every
    rank for ``pause`` seconds; a first stretch that starts after 0 is a resumed run's."""
    out = []
    for trace in traces(minibatches):
        shifted = []
        for event in trace.events:
            number = sum(first <= event.index for first, _ in stretches[1:])  # checkpoints before
            if event.index < stretches[0][0]:
                continue  # before the resumed run
            at = number * pause
            shifted.append(dataclasses.replace(event, start=event.start + at, end=event.end + at))
        out.append(dataclasses.replace(trace, events=tuple(shifted), stretches=stretches))
    return out


def test_intervals_across_a_checkpoint_are_left_out() -> None:
    """Measured across the checkpoint after minibatch 2, the pause (50 ms: the drain and the
    write) counted as one long minibatch: 22.5 ms per minibatch where each took 10."""
    run = measure_run(checkpointed(6, ((0, 3), (3, 3)), pause=0.050), PLAN, skip=1)
    assert (run.first_minibatch, run.last_minibatch, run.across_checkpoints) == (1, 5, 1)
    assert run.intervals == 3  # 1-2, 3-4, 4-5
    assert run.time_per_minibatch_ms == pytest.approx(10.0)
    # the actions are the same; stage 0's 1 ms idle after each update is 10% of each interval
    assert run.stages[0].forward_ms == pytest.approx(2.0)
    assert (run.stages[0].between, run.stages[1].between) == pytest.approx((0.1, 0.0))
    with pytest.raises(TraceError, match=r"spans a checkpoint \(stretches 0..3, 4..4, 5..5;"):
        measure_run(checkpointed(6, ((0, 4), (4, 1), (5, 1)), pause=0.05), PLAN, skip=3)
    # where every interval of the run spans one, leaving out fewer cannot help: not said
    every = tuple((first, 1) for first in range(6))
    with pytest.raises(TraceError, match=r"\(--checkpoint-every\)$"):
        measure_run(checkpointed(6, every, pause=0.05), PLAN, skip=0)


def test_a_resumed_run_is_measured_from_its_checkpoint() -> None:
    """A run resumed at minibatch 4 has no updates of 0..3: it was refused ("lack the updates
    of minibatches [0, 1, 2, 3]")."""
    run = measure_run(checkpointed(10, ((4, 6),), pause=0.0), PLAN)
    assert (run.run_start, run.first_minibatch, run.last_minibatch) == (4, 6, 9)
    assert (run.left_out, run.intervals) == (2, 3)  # a third of the 6 minibatches it trained
    assert run.time_per_minibatch_ms == pytest.approx(10.0)


def test_a_run_of_another_plan_or_one_that_stopped_is_refused() -> None:
    other = dataclasses.replace(PLAN, schedule="1f1b", workload_args={"width": "64"})
    recorded = [dataclasses.replace(t, plan=plan_identity(other)) for t in traces(6)]
    with pytest.raises(TraceError, match="the run trained workload_args {'width': '64'}, but the"):
        measure_run(recorded, PLAN)
    assert measure_run(recorded, other).intervals == 3  # the plan it trained
    stopped = [dataclasses.replace(t, complete=t.rank != 1) for t in traces(6)]
    with pytest.raises(TraceError, match=r"rank\(s\) \[1\] stopped before the end of the run"):
        measure_run(stopped, PLAN)


# -- pipedream simulate --trace ---------------------------------------------------------------


@pytest.fixture
def run_files(tmp_path: Path) -> dict[str, Path]:
    profile = Profile(
        "toy",
        8,
        "cpu",
        "float32",
        (LayerProfile("a", "Linear", 2.0, 4.0, 8, 8), LayerProfile("b", "Linear", 3.0, 5.0, 8, 8)),
    )
    save_profile(profile, tmp_path / "profile.yaml")
    save_plan(PLAN, tmp_path / "plan.yaml")
    for rank in range(2):
        payload = {
            "format": "pipedream/trace@1",
            "rank": rank,
            "stage": rank,
            "world_size": 2,
            "clock": "unix seconds",
            "events": [
                {"action": n, "start": 1e9 + s, "end": 1e9 + e} for n, s, e in events(rank, 6)
            ],
        }
        path = tmp_path / "run" / "traces" / f"rank-{rank:03d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload))
    return {"plan": tmp_path / "plan.yaml", "profile": tmp_path / "profile.yaml", "run": tmp_path}


def test_simulate_sets_the_run_beside_the_prediction(run_files, capsys) -> None:
    argv = ["simulate", str(run_files["plan"]), "--profile", str(run_files["profile"])]
    argv += ["--bandwidth", "1e12", "--trace", str(run_files["run"] / "run"), "--trace-skip", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # the profile says 2 + 4 and 3 + 5 ms: the simulation runs at 8 ms per minibatch, the run
    # took 10, and replaying the run's own costs (updates of 1 ms added) gives 9
    assert "simulated time per minibatch: 8.000 ms" in out
    assert (
        "measured by the run in " + str(run_files["run"] / "run") + ": 10.000 ms per minibatch "
        "(the mean of 3 interval(s) between minibatches 2 and 5; the first 2 left out); "
        "simulated / measured = 0.800"
    ) in out
    assert "  stage 0: forward 2.00 / 2.00 (x1.00), backward 4.00 / 4.00 (x1.00)" in out
    assert "  stage 1: forward 3.00 / 3.00 (x1.00), backward 5.00 / 5.00 (x1.00)" in out
    assert "update 0.00 / 1.00, between actions 0.0% / 10.0% of the time\n  stage 1" in out
    assert "update 0.00 / 1.00, between actions 0.0% / 0.0% of the time\nsimulated with" in out
    assert (
        "simulated with the run's own forward, backward and update times: 9.000 ms per "
        "minibatch (simulated / measured = 0.900)"
    ) in out


@pytest.mark.parametrize(
    ("stretches", "skip", "says"),
    [
        ([[0, 3], [3, 3]], "1", "3 interval(s) between minibatches 1 and 5; the first 1 left "
         "out, and 1 across checkpoints); simulated / measured = 0.800"),
        ([[2, 4]], None, "2 interval(s) between minibatches 3 and 5; the run resumed at 2, its "
         "first 1 left out); simulated / measured = 0.800"),
    ],
)  # fmt: skip
def test_simulate_says_what_the_window_left_out(run_files, capsys, stretches, skip, says) -> None:
    """Runs with checkpoints were refused ("the traces do not follow the plan's action
    tables"), resumed ones too ("lack the updates of minibatches [0, 1]")."""
    for path in (run_files["run"] / "run" / "traces").iterdir():
        payload = json.loads(path.read_text())
        first = stretches[0][0]
        payload["events"] = [
            e for e in payload["events"] if parse_action(e["action"]).index >= first
        ]
        for event in payload["events"]:  # a 50 ms pause at each checkpoint
            pause = 0.05 * sum(parse_action(event["action"]).index >= f for f, _ in stretches[1:])
            event["start"] += pause
            event["end"] += pause
        payload["stretches"] = stretches
        path.write_text(json.dumps(payload))
    argv = ["simulate", str(run_files["plan"]), "--profile", str(run_files["profile"])]
    argv += ["--bandwidth", "1e12", "--trace", str(run_files["run"] / "run")]
    argv += [] if skip is None else ["--trace-skip", skip]
    assert main(argv) == 0
    assert f": 10.000 ms per minibatch (the mean of {says}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--trace-skip", "1"], "--trace-skip 1 needs --trace RUN_DIR"),
        (["--trace", "{run}/run", "--trace-skip", "-1"], "--trace-skip -1: must be >= 0"),
        (["--trace", "{run}/run", "--trace-skip", "5"], "train longer"),
        (["--trace", "{run}/nowhere"], "no such run directory"),
        (["--trace", "{run}"], "no traces/rank-NNN.json files"),
    ],
)
def test_simulate_trace_mistakes_fail_in_one_line(run_files, capsys, extra, message) -> None:
    argv = ["simulate", str(run_files["plan"]), "--profile", str(run_files["profile"])]
    argv += [a.format(run=run_files["run"]) for a in extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_simulate_trace_does_not_import_torch(run_files) -> None:
    argv = [str(run_files["plan"]), "--profile", str(run_files["profile"])]
    argv += ["--trace", str(run_files["run"] / "run")]
    code = (
        "import sys\n"
        "from pipedream.cli import main\n"
        f"assert main(['simulate', *{argv!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'simulate --trace imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_simulate_splits_the_time_between_actions_as_the_trace_records_it(
    run_files, capsys
) -> None:
    # stage 0's 1 ms before each forward: 0.4 ms posting receives ahead and 0.5 ms waiting for
    # its earlier sends, as the executor records them; stage 1 spends nothing between actions
    for rank in range(2):
        path = run_files["run"] / "run" / "traces" / f"rank-{rank:03d}.json"
        payload = json.loads(path.read_text())
        for event in payload["events"]:
            spent = rank == 0 and event["action"].startswith("0F")
            event["posting"], event["reclaiming"] = (0.0004, 0.0005) if spent else (0.0, 0.0)
        path.write_text(json.dumps(payload))
    argv = ["simulate", str(run_files["plan"]), "--profile", str(run_files["profile"])]
    argv += ["--bandwidth", "1e12", "--recv-overhead", "0.5"]
    argv += ["--trace", str(run_files["run"] / "run"), "--trace-skip", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # over the window's 30 ms: 1.2 ms posting (4.0%), 1.5 ms waiting for sends (5.0%); the
    # simulation posts 0.5 of every 8.5 ms and never waits for a send
    assert (
        "between actions 5.9% / 10.0% of the time (posting receives 5.9% / 4.0%, waiting for "
        "sends 0.0% / 5.0%)\n  stage 1"
    ) in out
    assert (
        "between actions 5.9% / 0.0% of the time (posting receives 5.9% / 0.0%, waiting for "
        "sends 0.0% / 0.0%)\nsimulated with"
    ) in out


def test_simulate_charges_the_receives_posted_ahead_between_actions(run_files, capsys) -> None:
    argv = ["simulate", str(run_files["plan"]), "--profile", str(run_files["profile"])]
    argv += ["--bandwidth", "1e12", "--recv-overhead", "0.5"]
    argv += ["--trace", str(run_files["run"] / "run"), "--trace-skip", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # each stage receives one message per minibatch and posts its receive ahead (0.5 ms): the
    # slower stage 1 (3 + 5 ms) then sets 8.5 ms per minibatch, 0.5 / 8.5 of each stage's time
    assert "simulated time per minibatch: 8.500 ms" in out
    assert "update 0.00 / 1.00, between actions 5.9% / 10.0% of the time\n  stage 1" in out
    assert "update 0.00 / 1.00, between actions 5.9% / 0.0% of the time\nsimulated with" in out


# -- message times ----------------------------------------------------------------------------

GPIPE = dataclasses.replace(PLAN, schedule="gpipe")
# gpipe's tables for 2 stages and one microbatch per minibatch, in ms within each minibatch's
# 10: stage 0 posts its activation at 2.0, stage 1 has waited for it since 0.5 and gets it at
# 4.0 (2 ms); stage 1 posts the gradient at 6.0, stage 0 has waited since 2.2 and gets it at
# 7.0 (1 ms), except minibatch 3's, which arrives at 7.5 (1.5 ms), and minibatch 4's
# activation, which was there before stage 1 reached its receive (0.1 ms: not counted)
GPIPE_PATTERN = {
    0: [("F", 0.0, 2.0), ("SF", 2.0, 2.2), ("RB", 2.2, 7.0), ("B", 7.0, 9.0), ("U", 9.0, 9.5)],
    1: [("RF", 0.5, 4.0), ("F", 4.0, 5.0), ("B", 5.0, 6.0), ("SB", 6.0, 6.2), ("U", 6.2, 6.5)],
}
EXCEPTIONS = {"0RB3": (2.2, 7.5), "0B3": (7.5, 9.0), "1RF4": (3.9, 4.0)}


def gpipe_traces(minibatches: int = 6) -> list[RankTrace]:
    result = []
    for rank in range(2):
        evs = []
        for k in range(minibatches):
            for kind, start, end in GPIPE_PATTERN[rank]:
                name = f"{rank}{kind}{k}"
                start, end = EXCEPTIONS.get(name, (start, end))
                action = parse_action(name)
                times = (k * PERIOD + start / 1000, k * PERIOD + end / 1000)
                evs.append(TraceEvent(name, action.op, action.stage, action.index, *times))
        result.append(RankTrace(rank, rank, 2, tuple(evs), f"rank-{rank}.json"))
    return result


def test_each_links_messages_are_timed_where_their_receiver_waited() -> None:
    run = measure_run(gpipe_traces(6), GPIPE, skip=1)
    # the window runs from minibatch 1's completion (16.5 ms) to minibatch 5's (56.5): the
    # activations of minibatches 2, 3 and 5 (4's receiver did not wait), the gradients of 2,
    # 3 and 4 (5's arrives at 57, after the window)
    assert run.links == (
        LinkTimes(0, 1, "activations", pytest.approx(2.0), 3),
        LinkTimes(1, 0, "gradients", pytest.approx(1.0), 3),
    )


def test_traces_that_do_not_follow_the_plans_tables_time_no_messages() -> None:
    # PLAN is asynchronous PipeDream, whose stage 0 runs two forwards before its first
    # backward; these traces run one at a time
    assert measure_run(traces(6), PLAN, skip=2).links == ()


def test_the_simulation_times_its_messages_the_same_way() -> None:
    # 1 ms forwards and backwards, 1 MB messages over 1e9 bytes/s and 0.25 ms of latency: each
    # message takes 1.25 ms after its post, and each receiver is waiting for it
    work = [StageWork(1.0, 1.0, 0, 1e6), StageWork(1.0, 1.0, 0, 1e6)]
    timeline = simulate(GPIPE, work, Network((2,), (1e9,), latency_ms=0.25), num_minibatches=8)
    assert link_times(timeline.messages, 0.0, timeline.completions_ms[-1]) == [
        LinkTimes(0, 1, "activations", pytest.approx(1.25), 8),
        LinkTimes(1, 0, "gradients", pytest.approx(1.25), 8),
    ]


def test_simulate_trace_prints_each_links_message_times(tmp_path, run_files, capsys) -> None:
    save_plan(GPIPE, tmp_path / "gpipe.yaml")
    for trace in gpipe_traces(6):
        path = tmp_path / "gpipe-run" / "traces" / f"rank-{trace.rank:03d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        events = [
            {"action": e.action, "start": 1e9 + e.start, "end": 1e9 + e.end} for e in trace.events
        ]
        payload = {"format": "pipedream/trace@1", "rank": trace.rank, "stage": trace.stage}
        payload.update(world_size=2, clock="unix seconds", events=events)
        path.write_text(json.dumps(payload))
    argv = ["simulate", str(tmp_path / "gpipe.yaml"), "--profile", str(run_files["profile"])]
    argv += ["--bandwidth", "1e9", "--latency", "0.5"]
    argv += ["--trace", str(tmp_path / "gpipe-run"), "--trace-skip", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # the profile's layers output 8 bytes: a simulated message takes its 0.5 ms of latency;
    # the simulation's steady window holds 3 minibatches (2 to 5), the run's as above
    assert (
        "median ms from the post of a send to the message's arrival, simulated / measured, over "
        "the messages whose receiver waited for them (how many):\n"
        "  stage 0 -> 1 activations: 0.50 / 2.00 (x4.00; 3 / 3 messages)\n"
        "  stage 1 -> 0 gradients: 0.50 / 1.00 (x2.00; 3 / 3 messages)\n"
        "simulated with"
    ) in out
