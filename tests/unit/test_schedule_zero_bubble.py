"""Zero-bubble schedules (zb-h1, zbv): literal tables, validity, bubble and memory in unit time."""

from __future__ import annotations

import pytest

from pipedream.errors import ScheduleError
from pipedream.schedules import Op, PipelineSpec, build_tables, lookup, validate_tables
from pipedream.schedules.unit_time import peak_in_flight, unit_time_makespan
from pipedream.schedules.zero_bubble import v_placement

COST = {Op.FORWARD: 1.0, Op.BACKWARD_INPUT: 1.0, Op.BACKWARD_WEIGHT: 1.0, Op.BACKWARD: 2.0}


def straight(schedule: str, stages: int, microbatches: int, minibatches: int = 1) -> PipelineSpec:
    return PipelineSpec(schedule, tuple((s,) for s in range(stages)), microbatches, minibatches)


def vee(ranks: int, microbatches: int, minibatches: int = 1) -> PipelineSpec:
    stage_ranks = tuple((r,) for r in v_placement(2 * ranks, ranks))
    return PipelineSpec("zbv", stage_ranks, microbatches, minibatches)


def compute(table) -> str:
    return " ".join(str(a) for a in table if not a.op.is_comm)


def test_zb_h1_literal() -> None:
    tables = build_tables(straight("zb-h1", 3, 6))
    assert compute(tables[0]) == (
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0F4 0I2 0W2 0F5 0I3 0W3 0I4 0W4 0I5 0W5 0U0"
    )
    assert compute(tables[2]) == (
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2F4 2I4 2W2 2F5 2I5 2W3 2W4 2W5 2U0"
    )
    # the input gradient goes back right after I; W sends nothing
    after_input = tables[1][[str(a) for a in tables[1]].index("1I0") + 1]
    assert (after_input.op, after_input.peer, after_input.peer_stage) == (Op.SEND_GRAD, 0, 0)


def test_zbv_literal() -> None:
    """P = 2: stages 0 and 3 on rank 0, 1 and 2 on rank 1; stage 1 hands stage 2 its
    activations within rank 1, and stage 3 (the loss) is on rank 0."""
    tables = build_tables(vee(2, 2))
    assert compute(tables[0]) == "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1 0U0 3U0"
    assert compute(tables[1]) == "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1 1U0 2U0"
    local = [a for a in tables[1] if a.op is Op.SEND_ACT and a.stage == 1]
    assert {(a.peer, a.peer_stage) for a in local} == {(1, 2)}


@pytest.mark.parametrize("stages", range(1, 17))
def test_zb_h1_valid_up_to_16_stages_and_64_microbatches(stages: int) -> None:
    for microbatches in (1, 2, stages, 2 * stages + 1, 64):
        for minibatches in (1, 2):
            spec = straight("zb-h1", stages, microbatches, minibatches)
            validate_tables(spec, build_tables(spec))


@pytest.mark.parametrize("ranks", range(1, 9))
def test_zbv_valid_up_to_16_stages_and_64_microbatches(ranks: int) -> None:
    for microbatches in (1, 2, ranks, 2 * ranks + 1, 64):
        for minibatches in (1, 2):
            spec = vee(ranks, microbatches, minibatches)
            validate_tables(spec, build_tables(spec))


@pytest.mark.parametrize(("stages", "bubbles"), [(2, [1, 1, 1]), (4, [3, 3, 3]), (8, [7, 7, 7])])
def test_zb_h1_bubble_is_about_a_third_of_1f1b(stages: int, bubbles: list[int]) -> None:
    """F = I = W = 1: 1F1B idles 3 (S - 1) units a minibatch, zb-h1 S - 1, the paper's
    (S - 1)(F + I - W); no rank holds more activations than 1F1B's first stage."""
    got = []
    for m in (stages, 2 * stages, 4 * stages):
        tables = build_tables(straight("zb-h1", stages, m))
        got.append(unit_time_makespan(tables, COST.__getitem__) - 3 * m)
        one_f_one_b = build_tables(straight("1f1b", stages, m))
        assert unit_time_makespan(one_f_one_b, COST.__getitem__) - 3 * m == 3 * (stages - 1)
        assert max(peak_in_flight(t) for t in tables.values()) == stages
        assert max(peak_in_flight(t) for t in one_f_one_b.values()) == stages
    assert got == bubbles


@pytest.mark.parametrize(("ranks", "bubbles"), [(2, [2, 1, 1]), (4, [6, 3, 3]), (8, [14, 7, 7])])
def test_zbv_bubble_against_1f1b(ranks: int, bubbles: list[int]) -> None:
    """2 P stages of unit times: 6 m units per rank; 1F1B over the same model in P stages (each
    twice the work) idles 6 (P - 1); zbv P - 1 once m >= 2 P (2 (P - 1) at m = P), holding at
    most 2 P stage-microbatches (1F1B's first rank holds P microbatches of twice the layers)."""
    got = []
    for m in (ranks, 2 * ranks, 4 * ranks):
        tables = build_tables(vee(ranks, m))
        got.append(unit_time_makespan(tables, COST.__getitem__) - 6 * m)
        assert max(peak_in_flight(t) for t in tables.values()) <= 2 * ranks
        one_f_one_b = build_tables(straight("1f1b", ranks, m))
        twice = unit_time_makespan(one_f_one_b, lambda op: 2 * COST[op])
        assert twice - 6 * m == 6 * (ranks - 1)
    assert got == bubbles


def test_bad_shapes_and_what_runs_today() -> None:
    with pytest.raises(ScheduleError, match="needs 2 stages per rank"):
        PipelineSpec("zbv", ((0,), (1,), (0,)), 2, 1).validate()
    with pytest.raises(ScheduleError, match=r"as \[0, 1, 1, 0\]; got \[0, 1, 0, 1\]"):
        PipelineSpec("zbv", ((0,), (1,), (0,), (1,)), 2, 1).validate()
    with pytest.raises(ScheduleError, match="same number of replicas"):
        PipelineSpec("zbv", ((0, 1), (2,), (2,), (0, 1)), 2, 2).validate()
    with pytest.raises(ScheduleError, match=r"as \[0, 1, 1, 0\]; got \[0, 1, 0, 1\]"):
        PipelineSpec("zbv", ((0, 2), (1, 3), (0, 2), (1, 3)), 2, 2).validate()
    PipelineSpec("zbv", ((0, 2), (1, 3), (1, 3), (0, 2)), 2, 2).validate()  # two Vs
    PipelineSpec("zb-h1", ((0, 1), (2,)), 2, 2).validate()  # replicas as 1f1b's
    assert lookup("zbv").several_stages_per_rank and not lookup("zb-h1").several_stages_per_rank


class _NoUnion(set):  # type: ignore[type-arg]
    def __or__(self, other: object) -> set:  # type: ignore[type-arg, override]
        raise AssertionError("a union copies the microbatches done at every action")


def test_checking_an_action_does_not_copy_what_is_done() -> None:
    """The order check built the union of the split backwards' sets at every action, so
    validating m microbatches took O(m^2): zb-h1 with m = 4096 on 4 ranks took 358 s in
    ``launch.sh``'s check, now about 5 s."""
    from pipedream.schedules.actions import Action
    from pipedream.schedules.validate import _out_of_order

    done = {op: _NoUnion() for op in Op}
    done[Op.FORWARD].update({0, 1})
    done[Op.BACKWARD_INPUT].add(0)
    assert _out_of_order(Action(Op.BACKWARD, 0, 1), done) == ""
    assert (
        _out_of_order(Action(Op.BACKWARD, 0, 0), done) == "backward of 0 both whole and in halves"
    )
