"""Weight versions held per schedule (bounded, copies only where an update intervenes), and the
reference executor's numerics, in one process."""

from __future__ import annotations

import pytest

from reference_run import reference_weights

ARGS = {"layers": "3", "width": "8", "lr": "0.1"}
FOUR = [["0"], ["1"], ["2"], ["3"]]


def _held(schedule: str, m: int, replicas: list[int] | None = None, stages=FOUR):
    _, workers = reference_weights(
        stages,
        replicas or [1] * len(stages),
        schedule=schedule,
        microbatches=m,
        steps=8,
        workload_args=ARGS,
    )
    return [
        (w.versions.max_versions, w.versions.max_copies, w.max_in_flight)
        for _, w in sorted(workers.items())
    ]


def test_pipedream_holds_one_version_per_minibatch_in_flight() -> None:
    # stage s has S - s minibatches in flight; the last stage needs no copy at all
    assert _held("pipedream", 1) == [(4, 4, 4), (3, 3, 3), (2, 2, 2), (1, 0, 1)]


def test_vertical_sync_holds_the_versions_stage_0_used() -> None:
    assert _held("pipedream-vs", 1) == [(4, 4, 4), (4, 4, 3), (4, 4, 2), (4, 4, 1)]


def test_2bw_holds_at_most_two_versions() -> None:
    held = _held("2bw", 4)
    assert all(versions <= 2 for versions, _, _ in held)
    assert [copies for _, copies, _ in held] == [2, 2, 2, 2]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_flushing_schedules_hold_one_version_and_copy_nothing(schedule: str) -> None:
    held = _held(schedule, 3)
    assert [(v, c) for v, c, _ in held] == [(1, 0)] * 4
    in_flight = [f for _, _, f in held]
    assert in_flight == ([3, 3, 2, 1] if schedule == "1f1b" else [3, 3, 3, 3])
