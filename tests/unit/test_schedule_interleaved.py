"""Interleaved 1F1B: several stages per rank, literal tables, validity, and its bubble.

Also the table machinery such schedules need: messages told apart by the stages at both ends
(two stage pairs share a pair of ranks), and backwards split into an input-gradient half (I)
and a weight-gradient half (W), checked by the validator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from pipedream.errors import ScheduleError
from pipedream.schedules import (
    Action,
    Op,
    PipelineSpec,
    build_tables,
    lookup,
    parse_action,
    validate_tables,
)
from pipedream.schedules.unit_time import unit_time_makespan


def looped(ranks: int, chunks: int, microbatches: int, minibatches: int = 1) -> PipelineSpec:
    stage_ranks = tuple((s % ranks,) for s in range(ranks * chunks))
    return PipelineSpec("interleaved-1f1b", stage_ranks, microbatches, minibatches)


def compute(table: Sequence[Action]) -> str:
    return " ".join(str(a) for a in table if not a.op.is_comm)


def test_two_ranks_two_chunks_literal() -> None:
    tables = build_tables(looped(2, 2, 4, minibatches=2))
    assert compute(tables[0]).split(" 0U0 2U0 ")[0] == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    )
    assert compute(tables[1]).split(" 1U0 3U0 ")[0] == (
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )
    # the second minibatch repeats the pattern on microbatches 4..7, after both updates
    second = compute(tables[0]).split(" 0U0 2U0 ")[1]
    assert second.startswith("0F4 0F5 2F4 2F5 0F6 2B4") and second.endswith("0B7 0U1 2U1")
    # stage 0 sends stage 1's input and stage 2 receives stage 1's output: rank 0 <-> rank 1
    sends = [a for a in tables[0] if a.op is Op.SEND_ACT and a.index == 0]
    assert [(a.stage, a.peer, a.peer_stage) for a in sends] == [(0, 1, 1), (2, 1, 3)]


def test_versions_are_the_minibatch_count() -> None:
    """Synchronous: every forward and backward of minibatch k uses version k at its stage."""
    tables = build_tables(looped(2, 3, 4, minibatches=3))
    for table in tables.values():
        for action in table:
            if action.op in (Op.FORWARD, Op.BACKWARD):
                assert action.version == action.index // 4, action


@pytest.mark.parametrize("ranks", range(1, 9))
def test_valid_for_up_to_16_stages_and_64_microbatches(ranks: int) -> None:
    multiples = range(ranks, 65, ranks)
    for chunks in range(2, 16 // ranks + 1):
        # the smallest groups, a middle one and the largest (the rest behave alike)
        for microbatches in sorted({*multiples[:3], multiples[len(multiples) // 2], multiples[-1]}):
            for minibatches in (1, 2):
                spec = looped(ranks, chunks, microbatches, minibatches)
                validate_tables(spec, build_tables(spec))


@pytest.mark.parametrize(("ranks", "chunks", "microbatches"), [(2, 2, 4), (4, 2, 8), (4, 4, 8)])
def test_bubble_is_the_papers(ranks: int, chunks: int, microbatches: int) -> None:
    """With F = 1 and B = 2 per stage, a minibatch takes (v m + P - 1)(F + B): the bubble is
    (P - 1) / (v m) of the compute, v times less than 1F1B's (P - 1) / m."""
    cost = {Op.FORWARD: 1.0, Op.BACKWARD: 2.0}.__getitem__
    span = unit_time_makespan(build_tables(looped(ranks, chunks, microbatches)), cost)
    assert span == (chunks * microbatches + ranks - 1) * 3
    flat = PipelineSpec("1f1b", tuple((r,) for r in range(ranks)), microbatches, 1)
    # the same model in P stages: each does v chunks' work per pass
    one_f_one_b = unit_time_makespan(build_tables(flat), lambda op: cost(op) * chunks)
    assert one_f_one_b == (microbatches + ranks - 1) * 3 * chunks


def test_messages_between_two_ranks_are_told_apart_by_stage() -> None:
    """Ranks 0 and 1 exchange stage 0 -> 1 and stage 2 -> 3 activations of each microbatch:
    a receive that names the wrong sending stage does not match."""
    spec = looped(2, 2, 2)
    tables = build_tables(spec)
    position = next(
        i for i, a in enumerate(tables[1]) if a.op is Op.RECV_ACT and a.stage == 3 and a.index == 0
    )
    tables[1][position] = dataclasses.replace(tables[1][position], peer_stage=0)
    with pytest.raises(ScheduleError, match="sends and receives do not match"):
        validate_tables(spec, tables)


def test_bad_shapes_say_what_to_use() -> None:
    with pytest.raises(ScheduleError, match="at least 2 stages per rank"):
        looped(2, 1, 2).validate()
    with pytest.raises(ScheduleError, match="multiple of 2"):
        looped(2, 2, 3).validate()
    with pytest.raises(ScheduleError, match=r"as \[0, 1, 0, 1\]; got \[0, 1, 1, 0\]"):
        PipelineSpec("interleaved-1f1b", ((0,), (1,), (1,), (0,)), 2, 1).validate()
    with pytest.raises(ScheduleError, match=r"same number of replicas; got \[2, 1, 2, 1\]"):
        PipelineSpec("interleaved-1f1b", ((0, 2), (1,), (0, 2), (1,)), 2, 2).validate()
    wrong_copy = r"copy 1 of the pipeline \(ranks \[2, 3, 3, 2\]\): .* got \[0, 1, 1, 0\]"
    with pytest.raises(ScheduleError, match=wrong_copy):
        PipelineSpec("interleaved-1f1b", ((0, 2), (1, 3), (0, 3), (1, 2)), 2, 2).validate()
    with pytest.raises(ScheduleError, match="share no rank"):
        PipelineSpec("interleaved-1f1b", ((0, 1), (1, 0), (0, 1), (1, 0)), 2, 2).validate()
    # two copies of the pipeline, on ranks 0, 1 and 2, 3
    PipelineSpec("interleaved-1f1b", ((0, 2), (1, 3), (0, 2), (1, 3)), 2, 2).validate()
    with pytest.raises(ScheduleError, match="each once"):  # one-stage schedules keep the rule
        PipelineSpec("1f1b", ((0,), (1,), (0,), (1,)), 2, 1).validate()


def test_interleaving_runs_several_stages_per_rank() -> None:
    assert lookup("interleaved-1f1b").several_stages_per_rank
    assert not lookup("1f1b").several_stages_per_rank


def _split(table: list[Action], index: int) -> list[Action]:
    """``table`` with the backward of ``index`` as an I right away and a W at the end."""
    out: list[Action] = []
    for action in table:
        if action.op is Op.BACKWARD and action.index == index:
            out.append(dataclasses.replace(action, op=Op.BACKWARD_INPUT))
        else:
            out.append(action)
    weight = next(a for a in table if a.op is Op.BACKWARD and a.index == index)
    update = next(i for i, a in enumerate(out) if a.op is Op.UPDATE)
    out.insert(update, dataclasses.replace(weight, op=Op.BACKWARD_WEIGHT))
    return out


def test_a_backward_may_be_split_into_input_and_weight_halves() -> None:
    spec = PipelineSpec("1f1b", ((0,), (1,)), 2, 1)
    tables = build_tables(spec)
    tables = {rank: _split(table, 0) for rank, table in tables.items()}
    validate_tables(spec, tables)
    assert compute(tables[1]) == "1F0 1I0 1F1 1B1 1W0 1U0"
    assert str(parse_action("1I0")) == "1I0" and str(parse_action("1W0")) == "1W0"


def test_split_backwards_are_checked() -> None:
    spec = PipelineSpec("1f1b", ((0,), (1,)), 2, 1)
    tables = {rank: _split(table, 0) for rank, table in build_tables(spec).items()}
    no_weight = {**tables, 1: [a for a in tables[1] if a.op is not Op.BACKWARD_WEIGHT]}
    with pytest.raises(ScheduleError, match="never runs the weight gradient of microbatches"):
        validate_tables(spec, no_weight)
    early = [a for a in tables[1] if a.op is not Op.BACKWARD_WEIGHT]
    after_forward = next(i for i, a in enumerate(early) if a.op is Op.FORWARD) + 1
    early.insert(after_forward, next(a for a in tables[1] if a.op is Op.BACKWARD_WEIGHT))
    with pytest.raises(ScheduleError, match="weight gradient of 0 before its input gradient"):
        validate_tables(spec, {**tables, 1: early})
    both = [*tables[1]]
    both.insert(-1, dataclasses.replace(both[-2], op=Op.BACKWARD))
    with pytest.raises(ScheduleError, match="both whole and in halves"):
        validate_tables(spec, {**tables, 1: both})


def test_a_plan_may_put_at_most_16_stages_on_a_rank() -> None:
    """The runtime gives every pair of stages between two ranks a lane of message tags of its
    own, room for 16 stages per rank: a plan with more is refused before anything starts."""
    from pipedream.formats.plan import Plan
    from pipedream.schedules import MAX_STAGES_PER_RANK, validate_plan_schedule

    def plan(chunks: int) -> Plan:
        return Plan.from_dict(
            {
                "format": "pipedream/plan@1",
                "workload": "mlp",
                "workload_args": {},
                "schedule": "interleaved-1f1b",
                "microbatch_size": 4,
                "microbatches": 2,
                "world_size": 2,
                "stages": [
                    {"first_layer": f"l{s}", "last_layer": f"l{s}", "replicas": 1, "ranks": [s % 2]}
                    for s in range(2 * chunks)
                ],
            }
        )

    assert MAX_STAGES_PER_RANK == 16
    validate_plan_schedule(plan(16), [1], source="plan.yaml")
    with pytest.raises(ScheduleError) as error:
        validate_plan_schedule(plan(17), [1], source="plan.yaml")
    assert str(error.value) == (
        "plan.yaml: rank 0 runs 17 stages; the runtime takes at most 16 per rank (fewer, "
        "larger stages)"
    )
