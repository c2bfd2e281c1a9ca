"""The executor's waits for its sends, run over whole tables (``pipedream.schedules.host_waits``).

A rank waits for its oldest sent messages beyond the posting's bound, and a send is done only
once its peer has issued the receive: with dense skip connections the ranks can end up waiting
for each other forever, which :func:`simulate_dependencies` (sends never wait) cannot see. On
gloo the hosts wait; on NCCL the GPUs do, and the model agrees with the replay of NCCL's
streams (``tests/support/nccl_streams.py``). The runtime then raises the bound
(:func:`plan_posting`); every built-in schedule runs at the default."""

from __future__ import annotations

import pytest
from nccl_streams import run_on_nccl

from pipedream.formats.plan import Plan
from pipedream.schedules import (
    PipelineSpec,
    Posting,
    build_tables,
    host_stall,
    plan_posting,
    posting_for,
    simulate_dependencies,
)


def _all_pairs(stages: int) -> tuple[tuple[int, int], ...]:
    """Every stage sends to every later stage (a densely connected network)."""
    return tuple((a, b) for a in range(stages) for b in range(a + 1, stages))


def _dense_spec(microbatches: int = 6) -> PipelineSpec:
    stage_ranks = tuple((rank,) for rank in range(6))
    return PipelineSpec("1f1b", stage_ranks, microbatches, 1, edges=_all_pairs(6))


@pytest.mark.parametrize("in_order", [False, True], ids=["gloo", "nccl"])
def test_dense_skip_connections_wait_forever_at_the_default_posting(in_order: bool) -> None:
    tables = build_tables(_dense_spec())
    simulate_dependencies(tables)  # no cycle between actions
    assert host_stall(tables, Posting(), in_order=in_order) == (
        "rank 0 before 0SF4 waits for its send of act 2 (stage 0 to 5) to rank 5 (9 messages in "
        "flight); rank 1 before 1RB0 waits for its send of act 2 (stage 1 to 5) to rank 5 (9 "
        "messages in flight); rank 2 before 2RB1 waits for its send of act 2 (stage 2 to 5) to "
        "rank 5 (9 messages in flight); rank 3 waits in 3RB1; rank 4 waits in 4RB1; rank 5 "
        "before 5SB1 waits for its send of grad 0 (stage 5 to 0) to rank 0 (9 messages in "
        "flight)"
    )
    # rank 5 receives act 2 after it sends grad 1, and rank 0 receives grad 0 after it sends
    # act 4: each waits for the other to get there (on NCCL, each one's GPU)
    assert posting_for(tables, in_order=in_order) == Posting(messages_in_flight=16)
    assert host_stall(tables, Posting(messages_in_flight=16), in_order=in_order) is None
    if in_order:  # the replay of NCCL's streams: stuck at the default, not at the raised bound
        for bound, stuck in ((8, True), (16, False)):
            replay = run_on_nccl(
                tables, stream_per_direction=True, read_ahead=True, messages_in_flight=bound
            )
            assert bool(replay.stuck) is stuck and replay.swapped == []


def test_a_sends_bound_of_zero_waits_for_every_receive() -> None:
    """With nothing left in flight every send waits for its receive. Under a V schedule both
    ranks send their next activations before they receive the other's: each waits for the
    other to get there."""
    spec = PipelineSpec("zbv", ((0,), (1,), (1,), (0,)), 4, 1)
    tables = build_tables(spec)
    assert host_stall(tables, Posting(window=1, messages_in_flight=0), in_order=False) == (
        "rank 0 before 0F2 waits for its send of act 1 (stage 0 to 1) to rank 1 (1 messages in "
        "flight); rank 1 before 1RF1 waits for its send of act 0 (stage 2 to 3) to rank 0 (1 "
        "messages in flight)"
    )
    # from there the bound doubles (0 to 1) until no rank waits forever; how far ahead
    # receives are posted changes no worst case
    assert posting_for(tables, in_order=False, start=Posting(1, 0)) == Posting(1, 2)


SPECS = [
    *(
        PipelineSpec(schedule, tuple((r,) for r in range(stages)), m, 4)
        for schedule in ("pipedream", "2bw", "1f1b", "gpipe", "zb-h1")
        for stages in (2, 4, 8)
        for m in ((1,) if schedule == "pipedream" else (stages, 4 * stages))
    ),
    *(
        PipelineSpec(name, tuple((r,) for r in ranks), m, 2)
        for p in (2, 4)
        for name, ranks in (
            ("interleaved-1f1b", [*range(p), *range(p)]),
            ("zbv", [*range(p), *reversed(range(p))]),
        )
        for m in (p, 4 * p)
    ),
    PipelineSpec("pipedream", ((0, 1), (2,), (3, 4)), 1, 6),
    PipelineSpec("1f1b", ((0,), (1, 2), (3,)), 4, 4),
    PipelineSpec("gpipe", ((0,), (1,), (2,)), 16, 2, tied=((0, 2),)),
    PipelineSpec("1f1b", ((0,), (1,), (2,), (3,)), 8, 4, edges=_all_pairs(4)),
]


@pytest.mark.parametrize("in_order", [False, True], ids=["gloo", "nccl"])
@pytest.mark.parametrize(
    "spec", SPECS, ids=lambda s: f"{s.schedule}-{len(s.stage_ranks)}-m{s.microbatches}"
)
def test_every_schedule_runs_at_the_default_posting(spec: PipelineSpec, in_order: bool) -> None:
    assert host_stall(build_tables(spec), Posting(), in_order=in_order) is None


def _plan(stages: int, microbatches: int) -> Plan:
    return Plan.from_dict(
        {
            "format": "pipedream/plan@1",
            "workload": "mlp",
            "workload_args": {},
            "schedule": "1f1b",
            "microbatch_size": 4,
            "microbatches": microbatches,
            "world_size": stages,
            "stages": [
                {"first_layer": f"l{i}", "last_layer": f"l{i}", "replicas": 1, "ranks": [i]}
                for i in range(stages)
            ],
        }
    )


def test_the_runtime_raises_the_posting_only_where_it_must() -> None:
    plan = _plan(6, 6)
    assert plan_posting(plan, [1, 100], in_order=False) == Posting()
    raised = Posting(messages_in_flight=16)
    assert plan_posting(plan, [1, 100], in_order=False, edges=_all_pairs(6)) == raised
    assert plan_posting(plan, [1, 100], in_order=True, edges=_all_pairs(6)) == raised


def test_the_start_line_says_when_the_posting_is_raised() -> None:
    from pipedream.runtime.train import _posting_note

    assert _posting_note(Posting()) == ""
    assert _posting_note(Posting(messages_in_flight=16)) == (
        "16 sent messages in flight (raised: with fewer, ranks could wait for each other's "
        "sends forever); "
    )


@pytest.mark.parametrize("bound", [0, 1, 2, 8])
def test_on_nccl_the_model_agrees_with_the_replay_of_its_streams(bound: int) -> None:
    """On NCCL a reclaimed send is a wait of the rank's stream, done once the receiver has read
    the message's header and so issued its receive. ``run_on_nccl`` replays the streams with
    that rule; both must find the same tables stuck, or the runtime could keep a bound under
    which the GPUs wait for each other forever."""
    specs = [*SPECS, _dense_spec(), PipelineSpec("zbv", ((0,), (1,), (1,), (0,)), 4, 1)]
    for spec in specs:
        tables = build_tables(spec)
        stall = host_stall(tables, Posting(messages_in_flight=bound), in_order=True)
        replay = run_on_nccl(
            tables, stream_per_direction=True, read_ahead=True, messages_in_flight=bound
        )
        assert (stall is not None) == bool(replay.stuck), (spec, bound, stall, replay.stuck[:3])
