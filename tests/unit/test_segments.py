"""The stretches of a run between checkpoints (runtime/segments.py) and how long they may be."""

from __future__ import annotations

import doctest
import itertools

import pytest

from pipedream.formats.plan import Plan, StagePlan
from pipedream.runtime import segments as segments_module
from pipedream.runtime.segments import Segments
from pipedream.schedules import actions_per_minibatch, build_tables, spec_from_plan


def _listed(steps: int, every: int, start: int) -> list[tuple[int, int]]:
    """What the runtime built before: every boundary listed."""
    bounds = sorted({*range(every, steps, every)} if every > 0 else set()) + [steps]
    out, current = [], start
    for bound in bounds:
        if bound > current:
            out.append((current, bound - current))
            current = bound
    return out


def test_doctests() -> None:
    failed, attempted = doctest.testmod(segments_module)
    assert (failed, attempted) == (0, 3)


def test_the_segments_are_those_the_listed_boundaries_give() -> None:
    for steps, every, start in itertools.product(range(13), range(6), range(13)):
        if start > steps:
            continue
        listed = _listed(steps, every, start)
        stretches = Segments(start=start, steps=steps, every=every)
        assert list(stretches) == listed
        assert len(stretches) == len(listed)
        assert [stretches[i] for i in range(-len(listed), 0)] == listed
        assert stretches[1:] == listed[1:]
        assert stretches.counts == {count for _, count in listed}
        firsts: dict[int, tuple[int, int]] = {}
        for first, count in listed:
            firsts.setdefault(count, (first, count))
        assert stretches.representatives() == list(firsts.values())


def test_a_segment_past_the_end_is_an_index_error() -> None:
    with pytest.raises(IndexError):
        Segments(start=0, steps=8, every=4)[2]


def test_a_trillion_checkpoints_cost_nothing_until_run() -> None:
    """--steps 10^8 --checkpoint-every 1 built a set and a list of 10^8 entries before."""
    stretches = Segments(start=5, steps=10**12, every=1)
    assert (len(stretches), stretches[-1], stretches.counts) == (10**12 - 5, (10**12 - 1, 1), {1})


def _plan(schedule: str, replicas: list[int], microbatches: int) -> Plan:
    stages, rank = [], 0
    for s, r in enumerate(replicas):
        stages.append(StagePlan(f"l{s}", f"l{s}", r, tuple(range(rank, rank + r))))
        rank += r
    return Plan("toy", schedule, 1, microbatches, rank, tuple(stages))


@pytest.mark.parametrize(
    ("schedule", "replicas", "microbatches", "per_minibatch"),
    [
        ("pipedream", [2, 1, 1], 1, 7),
        ("1f1b", [1, 1, 1, 1], 8, 49),
        ("2bw", [1, 1, 1], 4, 25),
        ("zb-h1", [1, 1, 1, 1], 8, 57),
        ("gpipe", [1, 1], 4, 17),
    ],
)
def test_a_table_grows_by_the_same_actions_with_every_minibatch(
    schedule: str, replicas: list[int], microbatches: int, per_minibatch: int
) -> None:
    """What the cap on a stretch's length relies on: no action is paid once per table."""
    plan = _plan(schedule, replicas, microbatches)
    assert actions_per_minibatch(plan) == per_minibatch
    multiple = plan.steps_multiple
    for count in (multiple, 3 * multiple, 8 * multiple):
        tables = build_tables(spec_from_plan(plan, 5 * multiple, count))
        assert max(len(table) for table in tables.values()) == per_minibatch * count
