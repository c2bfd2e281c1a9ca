"""Action tables of pipelines with tied parameters: literal tables, the version each copy uses,
and validation sweeps (pure code, no processes)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from pipedream.errors import ScheduleError
from pipedream.schedules import (
    Action,
    Op,
    PipelineSpec,
    build_tables,
    forward_versions,
    lookup,
    parse_action,
    validate_tables,
)
from pipedream.schedules.host_waits import host_stall
from pipedream.schedules.posting import Posting

TIED = {Op.SEND_TIED_GRAD, Op.RECV_TIED_GRAD, Op.SEND_WEIGHTS, Op.RECV_WEIGHTS}


def line(table: list[Action]) -> str:
    """The table without activation and gradient messages (ties and compute stay)."""
    hidden = (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD)
    return " ".join(str(a) for a in table if a.op not in hidden)


def test_pipedream_two_stages_tied_literal() -> None:
    spec = PipelineSpec("pipedream", ((0,), (1,)), 1, 4, tied=((0, 1),))
    tables = build_tables(spec)
    validate_tables(spec, tables)
    assert line(tables[0]) == (
        "0F0 0F1 0B0 0RG0 0U0 0SW1 0F2 0B1 0RG1 0U1 0SW2 0F3 0B2 0RG2 0U2 0SW3 0B3 0RG3 0U3 0SW4"
    )
    # the copy receives version v right before the first forward that uses it (stage 0 runs
    # minibatch t on version t - 1), and the last versions at the end
    assert line(tables[1]) == (
        "1F0 1B0 1SG0 1U0 1F1 1B1 1SG1 1U1 1RW1 1F2 1B2 1SG2 1U2 1RW2 1F3 1B3 1SG3 1U3 1RW3 1RW4"
    )
    assert {a.peer for a in tables[1] if a.op in (Op.SEND_TIED_GRAD, Op.RECV_WEIGHTS)} == {0}


def test_flush_three_stages_tied_literal() -> None:
    """1f1b with stage 0 owning a tensor that stage 2 holds a copy of (stage 1 holds none)."""
    spec = PipelineSpec("1f1b", ((0,), (1,), (2,)), 2, 2, tied=((0, 2),))
    tables = build_tables(spec)
    validate_tables(spec, tables)
    assert line(tables[0]) == "0F0 0F1 0B0 0B1 0RG0 0U0 0SW1 0F2 0F3 0B2 0B3 0RG1 0U1 0SW2"
    assert line(tables[1]) == "1F0 1F1 1B0 1B1 1U0 1F2 1F3 1B2 1B3 1U1"
    assert line(tables[2]) == "2F0 2B0 2F1 2B1 2SG0 2U0 2RW1 2F2 2B2 2F3 2B3 2SG1 2U1 2RW2"


def test_interleaved_tied_literal() -> None:
    """interleaved-1f1b, P = 2, v = 2: stage 0 (rank 0) owns what stage 3 (rank 1) copies. The
    copy closes, sends its gradient and updates its own weights while the owner still runs
    backwards; the owner's update makes the version the copy receives before its next forward."""
    spec = PipelineSpec("interleaved-1f1b", ((0,), (1,), (0,), (1,)), 2, 2, tied=((0, 3),))
    tables = build_tables(spec)
    validate_tables(spec, tables)
    assert line(tables[0]) == (
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 2U0 0RG0 0U0 0SW1 "
        "0F2 0F3 2F2 2F3 2B2 2B3 0B2 0B3 2U1 0RG1 0U1 0SW2"
    )
    assert line(tables[1]) == (
        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 3SG0 3U0 1U0 "
        "1F2 1F3 3RW1 3F2 3B2 3F3 3B3 1B2 1B3 3SG1 3U1 1U1 3RW2"
    )
    assert {(a.peer, a.peer_stage) for a in tables[1] if a.op in TIED} == {(0, 0)}


def test_zbv_tied_on_one_rank_literal() -> None:
    """zbv, P = 2: the first and the last stage are both on rank 0, so the copy's gradient and
    the owner's versions are handed over within the rank; the copy closes first, so its
    gradient is there when the owner's update needs it."""
    spec = PipelineSpec("zbv", ((0,), (1,), (1,), (0,)), 2, 2, tied=((0, 3),))
    tables = build_tables(spec)
    validate_tables(spec, tables)
    assert line(tables[0]) == (
        "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1 3SG0 3U0 0RG0 0U0 0SW1 "
        "0F2 0F3 3RW1 3F2 3I2 3W2 3F3 3I3 3W3 0I2 0W2 0I3 0W3 3SG1 3U1 0RG1 0U1 0SW2 3RW2"
    )
    assert {a.peer for a in tables[0] if a.op in TIED} == {0}
    assert not any(a.op in TIED for a in tables[1])


def test_copy_uses_the_owners_version_of_each_microbatch() -> None:
    """Before each forward of a copy's stage, the newest version received from the owner is
    the one the owner's forward of that microbatch uses."""
    placed = {  # several stages per rank: stages 0 and 1 own, the last stage copies
        "interleaved-1f1b": ((0,), (1,), (0,), (1,), (0,), (1,)),
        "zbv": ((0,), (1,), (2,), (2,), (1,), (0,)),
    }
    cases = [("pipedream", 1), ("pipedream-vs", 1), ("2bw", 4), ("1f1b", 3)]
    for schedule, m in [*cases, ("interleaved-1f1b", 4), ("zbv", 3)]:
        # (2bw deadlocks with a replicated stage after a single one, tied or not)
        ranks = ((0,), (1,), (2,)) if schedule == "2bw" else ((0,), (1, 2), (3,))
        ranks = placed.get(schedule, ranks)
        last = len(ranks) - 1
        spec = PipelineSpec(schedule, ranks, m, 12, tied=((0, last), (1, last)))
        tables = build_tables(spec)
        validate_tables(spec, tables)
        owner = {
            stage: {
                mb: v
                for replica in range(spec.replicas(stage))
                for mb, v in forward_versions(spec, stage, replica).items()
            }
            for stage in (0, 1)
        }
        newest = {0: 0, 1: 0}
        for action in tables[spec.stage_ranks[last][0]]:
            if action.op is Op.RECV_WEIGHTS:
                source = action.peer_stage
                assert source is not None and action.index == newest[source] + 1, action
                newest[source] = action.index
            elif action.op is Op.FORWARD and action.stage == last:
                assert newest == {s: owner[s][action.index] for s in (0, 1)}, (schedule, action)
        assert newest == {0: 12, 1: 12 // len(ranks[1])}  # the owners' final versions


def test_replicated_owner_and_copy_exchange_by_minibatch() -> None:
    """A copy's gradient of minibatch t goes to the owner's replica of t; the owner's replica j
    sends every version to the copy replicas k with k mod r_owner = j."""
    spec = PipelineSpec("1f1b", ((0, 1), (2,), (3, 4, 5, 6)), 1, 12, tied=((0, 2),))
    tables = build_tables(spec)
    validate_tables(spec, tables)
    for k in range(4):  # copy replica k runs minibatches k, k + 4, k + 8
        sends = [(a.index, a.peer) for a in tables[3 + k] if a.op is Op.SEND_TIED_GRAD]
        assert sends == [(t, t % 2) for t in range(k, 12, 4)]
        receives = [(a.index, a.peer) for a in tables[3 + k] if a.op is Op.RECV_WEIGHTS]
        assert receives == [(v, k % 2) for v in range(1, 7)]
    gradients = [(a.index, a.peer) for a in tables[0] if a.op is Op.RECV_TIED_GRAD]
    assert gradients == [(t, 3 + t % 4) for t in range(0, 12, 2)]
    weights = [(a.index, a.peer) for a in tables[1] if a.op is Op.SEND_WEIGHTS]
    assert weights == [(v, peer) for v in range(1, 7) for peer in (4, 6)]


SCHEDULES = [("pipedream", 1), ("pipedream-vs", 1), ("2bw", 4), ("1f1b", 3), ("gpipe", 2)]
REPLICAS = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 1, 1, 1), (2, 1, 1), (3, 1, 2), (1, 2, 1, 2)]


def _valid(spec: PipelineSpec) -> bool:
    try:
        validate_tables(spec, build_tables(spec))
    except ScheduleError:
        return False
    return True


@pytest.mark.parametrize(("schedule", "m"), SCHEDULES)
def test_ties_never_make_tables_invalid(schedule: str, m: int) -> None:
    """Every tie pattern (first and last stage; the first with every other; a middle owner) on
    straight and replicated pipelines, from the start and resumed, is valid wherever the same
    pipeline without ties is (2bw with a replicated stage after a single one deadlocks with or
    without them)."""
    for replicas in REPLICAS:
        stage_ranks, rank = [], 0
        for count in replicas:
            stage_ranks.append(tuple(range(rank, rank + count)))
            rank += count
        last = len(replicas) - 1
        patterns = [((0, last),), tuple((0, c) for c in range(1, last + 1))]
        if last >= 2:
            patterns.append(((1, last),))
        minibatches = 2 * len(replicas) * 6  # a multiple of every replica count
        for tied, first in itertools.product(patterns, (0, minibatches)):
            spec = PipelineSpec(
                schedule,
                tuple(stage_ranks),
                max(m, len(replicas)) if schedule == "2bw" else m,
                minibatches,
                first_minibatch=first,
            )
            if _valid(spec):
                validate_tables(replace(spec, tied=tied), build_tables(replace(spec, tied=tied)))


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_ties_are_valid_with_several_stages_per_rank(schedule: str) -> None:
    """Every tie pattern (first and last stage, which zbv puts on one rank; the first with
    every other; a middle owner; chains of owners) on 2 and 3 ranks, in one and two copies of
    the pipeline, from the start and resumed: the tables pass every check, the dependency
    simulation included, and run with the default posting on gloo and under NCCL's discipline
    (messages between two ranks in the order sent)."""
    for ranks, copies in itertools.product((2, 3), (1, 2)):
        stages = 2 * ranks
        placement = lookup(schedule).placement
        assert placement is not None
        flat = placement(stages, ranks)
        stage_ranks = tuple(tuple(r + j * ranks for j in range(copies)) for r in flat)
        last = stages - 1
        patterns = [
            ((0, last),),
            tuple((0, c) for c in range(1, stages)),
            ((1, last),),
            ((0, 2), (1, last), (2, last)),
        ]
        m = ranks * 2
        for tied, first in itertools.product(patterns, (0, 4 * copies)):
            spec = PipelineSpec(schedule, stage_ranks, m, 3 * copies, first, tied=tied)
            tables = build_tables(spec)
            validate_tables(spec, tables)
            for in_order in (False, True):
                assert host_stall(tables, Posting(), in_order=in_order) is None, (spec, in_order)


def test_tied_pairs_are_checked() -> None:
    for bad in (((1, 0),), ((0, 0),), ((0, 2),)):
        spec = PipelineSpec("1f1b", ((0,), (1,)), 1, 2, tied=bad)
        with pytest.raises(ScheduleError, match="owner stage before a copy stage"):
            build_tables(spec)


def test_tied_actions_round_trip() -> None:
    for text in ("3SG0", "0RG7", "0SW1", "3RW12"):
        assert str(parse_action(text)) == text
    assert parse_action("0SW1").op.is_send and parse_action("3RW1").op.is_receive
