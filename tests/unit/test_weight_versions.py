"""Weight versions held per schedule (bounded, copies only where an update intervenes), and the
reference executor's numerics, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedream.runtime.weight_versions import WeightVersions
from pipedream.schedules import PipelineSpec, build_tables

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


def test_released_copies_are_reused_with_the_live_values() -> None:
    # stage 0 of a 2-stage PipeDream pipeline holds 2 versions: one copy at a time
    spec = PipelineSpec("pipedream", ((0,), (1,)), microbatches=1, num_minibatches=6)
    table = build_tables(spec, only_ranks={0})[0]
    layer = nn.Linear(3, 2)
    versions = WeightVersions(layer, table, initial_version=0)
    storages = []
    for position, action in enumerate(table):
        if action.op.value != "U":
            continue
        versions.release_before(position)
        with torch.no_grad():
            for param in layer.parameters():
                param.add_(1.0)  # the "optimizer step"
        versions.updated()
        copies = [versions._versions[v]["weight"].data_ptr() for v in versions._copied]
        assert len(set(copies)) == len(copies)  # no two held versions share memory
        held = versions._versions.get(versions.live_version)
        if held is not None and versions.live_version in versions._copied:
            assert torch.equal(held["weight"], layer.weight)  # the copy has the new values
            assert held["weight"].data_ptr() != layer.weight.data_ptr()
            storages.append(held["weight"].data_ptr())
    assert len(storages) >= 3
    assert len(set(storages)) < len(storages)  # a released copy's memory came back
