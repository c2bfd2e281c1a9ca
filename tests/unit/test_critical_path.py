"""The critical-path accounting of a run (``pipedream trace RUN_DIR --plan PLAN``), on a
hand-made two-stage 1F1B run whose path is worked out by hand below."""

from __future__ import annotations

import dataclasses

import pytest

from pipedream.cli import main
from pipedream.errors import TraceError
from pipedream.formats import Plan, StagePlan, save_plan
from pipedream.formats.trace import RankTrace, TraceEvent, write_trace
from pipedream.optimizer.critical_path import account, format_accounting
from pipedream.runtime.trace_account import sleep_ideal_ms
from pipedream.schedules import Op, parse_action

PLAN = Plan("toy", "1f1b", 8, 1, 2, (StagePlan("a", "a", 1, (0,)), StagePlan("b", "b", 1, (1,))))
PERIOD_MS = 10.0
# One minibatch, in ms from its start; (action, start, end, posting, reclaiming) per rank. Its
# tables are 0: F SF RB B U and 1: RF F B SB U (one microbatch per minibatch).
PATTERN = {
    0: [
        ("F", 0.0, 2.0, 0.0, 0.0),
        ("SF", 2.0, 2.2, 0.0, 0.0),
        ("RB", 2.3, 6.0, 0.0, 0.0),
        ("B", 6.0, 9.0, 0.0, 0.0),
        ("U", 9.0, 9.5, 0.0, 0.0),
    ],
    1: [
        ("RF", 0.1, 2.6, 0.0, 0.0),
        ("F", 2.7, 4.7, 0.05, 0.02),  # the gap before it: posting 0.05, reclaiming 0.02
        ("B", 4.7, 5.5, 0.0, 0.0),
        ("SB", 5.5, 5.8, 0.0, 0.0),
        ("U", 5.8, 6.1, 0.0, 0.0),
    ],
}
IDEAL = {(0, Op.FORWARD): 1.5, (0, Op.BACKWARD): 3.0, (1, Op.FORWARD): 2.0, (1, Op.BACKWARD): 0.5}


def run_traces(minibatches: int = 4, pattern: dict = PATTERN) -> list[RankTrace]:
    out = []
    for rank, actions in pattern.items():
        events = []
        for k in range(minibatches):
            for kind, start, end, posting, reclaiming in actions:
                name = f"{rank}{kind}{k}"
                action = parse_action(name)
                at = k * PERIOD_MS
                events.append(
                    TraceEvent(
                        name,
                        action.op,
                        action.stage,
                        action.index,
                        (at + start) / 1000,
                        (at + end) / 1000,
                        posting / 1000,
                        reclaiming / 1000,
                    )
                )
        out.append(RankTrace(rank, rank, 2, tuple(events), f"rank-{rank}.json"))
    return out


def test_every_millisecond_of_the_minibatch_is_put_in_one_category() -> None:
    # Backwards from the end of stage 1's update (6.1) to the previous one's (-3.9):
    # 1U 0.3 update, 1SB 0.3 send, 1B 0.8 (0.5 compute + 0.3 overrun), 1F 2.0 compute, the gap
    # 2.6-2.7 (0.02 reclaiming, 0.05 posting, 0.03 between), then 1RF waited for 0SF, posted
    # at 2.0-2.2: delivery 2.2-2.6 = 0.4, and the path jumps to rank 0: 0SF 0.2 send, 0F 2.0
    # (1.5 compute + 0.5 overrun), the gap after the previous 0U (0.5 between), that 0U 0.5
    # update, and 0B's last 2.9 ms (compute).
    accounting = account(run_traces(), PLAN, skip=1, ideal_ms=IDEAL)
    assert accounting.minibatches == 2
    assert accounting.time_per_minibatch_ms == pytest.approx(10.0)
    expected = {
        "compute": 0.5 + 2.0 + 1.5 + 2.9,
        "compute overrun": 0.3 + 0.5,
        "update": 0.3 + 0.5,
        "allreduce": 0.0,
        "send": 0.3 + 0.2,
        "receive": 0.0,
        "delivery": 0.4,
        "posting receives": 0.05,
        "reclaiming sends": 0.02,
        "between actions": 0.03 + 0.5,
    }
    assert accounting.categories == pytest.approx(expected)
    assert sum(accounting.categories.values()) == pytest.approx(10.0)
    assert (accounting.hops, accounting.hop_ms) == pytest.approx((1.0, 0.4))
    forwards, backwards = accounting.actions
    assert (forwards.op, forwards.count, forwards.mean_ms, forwards.ideal_ms) == pytest.approx(
        (Op.FORWARD, 2.0, 2.0, 1.75)
    )
    # 0B's tail and 1B: the whole actions take 3.0 and 0.8 ms
    assert (backwards.count, backwards.mean_ms, backwards.ideal_ms) == pytest.approx(
        (2.0, 3.8 / 2, 3.5 / 2)
    )
    assert accounting.ideal_ms == pytest.approx(6.9)
    text = format_accounting(accounting)
    assert "delivery" in text and "0.690 efficiency" in text


def test_a_receive_whose_message_was_sent_before_it_keeps_the_path_on_its_rank() -> None:
    # stage 1 reaches its receive only after the send was posted (2.3 > 2.0): the 0.3 ms of
    # the receive are its own, and the path goes on to the idle gap before it on rank 1
    late = dict(PATTERN)
    late[1] = [("RF", 2.3, 2.6, 0.0, 0.0), *PATTERN[1][1:]]
    accounting = account(run_traces(pattern=late), PLAN, skip=1)
    assert accounting.categories["receive"] == pytest.approx(0.3)
    assert accounting.categories["delivery"] == 0.0
    assert accounting.hops == 0.0
    # 6.1 - 2.3 on rank 1 in actions and the gap before F, the rest idle before the receive
    assert accounting.categories["between actions"] == pytest.approx(0.03 + 2.3 + 3.9)
    assert accounting.ideal_ms is None  # no ideal times given: all compute is "compute"
    assert accounting.categories["compute overrun"] == 0.0


def test_the_path_does_not_cross_a_checkpoint() -> None:
    """A run checkpointed after minibatch 2 (the ranks pause 40 ms there): the walk from
    minibatch 3 back to 2 crossed the pause, 20 ms per minibatch instead of 10 over 1..5."""
    shifted = []
    for trace in run_traces(6):
        events = tuple(
            dataclasses.replace(e, start=e.start + 0.040, end=e.end + 0.040) if e.index >= 3 else e
            for e in trace.events
        )
        shifted.append(dataclasses.replace(trace, events=events, stretches=((0, 3), (3, 3))))
    accounting = account(shifted, PLAN, skip=1, ideal_ms=IDEAL)
    assert accounting.minibatches == 3  # 1-2, 3-4, 4-5
    assert accounting.time_per_minibatch_ms == pytest.approx(10.0)
    assert accounting.categories == pytest.approx(
        account(run_traces(), PLAN, skip=1, ideal_ms=IDEAL).categories
    )


def test_runs_the_accounting_cannot_follow_are_refused() -> None:
    with pytest.raises(TraceError, match="leaves fewer than 2 to measure between"):
        account(run_traces(2), PLAN, skip=1)
    replicated = Plan(
        "toy", "1f1b", 8, 1, 3, (StagePlan("a", "a", 1, (0,)), StagePlan("b", "b", 2, (1, 2)))
    )
    with pytest.raises(TraceError, match="replicated last stage"):
        account(run_traces(), replicated)


def test_the_trace_verb_prints_the_accounting(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    for trace in run_traces():
        rows = [(e.action, e.start, e.end, e.posting, e.reclaiming) for e in trace.events]
        write_trace(run_dir, rows, rank=trace.rank, stage=trace.stage, world_size=2)
    save_plan(PLAN, tmp_path / "plan.yaml")
    argv = ["trace", str(run_dir), "--plan", str(tmp_path / "plan.yaml"), "--skip", "1"]
    argv += ["-o", str(tmp_path / "trace.json"), "--png", str(tmp_path / "t.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "critical path over 2 minibatches: 10.0 ms per minibatch" in out
    assert "delivery" in out and "(sum)" in out
    assert main(["trace", str(run_dir), "--skip", "1", "-o", str(tmp_path / "t.json")]) == 2
    assert "--skip applies to the accounting" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()  # refused before anything is written
    negative = ["trace", str(run_dir), "--plan", str(tmp_path / "plan.yaml"), "--skip", "-1"]
    assert main([*negative, "-o", str(tmp_path / "t.json")]) == 2
    # it said "leaving out the first -1 does not leave 2 to measure between", after writing
    assert "--skip -1: must be >= 0 minibatches" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
    # a plan the run does not follow is refused before the trace and the chart are written
    save_plan(dataclasses.replace(PLAN, microbatches=2), tmp_path / "other.yaml")
    other = ["trace", str(run_dir), "--plan", str(tmp_path / "other.yaml")]
    assert main([*other, "-o", str(tmp_path / "t.json"), "--png", str(tmp_path / "o.png")]) == 2
    assert "do not follow the plan's action tables" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "o.png").exists()


def test_the_ideal_of_a_sleep_plan_comes_from_its_layers() -> None:
    plan = Plan(
        "sleep",
        "zb-h1",
        8,
        2,
        2,
        (StagePlan("0", "1", 1, (0,)), StagePlan("2", "2", 1, (1,))),
        workload_args={"layers": "3", "forward_ms": "10", "backward_ms": "30", "weight_ms": "12"},
    )
    ideal = sleep_ideal_ms(plan, source="plan.yaml")
    assert ideal is not None
    # stage 0: two layers, the first's whole backward is its weight gradient (its input needs
    # none): W = 30 + 12, I = 60 - 42
    assert ideal[(0, Op.FORWARD)] == pytest.approx(20.0)
    assert ideal[(0, Op.BACKWARD)] == pytest.approx(60.0)
    assert ideal[(0, Op.BACKWARD_WEIGHT)] == pytest.approx(42.0)
    assert ideal[(0, Op.BACKWARD_INPUT)] == pytest.approx(18.0)
    assert (ideal[(1, Op.BACKWARD_INPUT)], ideal[(1, Op.BACKWARD_WEIGHT)]) == pytest.approx(
        (18.0, 12.0)
    )
    other = Plan("toy", "1f1b", 8, 1, 1, (StagePlan("a", "a", 1, (0,)),))
    assert sleep_ideal_ms(other, source="plan.yaml") is None


def test_clocks_a_little_apart_never_move_the_path_forwards() -> None:
    # rank 0's clock runs 0.3 ms behind: its send seems to start after the receive ended
    skewed = dict(PATTERN)
    skewed[0] = [("F", 0.0, 2.65, 0.0, 0.0), ("SF", 2.7, 2.9, 0.0, 0.0), *PATTERN[0][2:]]
    accounting = account(run_traces(pattern=skewed), PLAN, skip=1)
    assert sum(accounting.categories.values()) == pytest.approx(10.0)
    assert accounting.categories["delivery"] == 0.0  # the receive ended "before" the send
