"""Action tables: literal expectations and validation sweeps (pure code, no processes)."""

from __future__ import annotations

import itertools
import math

import pytest

from pipedream.errors import ScheduleError
from pipedream.schedules import (
    Action,
    Op,
    PipelineSpec,
    build_tables,
    format_grid,
    parse_action,
    validate_tables,
    warmup_depth,
)


def straight(schedule: str, num_stages: int, minibatches: int, microbatches: int = 1):
    return PipelineSpec(schedule, tuple((s,) for s in range(num_stages)), microbatches, minibatches)


def compute(table: list[Action]) -> str:
    return " ".join(str(a) for a in table if not a.op.is_comm)


def test_pipedream_three_stages_literal() -> None:
    tables = build_tables(straight("pipedream", 3, 4))
    assert compute(tables[0]) == "0F0 0F1 0F2 0B0 0U0 0F3 0B1 0U1 0B2 0U2 0B3 0U3"
    assert compute(tables[1]) == "1F0 1F1 1B0 1U0 1F2 1B1 1U1 1F3 1B2 1U2 1B3 1U3"
    assert compute(tables[2]) == "2F0 2B0 2U0 2F1 2B1 2U1 2F2 2B2 2U2 2F3 2B3 2U3"
    # communication sits right around the compute that needs or produces it
    assert [str(a) for a in tables[1][:6]] == ["1RF0", "1F0", "1SF0", "1RF1", "1F1", "1SF1"]
    assert [a.peer for a in tables[1][:3]] == [0, None, 2]


def test_pipedream_versions_follow_the_paper() -> None:
    """F and B of minibatch t at stage s use version max(0, t - (S - 1 - s))."""
    S, K = 4, 12
    tables = build_tables(straight("pipedream", S, K))
    for s in range(S):
        for action in tables[s]:
            if action.op in (Op.FORWARD, Op.BACKWARD):
                assert action.version == max(0, action.index - (S - 1 - s)), action


def test_warmup_depths_literal() -> None:
    assert [warmup_depth(straight("pipedream", 4, 4), s) for s in range(4)] == [3, 2, 1, 0]
    # PipeDream's rule for replicated stages: (world - 1 - replicas before) // replicas
    spec = PipelineSpec("pipedream", ((0, 1), (2,), (3,)), 1, 4)
    assert [warmup_depth(spec, s) for s in range(3)] == [1, 1, 0]
    spec = PipelineSpec("pipedream", ((0,), (1, 2)), 1, 4)
    assert [warmup_depth(spec, s) for s in range(2)] == [2, 0]
    spec = PipelineSpec("pipedream", ((0, 1, 2),), 1, 3)
    assert [warmup_depth(spec, 0)] == [0]


def test_warmup_forwards_counted_in_tables() -> None:
    """Each stage runs exactly w_s forwards before its first backward."""
    for S in range(1, 9):
        tables = build_tables(straight("pipedream", S, 3 * S))
        for s in range(S):
            ops = [a.op for a in tables[s] if a.op.is_compute]
            assert ops.index(Op.BACKWARD) == S - s  # w_s warm-up forwards + 1 steady forward


@pytest.mark.parametrize("num_stages", range(1, 17))
def test_pipedream_tables_valid_for_all_sizes(num_stages: int) -> None:
    for minibatches in range(1, 65):
        spec = straight("pipedream", num_stages, minibatches)
        tables = build_tables(spec)
        validate_tables(spec, tables)
        for s, table in tables.items():
            forwards = [a.index for a in table if a.op is Op.FORWARD]
            backwards = [a.index for a in table if a.op is Op.BACKWARD]
            updates = [a.index for a in table if a.op is Op.UPDATE]
            assert sorted(forwards) == sorted(backwards) == list(range(minibatches)), s
            assert updates == list(range(minibatches))


@pytest.mark.parametrize(
    ("schedule", "microbatches"),
    [("pipedream-vs", 1), ("2bw", 4), ("1f1b", 1), ("1f1b", 5), ("gpipe", 3)],
)
def test_other_schedules_valid(schedule: str, microbatches: int) -> None:
    for S, K in itertools.product(range(1, 5), (1, 2, 5)):
        spec = straight(schedule, S, K, max(microbatches, S) if schedule == "2bw" else microbatches)
        validate_tables(spec, build_tables(spec))


@pytest.mark.parametrize("shape", [(2, 1), (1, 2), (3, 1), (2, 1, 1), (1, 3), (2, 2), (4,)])
@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "gpipe"])
def test_replicated_tables_valid(shape: tuple[int, ...], schedule: str) -> None:
    ranks, first = [], 0
    for count in shape:
        ranks.append(tuple(range(first, first + count)))
        first += count
    for multiple in (1, 2, 3):
        K = 12 * multiple
        spec = PipelineSpec(schedule, tuple(ranks), 1 if schedule == "pipedream" else 3, K)
        validate_tables(spec, build_tables(spec))


@pytest.mark.parametrize(
    ("schedule", "m"),
    [("pipedream", 1), ("pipedream-vs", 1), ("2bw", 3), ("1f1b", 2), ("gpipe", 2), ("zb-h1", 2)],
)
def test_replicated_tables_valid_from_any_minibatch(schedule: str, m: int) -> None:
    """A run resumed from a checkpoint another plan wrote starts where that plan stopped, which
    need not be a multiple of this plan's replicas (step 3 of a straight pipeline, resumed with
    a stage of 2): each replica's minibatches were counted from there, the message routes from
    minibatch 0, and the ranks waited for each other forever."""
    for shape in ((2, 1), (1, 2), (2, 1, 3)):
        ranks, rank = [], 0
        for count in shape:
            ranks.append(tuple(range(rank, rank + count)))
            rank += count
        multiple = math.lcm(*shape)
        for first in range(2 * multiple):
            spec = PipelineSpec(schedule, tuple(ranks), m, 2 * multiple, first_minibatch=first)
            validate_tables(spec, build_tables(spec))


def test_vertical_sync_never_runs_ahead_of_stage_zero_when_resumed_off_a_round() -> None:
    """Under pipedream-vs a stage's version covers no minibatch that stage 0's version of the
    same minibatch leaves out, also where the run resumed in the middle of a round of its
    replicas (step 3, rounds of 2: ``(3 + 1) // 2`` named the version of minibatches 3 and 4
    for a forward stage 0 ran on the version of minibatch 3 alone)."""
    for first in range(4):
        spec = PipelineSpec("pipedream-vs", ((0,), (1, 2)), 1, 8, first_minibatch=first)
        tables = build_tables(spec)
        covered = {a.index: a.version for a in tables[0] if a.op is Op.FORWARD}
        for rank in (1, 2):
            for action in tables[rank]:
                if action.op is Op.FORWARD:
                    assert action.version is not None
                    rounds = action.version - first // 2
                    assert rounds * 2 <= covered[action.index] - first, (first, action)


def test_2bw_replicated_tables_run() -> None:
    """With a replicated stage every stage drains each minibatch: carried over, a warm-up
    waited for forwards that a replica starts only after an allreduce waiting for it (315 of
    these 756 tables deadlocked before). Every layout of up to 4 stages on up to 8 ranks."""
    shapes = [
        shape
        for count in range(1, 5)
        for shape in itertools.product((1, 2, 3), repeat=count)
        if sum(shape) <= 8 and max(shape) > 1
    ]
    checked = 0
    for shape in shapes:
        ranks, first = [], 0
        for count in shape:
            ranks.append(tuple(range(first, first + count)))
            first += count
        multiple = math.lcm(*shape)
        for m in sorted({len(shape), len(shape) + 1, 8}):
            for steps in (multiple, 2 * multiple, 4 * multiple):
                spec = PipelineSpec("2bw", tuple(ranks), m, steps)
                validate_tables(spec, build_tables(spec))
                checked += 1
    assert checked == 756


def test_action_string_round_trip() -> None:
    for text in ("1F3", "0B12", "2U0", "1RF3", "1SB4", "3A7"):
        assert str(parse_action(text)) == text


def test_action_described_in_words_for_every_op() -> None:
    assert Action(Op.FORWARD, 1, 3).describe() == "forward of microbatch 3 at stage 1"
    assert (
        Action(Op.RECV_GRAD, 0, 4, peer=2, peer_stage=1).describe()
        == "receive of the gradient of microbatch 4 at stage 0 (from rank 2)"
    )
    assert (
        Action(Op.SEND_WEIGHTS, 0, 1, peer=3, peer_stage=3).describe()
        == "send of the tied tensors' version 1 at stage 0 (to rank 3)"
    )
    for op in Op:  # every op has its words
        assert Action(op, 0, 0).describe().endswith(" 0 at stage 0")


def test_deadlock_is_reported_with_grid() -> None:
    spec = straight("pipedream", 2, 2)
    tables = build_tables(spec)
    # swap stage 1's first receive behind its first backward's send: an impossible order
    tables[0] = [a for a in tables[0] if a.op is not Op.SEND_ACT] + [
        a for a in tables[0] if a.op is Op.SEND_ACT
    ]
    with pytest.raises(ScheduleError) as info:
        validate_tables(spec, tables)
    message = str(info.value)
    assert "deadlocks" in message and "!" in message and "rank |" in message


def test_missing_backward_is_reported() -> None:
    spec = straight("1f1b", 2, 1, 2)
    tables = build_tables(spec)
    tables[1] = [a for a in tables[1] if not (a.op is Op.BACKWARD and a.index == 1)]
    with pytest.raises(ScheduleError, match="backward of each microbatch"):
        validate_tables(spec, tables)


def test_bad_specs_raise() -> None:
    with pytest.raises(ScheduleError, match="one microbatch"):
        straight("pipedream", 2, 2, microbatches=2).validate()
    with pytest.raises(ScheduleError, match="microbatches >= stages"):
        straight("2bw", 3, 2, microbatches=2).validate()
    with pytest.raises(ScheduleError, match="multiple of 2"):
        PipelineSpec("pipedream", ((0, 1),), 1, 3).validate()
    with pytest.raises(ScheduleError, match="unknown schedule"):
        straight("zigzag", 2, 2).validate()
    with pytest.raises(ScheduleError, match="microbatches must be 1 to 16384, got 16385"):
        straight("1f1b", 2, 1, microbatches=16385).validate()
    straight("1f1b", 2, 1, microbatches=16384).validate()


def test_grid_format() -> None:
    grid = format_grid(build_tables(straight("gpipe", 2, 1, 2)))
    assert grid.splitlines() == [
        "rank | 0   1   2   3   4",
        "   0 | 0F0 0F1 0B0 0B1 0U0",
        "   1 | 1F0 1F1 1B0 1B1 1U0",
    ]
