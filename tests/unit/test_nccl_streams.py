"""The NCCL transport's issue order against NCCL's rules, for every schedule (no GPU needed).

NCCL pairs a rank's k-th receive from a peer with the peer's k-th send to it, whatever the
tags, and a send larger than its buffers waits on the GPU for its receive. The transport gives
each direction between two ranks its own communicator and receives a direction's payloads in
the order they were sent (``runtime/comm.py``). ``tests/support/nccl_streams.py`` replays a
table as the transport issues it under those rules: these tests check that no schedule swaps a
payload or hangs that way, and that the model finds what the transport did before, with one
communicator per pair of ranks, receiving in table order: every 1F1B steady state hung (each
rank's receive queued behind its own send), and a V schedule swapped an activation with a
gradient of the same shape."""

from __future__ import annotations

import pytest
from nccl_streams import run_on_nccl

from pipedream.formats.plan import Plan
from pipedream.schedules import PipelineSpec, build_tables, message_routes


def _spec(
    schedule: str, ranks: list[int | tuple[int, ...]], microbatches: int, **kw
) -> PipelineSpec:
    stage_ranks = tuple(r if isinstance(r, tuple) else (r,) for r in ranks)
    return PipelineSpec(schedule, stage_ranks, microbatches, kw.pop("minibatches", 4), **kw)


def test_before_one_1f1b_pipeline_hung_with_large_messages() -> None:
    tables = build_tables(_spec("1f1b", [0, 1], 4, minibatches=2))
    before = run_on_nccl(tables, stream_per_direction=False, read_ahead=False)
    assert before.swapped == []
    # rank 0 sends microbatch 1's activations, then receives microbatch 0's gradient, on one
    # stream; rank 1 sends that gradient before it receives those activations
    assert before.stuck[:2] == ["rank 0 send ('act', 1, 0, 1)", "rank 0 recv ('grad', 0, 1, 0)"]
    now = run_on_nccl(tables, stream_per_direction=True, read_ahead=True)
    assert now.swapped == now.stuck == []


def test_before_a_v_schedule_swapped_an_activation_with_a_gradient() -> None:
    tables = build_tables(_spec("zbv", [0, 1, 1, 0], 4, minibatches=2))
    before = run_on_nccl(tables, stream_per_direction=True, read_ahead=False)
    assert before.swapped[0] == (
        "rank 0 send ('act', 2, 0, 1) paired with rank 1 recv ('grad', 0, 3, 2)"
    )
    now = run_on_nccl(tables, stream_per_direction=True, read_ahead=True)
    assert now.swapped == now.stuck == []


MICROBATCHES = {  # per minibatch, by schedule and stages: what each schedule takes
    "pipedream": lambda stages: (1,),
    "pipedream-vs": lambda stages: (1,),
    "2bw": lambda stages: (stages, 2 * stages),
    "1f1b": lambda stages: (1, 2, 2 * stages),
    "gpipe": lambda stages: (1, 2, 2 * stages),
    "zb-h1": lambda stages: (1, 2, 2 * stages),
}
SPECS = [
    *(
        _spec(schedule, list(range(stages)), m, minibatches=8)
        for schedule, choices in MICROBATCHES.items()
        for stages in (2, 3, 4)
        for m in choices(stages)
    ),
    *(_spec("interleaved-1f1b", [*range(p), *range(p)], m) for p in (2, 3) for m in (p, 2 * p)),
    *(_spec("zbv", [*range(p), *reversed(range(p))], m) for p in (2, 3, 4) for m in (p, 2 * p)),
    _spec("1f1b", [0, (1, 2)], 2),
    _spec("pipedream", [(0, 1), 2, (3, 4)], 1, minibatches=6),
    _spec("1f1b", [0, 1, 2], 2, tied=((0, 2),)),
    _spec("pipedream", [0, 1, 2], 1, tied=((0, 2),)),
    _spec("1f1b", [0, 1, 2], 3, edges=((0, 1), (1, 2), (0, 2))),
]


@pytest.mark.parametrize(
    "spec", SPECS, ids=lambda s: f"{s.schedule}-{s.stage_ranks}-m{s.microbatches}"
)
def test_no_schedule_swaps_a_payload_or_hangs_on_nccl(spec: PipelineSpec) -> None:
    outcome = run_on_nccl(build_tables(spec), stream_per_direction=True, read_ahead=True)
    assert outcome.swapped == [] and outcome.stuck == []


def _plan(schedule: str, ranks: list[list[int]], microbatches: int) -> Plan:
    return Plan.from_dict(
        {
            "format": "pipedream/plan@1",
            "workload": "mlp",
            "workload_args": {},
            "schedule": schedule,
            "microbatch_size": 4,
            "microbatches": microbatches,
            "world_size": len({r for stage in ranks for r in stage}),
            "stages": [
                {"first_layer": f"l{i}", "last_layer": f"l{i}", "replicas": len(r), "ranks": r}
                for i, r in enumerate(ranks)
            ],
        }
    )


def test_the_routes_that_get_a_group_each() -> None:
    assert message_routes(_plan("1f1b", [[0], [1], [2]], 2)) == [(0, 1), (1, 0), (1, 2), (2, 1)]
    assert message_routes(_plan("zbv", [[0], [1], [1], [0]], 2)) == [(0, 1), (1, 0)]
    # a stage of two replicas between two of one: minibatches alternate between the replicas
    routes = message_routes(_plan("1f1b", [[0], [1, 2], [3]], 1))
    assert routes == [(0, 1), (0, 2), (1, 0), (1, 3), (2, 0), (2, 3), (3, 1), (3, 2)]
    # tied parameters between the first and the last stage: their own messages
    tied = message_routes(_plan("1f1b", [[0], [1], [2]], 2), tied=((0, 2),))
    assert tied == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
