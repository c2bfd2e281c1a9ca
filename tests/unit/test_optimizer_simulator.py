"""The simulator against hand-computed timelines, and its text grid."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipedream.errors import PlanningError
from pipedream.formats import (
    ActionOverhead,
    LayerProfile,
    Level,
    PassSpread,
    Plan,
    Profile,
    StagePlan,
    Topology,
)
from pipedream.formats.plan import Prediction
from pipedream.optimizer import simulator
from pipedream.optimizer.simulate_command import (
    MAX_ACTIONS,
    _max_minibatches,
    _simulated_means,
    format_jitter,
    format_report,
)
from pipedream.optimizer.simulator import (
    FRAGILE,
    SPREAD_MINIBATCHES,
    Network,
    StageWork,
    Timeline,
    default_steps,
    jittered,
    simulate,
    stage_work,
    steady_window,
)
from pipedream.optimizer.timeline import format_timeline

FAST = Network((64,), (1e12,))  # transfers of 0 bytes: free


def plan_of(schedule: str, replicas: list[int], microbatches: int = 1) -> Plan:
    stages, rank = [], 0
    for s, r in enumerate(replicas):
        stages.append(StagePlan(f"l{s}", f"l{s}", r, tuple(range(rank, rank + r))))
        rank += r
    return Plan("toy", schedule, 1, microbatches, rank, tuple(stages))


def equal(num_stages: int, forward: float, backward: float) -> list[StageWork]:
    return [StageWork(forward, backward, 0.0, 0.0)] * num_stages


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "m"), [(1, 1), (2, 2), (3, 4), (4, 4), (4, 8)])
def test_flush_schedules_take_m_plus_s_minus_1_slots(schedule: str, stages: int, m: int) -> None:
    F, B = 1.0, 2.0
    timeline = simulate(
        plan_of(schedule, [1] * stages, m), equal(stages, F, B), FAST, num_minibatches=12
    )
    assert timeline.time_per_minibatch_ms == pytest.approx((m + stages - 1) * (F + B))


@pytest.mark.parametrize(("stages", "m"), [(2, 4), (4, 4), (4, 8), (8, 16), (8, 32)])
def test_zb_h1_idles_a_third_of_1f1b(stages: int, m: int) -> None:
    """F = I = W = 1 (a backward of 2, split in half): a minibatch takes 3m + S - 1 units, the
    paper's (S - 1)(F + I - W) bubble, against 1F1B's 3(S - 1)."""
    idle = stages - 1
    timeline = simulate(
        plan_of("zb-h1", [1] * stages, m), equal(stages, 1.0, 2.0), FAST, num_minibatches=6
    )
    assert timeline.time_per_minibatch_ms == pytest.approx(3 * m + idle)
    kinds = {event.kind for event in timeline.events}
    assert {"I", "W"} <= kinds and "B" not in kinds
    # simulate --trace compares the backward a run measures (I + W) with the simulated one
    # (it printed none for split backwards)
    means = _simulated_means(timeline, 0)
    assert means["B"] == pytest.approx(means["I"] + means["W"]) == pytest.approx(2.0)


@pytest.mark.parametrize(("schedule", "m"), [("pipedream", 1), ("pipedream-vs", 1), ("2bw", 4)])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_async_schedules_take_m_slots_in_steady_state(schedule: str, m: int, stages: int) -> None:
    F, B = 1.0, 2.0
    timeline = simulate(
        plan_of(schedule, [1] * stages, m), equal(stages, F, B), FAST, num_minibatches=16
    )
    assert timeline.time_per_minibatch_ms == pytest.approx(m * (F + B))


def test_the_slowest_stage_sets_the_pace() -> None:
    work = [StageWork(1.0, 1.0, 0, 0), StageWork(2.0, 3.0, 0, 0), StageWork(1.0, 2.0, 0, 0)]
    timeline = simulate(plan_of("pipedream", [1, 1, 1]), work, FAST, num_minibatches=16)
    assert timeline.time_per_minibatch_ms == pytest.approx(5.0)


def test_transfers_and_latency_are_on_the_critical_path_of_a_flush() -> None:
    # 2 stages, 1 microbatch: F0, send (0.5 ms + 0.25 latency), F1, B1, send back, B0
    network = Network((2,), (2e6,), latency_ms=0.25)  # 1000 B take 0.5 ms
    work = [StageWork(1.0, 1.0, 0, 1000.0), StageWork(1.0, 1.0, 0, 0)]
    timeline = simulate(plan_of("gpipe", [1, 1]), work, network, num_minibatches=8)
    assert timeline.time_per_minibatch_ms == pytest.approx(4 + 2 * 0.75)


@pytest.mark.parametrize(
    ("send_ms", "per_mib"),
    [(0.5, 0.0), (0.25, 0.25)],  # 0.5 ms per 1 MiB message either way
)
def test_posting_a_send_holds_the_sender(send_ms: float, per_mib: float) -> None:
    # pipedream, 3 stages, F = 1, B = 2: the middle stage posts two messages per minibatch
    # (activations on, gradients back), the others one each, and sets the pace: 3 + 2 * 0.5
    network = Network((64,), (1e15,), send_ms=send_ms, send_ms_per_mib=per_mib)
    work = [StageWork(1.0, 2.0, 0.0, float(2**20))] * 3
    timeline = simulate(plan_of("pipedream", [1, 1, 1]), work, network, num_minibatches=24)
    assert timeline.time_per_minibatch_ms == pytest.approx(4.0)
    posts = [e for e in timeline.events if e.kind == "S"]
    assert [e.end_ms - e.start_ms for e in posts] == pytest.approx([0.5] * len(posts))
    assert sorted({(e.rank, e.stage) for e in posts}) == [(0, 0), (1, 1), (2, 2)]
    assert len([e for e in posts if e.rank == 1]) == 2 * 24


def test_posting_receives_ahead_holds_the_receiver() -> None:
    # pipedream, 3 stages, F = 1, B = 2: the middle stage receives two messages per minibatch
    # (activations, gradients) and posts each receive ahead for 0.5 ms: 3 + 2 * 0.5 per
    # minibatch. Before its first action each rank posts the receives of its first
    # RECEIVE_WINDOW (32) actions at once: 6 on rank 0 (gradients), 10 on rank 1, 7 on rank 2.
    network = Network((64,), (1e15,), recv_ms=0.5)
    work = [StageWork(1.0, 2.0, 0.0, 1.0)] * 3
    timeline = simulate(plan_of("pipedream", [1, 1, 1]), work, network)
    assert timeline.time_per_minibatch_ms == pytest.approx(4.0)
    posts = [e for e in timeline.events if e.kind == "R"]
    assert [(e.rank, e.start_ms, e.end_ms) for e in posts[:3]] == [
        (0, 0.0, 3.0),
        (1, 0.0, 5.0),
        (2, 0.0, 3.5),
    ]
    steps = timeline.num_minibatches
    for rank, receives in ((0, steps), (1, 2 * steps), (2, steps)):
        posted = sum(e.end_ms - e.start_ms for e in posts if e.rank == rank)
        assert posted == pytest.approx(0.5 * receives)


def test_a_spread_of_one_ratio_scales_every_forward_and_backward_by_it() -> None:
    # pipedream, 2 stages, F = 1, B = 2: 3 ms per minibatch; forwards drawn at 2x: 4 ms
    plan, work = plan_of("pipedream", [1, 1]), equal(2, 1.0, 2.0)
    same = simulate(plan, work, FAST, spread=PassSpread((1.0,), (1.0,)))
    assert same.time_per_minibatch_ms == pytest.approx(3.0)
    assert same.drawn and not same.steady
    first, last = same.measured
    # 2 (fill) + 2 x 64 + 2 (drain) minibatches: the mean over the 64 before the drain
    assert same.num_minibatches == 2 + 2 * SPREAD_MINIBATCHES + 2
    assert (first, last) == (129 - SPREAD_MINIBATCHES, 129)
    doubled = simulate(plan, work, FAST, spread=PassSpread((2.0,), (1.0,)))
    assert doubled.time_per_minibatch_ms == pytest.approx(4.0)
    forwards = [e.end_ms - e.start_ms for e in doubled.events if e.kind == "F"]
    assert forwards == pytest.approx([2.0] * len(forwards))


def test_stages_that_vary_hold_each_other_up() -> None:
    # 2 stages, each action 0.5x or 1.5x its time (a mean of 1x): a stage that runs late
    # makes the other wait, so the pipeline is slower than with every action at its mean
    plan, work = plan_of("pipedream", [1, 1]), equal(2, 1.0, 2.0)
    spread = PassSpread((0.5, 1.5), (0.5, 1.5))
    drawn = simulate(plan, work, FAST, spread=spread, seed=1)
    assert drawn.time_per_minibatch_ms > 3.0 * 1.05
    again = simulate(plan, work, FAST, spread=spread, seed=1)
    assert again.time_per_minibatch_ms == drawn.time_per_minibatch_ms  # seeded
    other = simulate(plan, work, FAST, spread=spread, seed=2)
    assert other.time_per_minibatch_ms != drawn.time_per_minibatch_ms


@pytest.mark.parametrize("duplex", [None, 1.0])  # the link model, then the transfer pool
def test_a_message_spread_of_one_ratio_scales_every_transfer_by_it(duplex: float | None) -> None:
    # gpipe, 2 stages, 1 microbatch: F0, message, F1, B1, message back, B0 = 4 ms + 2
    # messages. 1000 B take 0.5 ms; drawn at 3x they take 1.5 ms: 4 + 2 * (1.5 + 0.25)
    network = Network((2,), (2e6,), latency_ms=0.25, duplex=duplex, message_spread=(3.0,))
    work = [StageWork(1.0, 1.0, 0, 1000.0), StageWork(1.0, 1.0, 0, 0)]
    timeline = simulate(plan_of("gpipe", [1, 1]), work, network)
    assert timeline.drawn and not timeline.steady
    assert timeline.num_minibatches == 2 + 2 * SPREAD_MINIBATCHES + 2  # as a pass spread's
    assert timeline.time_per_minibatch_ms == pytest.approx(4 + 2 * 1.75)
    second = [(e.rank, e.kind, e.start_ms) for e in timeline.events if e.kind in "FB"][:4]
    assert second == [(0, "F", 0.0), (1, "F", 2.75), (1, "B", 3.75), (0, "B", 6.5)]


def test_messages_that_vary_hold_the_pipeline_up() -> None:
    # gpipe, 2 stages, 4 microbatches, F = 1, B = 2, full-duplex link: with every message at
    # 2 ms each direction's messages queue behind each other: activations arrive at 3, 5, 7,
    # 9 ms, gradients (sent at 12, 14, 16, 18) at 14 ... 20, the last backward ends at 22.
    # Drawn at 0.5x or 3.5x of 1 ms instead (the same mean), a slow message holds up the
    # ones behind it and its receiver: slower than every message at the mean
    plan = plan_of("gpipe", [1, 1], 4)
    work = [StageWork(1.0, 2.0, 0, 1000.0), StageWork(1.0, 2.0, 0, 1000.0)]  # 1 ms each

    def simulated(spread: tuple[float, ...], seed: int = 0) -> float:
        network = Network((2,), (1e6,), duplex=2.0, message_spread=spread)
        return simulate(plan, work, network, seed=seed).time_per_minibatch_ms

    assert simulated((2.0,)) == pytest.approx(22.0)
    drawn = simulated((0.5, 3.5), seed=1)
    assert drawn > 22.0 * 1.05
    assert simulated((0.5, 3.5), seed=1) == drawn  # seeded
    assert simulated((0.5, 3.5), seed=2) != drawn


# Two stages of F = 20, B = 40 ms; each message 20 ms (400 kB at 20 MB/s) on a link whose two
# directions share it, as do each rank's sends and receives (gloo's one transport thread).
SHARED_LINK = Network((2,), (20e6,), duplex=1.0, per_rank=1.0)
SLOW_MESSAGES = [StageWork(20.0, 40.0, 0, 400e3), StageWork(20.0, 40.0, 0, 400e3)]


def test_no_jitter_is_the_fixed_timeline() -> None:
    plan = plan_of("2bw", [1, 1], 8)
    fixed = simulate(plan, SLOW_MESSAGES, SHARED_LINK)
    assert fixed.steady and fixed.time_per_minibatch_ms == pytest.approx(640.0)
    same = jittered(plan, SLOW_MESSAGES, SHARED_LINK, jitter=0.0)
    assert same.drawn and same.time_per_minibatch_ms == pytest.approx(640.0)


def test_two_cycles_that_share_a_link_drift_into_each_other_under_noise() -> None:
    # 2bw, 8 microbatches: the even and the odd microbatches each cycle through activation
    # (20), the second stage's F + B (60), gradient (20), the first stage's B and next F (60),
    # 160 ms per two microbatches whatever the offset between the two cycles. The fixed times
    # keep the fill's offset, at which the two directions never share the link: 80 ms per
    # microbatch, 640 per minibatch. Where an activation and a gradient overlap, each takes
    # 40 ms: up to 100 ms per microbatch. Noise lets the offset drift into the overlap.
    plan = plan_of("2bw", [1, 1], 8)
    fixed = simulate(plan, SLOW_MESSAGES, SHARED_LINK)
    noisy = jittered(plan, SLOW_MESSAGES, SHARED_LINK)  # every time 0.95x or 1.05x
    assert 640.0 * (1 + FRAGILE) < noisy.time_per_minibatch_ms < 800.0 * 1.05
    assert jittered(plan, SLOW_MESSAGES, SHARED_LINK) == noisy  # seeded
    assert "fixed steady state is fragile" in format_jitter(fixed, noisy)


def test_a_flush_with_free_messages_is_not_fragile() -> None:
    # gpipe, 2 stages, 8 microbatches: 9 slots of F + B = 540 ms; a late action holds up the
    # other stage a little (the mean over drawn times is higher), but nothing drifts
    plan, work = plan_of("gpipe", [1, 1], 8), equal(2, 20.0, 40.0)
    fixed = simulate(plan, work, FAST)
    noisy = jittered(plan, work, FAST)
    assert fixed.time_per_minibatch_ms == pytest.approx(540.0)
    assert 540.0 < noisy.time_per_minibatch_ms < 540.0 * (1 + FRAGILE)
    assert "fragile" not in format_jitter(fixed, noisy)


@pytest.mark.parametrize("jitter", [-0.1, 1.0])
def test_a_jitter_outside_0_to_1_is_refused(jitter: float) -> None:
    with pytest.raises(PlanningError, match=f"jitter {jitter}"):
        jittered(plan_of("gpipe", [1, 1]), equal(2, 1.0, 2.0), FAST, jitter=jitter)


def test_a_send_posted_while_its_transfer_runs_is_off_the_critical_path_of_a_flush() -> None:
    # gpipe, 2 stages, 1 microbatch: the message leaves when it is posted, so posting it
    # (0.2 ms here) only delays the sender, who has nothing else to do: the same 4 + 2 * 0.75
    # as without posting costs (see the test above that one)
    network = Network((2,), (2e6,), latency_ms=0.25, send_ms=0.2)  # 1000 B take 0.5 ms
    work = [StageWork(1.0, 1.0, 0, 1000.0), StageWork(1.0, 1.0, 0, 0)]
    timeline = simulate(plan_of("gpipe", [1, 1]), work, network, num_minibatches=8)
    assert timeline.time_per_minibatch_ms == pytest.approx(4 + 2 * 0.75)
    first = [(e.rank, e.kind, e.start_ms, e.end_ms) for e in timeline.events if e.kind != "U"]
    first = first[:6]
    assert first == [
        (0, "F", 0.0, 1.0),
        (0, "S", 1.0, pytest.approx(1.2)),
        (1, "F", 1.75, 2.75),
        (1, "B", 2.75, 3.75),
        (1, "S", 3.75, pytest.approx(3.95)),
        (0, "B", 4.5, 5.5),
    ]


@pytest.mark.parametrize(
    "network",
    [
        Network((2,), (1e5,)),  # 1000 B take 10 ms; a message's end is known when it is sent
        Network((2,), (1e5,), duplex=1.0),  # the same through the transfer pool: known later
    ],
)
def test_a_rank_waits_for_its_oldest_sends_beyond_the_runtimes_bound(network: Network) -> None:
    # gpipe, 2 stages, 12 microbatches: stage 0 forwards in 1 ms each and sends, message k
    # leaves it at 11 + 10 k. Before each action the runtime waits for its oldest sends until
    # 16 parts (8 messages of a header and a tensor) are left: after F8's message (9 sent),
    # F9 waits for message 0 (11 ms), F10 for message 1 (21 ms), F11 for message 2 (31 ms)
    work = [StageWork(1.0, 1.0, 0, 1000.0), StageWork(1.0, 1.0, 0, 0)]
    timeline = simulate(plan_of("gpipe", [1, 1], 12), work, network, num_minibatches=2)
    starts = [e.start_ms for e in timeline.events if e.rank == 0 and e.kind == "F"]
    assert starts[:12] == pytest.approx([0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 21, 31])
    waits = [(e.index, e.start_ms, e.end_ms) for e in timeline.events if e.kind == "H"]
    assert waits[:3] == [(9, 9.0, 11.0), (10, 12.0, 21.0), (11, 22.0, 31.0)]


def test_replicas_allreduce_once_per_own_minibatch() -> None:
    # data parallel on 2 workers: each does F + B = 3 ms, then allreduces 1 MB:
    # 4 * (2 - 1) / 2 * 1e6 B / 1e9 B/s = 2 ms; two minibatches per 5 ms
    network = Network((2,), (1e9,))
    work = [StageWork(1.0, 2.0, 1e6, 0.0)]
    timeline = simulate(plan_of("pipedream", [2]), work, network, num_minibatches=8)
    assert timeline.time_per_minibatch_ms == pytest.approx(2.5)
    kinds = {event.kind for event in timeline.events}
    assert kinds == {"F", "B", "A", "U"}


def test_hierarchical_allreduce_by_hand() -> None:
    # 4 ranks on 2 servers of 2: ring in the server (k = 2) at 10 GB/s, then across servers
    # (k = 2) at 1 GB/s with the data split over the server's 2 workers
    network = Network.from_topology(Topology((Level("server", 2, 1e10), Level("net", 2, 1e9))))
    size = 1e9
    expected = (4 * 0.5 * size / 1e10 + 4 * 0.5 * size / (1e9 * 2)) * 1e3
    assert network.allreduce_ms(size, [0, 1, 2, 3]) == pytest.approx(expected)
    assert network.allreduce_ms(size, [0, 1]) == pytest.approx(4 * 0.5 * size / 1e10 * 1e3)
    assert network.transfer_ms(1e9, 0, 1) == pytest.approx(100.0)
    assert network.transfer_ms(1e9, 1, 2) == pytest.approx(1000.0)


def test_text_grid_shows_the_bubbles() -> None:
    timeline = simulate(plan_of("gpipe", [1, 1], 2), equal(2, 1.0, 1.0), FAST, num_minibatches=1)
    grid = format_timeline(timeline, plan_of("gpipe", [1, 1], 2), width=6)
    assert grid.splitlines() == [
        "rank (stage) | 0  1  2  3  4  5",
        "       0 (0) | F0 F1 .  .  B0 B1",
        "       1 (1) | .  F0 F1 B0 B1 .",
        "one slot = 1 ms",
    ]
    assert timeline.busy_fraction(0) == pytest.approx(4 / 6)


def test_stage_work_from_a_profile() -> None:
    layers = tuple(
        LayerProfile(f"l{i}", "Linear", 1.0 + i, 2.0 * i, 100 * (i + 1), 10 * i) for i in range(4)
    )
    profile = Profile("toy", 1, "cpu", "float32", layers, cut_bytes=(7, 8, 9))
    plan = Plan(
        "toy",
        "pipedream",
        1,
        1,
        2,
        (StagePlan("l0", "l1", 1, (0,)), StagePlan("l2", "l3", 1, (1,))),
    )
    assert stage_work(plan, profile) == [
        StageWork(forward_ms=3.0, backward_ms=2.0, parameter_bytes=10.0, output_bytes=8.0),
        StageWork(forward_ms=7.0, backward_ms=10.0, parameter_bytes=50.0, output_bytes=0.0),
    ]


def test_stage_work_adds_update_times_and_the_runtime_cost_per_action() -> None:
    layers = tuple(
        LayerProfile(f"l{i}", "Linear", 1.0, 2.0, 100, 10, update_ms=0.5 * (i + 1))
        for i in range(3)
    )
    overhead = ActionOverhead(forward_ms=0.25, backward_ms=0.125, update_ms=0.0625)
    profile = Profile("toy", 1, "cpu", "float32", layers, overhead=overhead)
    plan = Plan(
        "toy",
        "pipedream",
        1,
        1,
        2,
        (StagePlan("l0", "l1", 1, (0,)), StagePlan("l2", "l2", 1, (1,))),
    )
    work = stage_work(plan, profile)
    assert work == [
        StageWork(2.25, 4.125, 20.0, 100.0, update_ms=1.5625),
        StageWork(1.25, 2.125, 10.0, 0.0, update_ms=1.5625),
    ]
    # 1F1B in steady state: the slower stage's F + B + U per minibatch
    timeline = simulate(plan, work, FAST, num_minibatches=default_steps(plan))
    assert timeline.time_per_minibatch_ms == pytest.approx(2.25 + 4.125 + 1.5625)


def test_first_and_last_stage_forwards_read_the_microbatch_and_the_last_computes_the_loss() -> None:
    layers = tuple(LayerProfile(f"l{i}", "Linear", 1.0, 2.0, 100, 10) for i in range(3))
    overhead = ActionOverhead(
        0.0,
        0.0,
        0.0,
        inputs_ms=0.5,
        targets_ms=0.25,
        loss_forward_ms=0.125,
        loss_backward_ms=0.0625,
    )
    profile = Profile("toy", 1, "cpu", "float32", layers, overhead=overhead)
    stages = [("l0", "l0"), ("l1", "l1"), ("l2", "l2")]
    plan = Plan(
        "toy",
        "gpipe",
        1,
        1,
        3,
        tuple(StagePlan(a, b, 1, (i,)) for i, (a, b) in enumerate(stages)),
    )
    # inputs on stage 0, nothing in the middle, targets and the loss on the last stage
    assert [w.forward_ms for w in stage_work(plan, profile)] == [1.5, 1.0, 1.375]
    assert [w.backward_ms for w in stage_work(plan, profile)] == [2.0, 2.0, 2.0625]
    # one stage reads both and computes the loss
    alone = Plan("toy", "gpipe", 1, 1, 1, (StagePlan("l0", "l2", 1, (0,)),))
    assert [w.forward_ms for w in stage_work(alone, profile)] == [3.875]
    assert [w.backward_ms for w in stage_work(alone, profile)] == [6.0625]


@pytest.mark.parametrize(
    ("schedule", "m", "expected"),
    [
        # stage 0 of PipeDream holds 2 versions: every update copies its weights; the last
        # stage aliases them (no copy), so stage 0 sets the pace with F + B + U + copy
        ("pipedream", 1, 1.0 + 2.0 + 0.5 + 0.25),
        # flushing schedules never stash: (m + S - 1) slots of F + B, and one update
        ("1f1b", 2, 3 * 3.0 + 0.5),
    ],
)
def test_updates_that_stash_a_version_pay_the_copy(schedule: str, m: int, expected: float) -> None:
    work = [StageWork(1.0, 2.0, 0.0, 0.0, update_ms=0.5, copy_ms=0.25)] * 2
    plan = plan_of(schedule, [1, 1], m)
    timeline = simulate(plan, work, FAST, num_minibatches=default_steps(plan))
    assert timeline.time_per_minibatch_ms == pytest.approx(expected)


def test_later_microbatches_of_a_minibatch_accumulate_their_gradients() -> None:
    # 1f1b, S = 2, m = 2, F = 1, B = 2 (+ 0.125 for microbatch 1, whose gradients are added to
    # those of microbatch 0): stage 1 runs B1 from 5 to 7.125, stage 0 its B1 from 7.125 to
    # 9.25, then the update (0.5): 9.75 per minibatch instead of 9.5
    work = [StageWork(1.0, 2.0, 0.0, 0.0, update_ms=0.5, accumulate_ms=0.125)] * 2
    plan = plan_of("1f1b", [1, 1], 2)
    timeline = simulate(plan, work, FAST, num_minibatches=default_steps(plan))
    assert timeline.time_per_minibatch_ms == pytest.approx(9.75)
    single = simulate(plan_of("pipedream", [1, 1]), work, FAST, num_minibatches=8)
    assert single.time_per_minibatch_ms == pytest.approx(3.5)  # m = 1: nothing to accumulate


def test_default_steps_cover_fill_drain_and_three_periods() -> None:
    assert default_steps(plan_of("pipedream", [1, 1, 1, 1])) == 12  # 2 S + 3 + 1
    assert default_steps(plan_of("pipedream", [2, 3])) == 48  # 2 * 2 S * 6 + 3 * 6 + 1, rounded up
    # posting receives costs time: the last 32 actions of a table, which post none, within
    # ceil(32 / 2m) periods, join the fill and the drain
    posting = Network((64,), (1e12,), recv_ms=0.1)
    assert default_steps(plan_of("pipedream", [1, 1, 1, 1]), posting) == 44  # 2 (4 + 16) + 3 + 1
    assert default_steps(plan_of("gpipe", [1, 1], 8), posting) == 12  # 2 (2 + 2) + 3 + 1
    assert default_steps(plan_of("pipedream", [1, 1, 1, 1]), FAST) == 12  # no posting cost


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_slow_messages_set_a_cycle_of_s_minibatches(stages: int) -> None:
    # PipeDream keeps S minibatches in flight: F_{t+S} at stage 0 waits for B_t, which closes
    # the loop F, transfer, ... at every stage and back: S (F + B) + 2 (S - 1) T per S
    # minibatches when the messages (T = 2 ms on each pair's own link) are slower than compute.
    # Completions alternate (3, 7, 3, 7 ms at S = 2) and, at S = 8, take 40 minibatches to
    # settle: a window of a few minibatches after the fill measured 5.0 ms instead of 6.5 ms.
    F, B, T = 1.0, 2.0, 2.0
    plan = plan_of("pipedream", [1] * stages)
    network = Network((64,), (1000.0 / T * 1e3,))  # 1000 B per message
    work = [StageWork(F, B, 0.0, 1000.0)] * stages
    timeline = simulate(plan, work, network)
    expected = (stages * (F + B) + 2 * (stages - 1) * T) / stages
    assert timeline.time_per_minibatch_ms == pytest.approx(expected)
    assert timeline.steady
    first, last = timeline.measured
    assert first >= stages and last == timeline.num_minibatches - 1 - stages
    if stages == 8:
        assert timeline.num_minibatches == 4 * default_steps(plan)  # doubled twice


def test_steady_window_spans_whole_cycles_of_the_second_half() -> None:
    ends = [0.0, 3.0, 10.0, 13.0, 20.0, 23.0, 30.0, 33.0, 40.0, 43.0, 50.0, 53.0, 60.0, 63.0]
    # fill 0-1, drain 12-13 (margin 2); in between, cycles of 2 minibatches (3 + 7 ms)
    assert steady_window(ends, margin=2, period=1) == (5, 11)
    assert steady_window(ends, margin=2, period=2) == (5, 11)
    assert steady_window(ends[:8], margin=2, period=1) is None  # too short for 3 cycles
    growing = [float(t * t) for t in range(20)]
    assert steady_window(growing, margin=2, period=1) is None  # still a transient


@pytest.mark.parametrize(
    ("schedule", "placement", "m", "want"),
    [
        ("interleaved-1f1b", (0, 1, 0, 1), 4, (2 * 4 + 2 - 1) * 3.0),  # (v m + P - 1)(F + B)
        ("interleaved-1f1b", (0, 1, 2, 0, 1, 2), 6, (2 * 6 + 3 - 1) * 3.0),
        # 6 m F: a minibatch alone idles P - 1 units, but no rank waits for the others to
        # finish one minibatch before it starts the next, and the V's fill hides its drain
        ("zbv", (0, 1, 1, 0), 4, 6 * 4.0),
        ("zbv", (0, 1, 2, 2, 1, 0), 6, 6 * 6.0),
    ],
)
def test_several_stages_per_rank_take_their_formula(
    schedule: str, placement: tuple[int, ...], m: int, want: float
) -> None:
    """F = 1, B = 2 (I = W = 1) per stage, free messages: a rank's own stages hand their
    messages over at once, and a minibatch takes what the schedule's formula says."""
    stages = tuple(StagePlan(f"l{s}", f"l{s}", 1, (r,)) for s, r in enumerate(placement))
    plan = Plan("toy", schedule, 1, m, len(set(placement)), stages)
    timeline = simulate(plan, equal(len(placement), 1.0, 2.0), FAST, num_minibatches=3)
    assert timeline.time_per_minibatch_ms == pytest.approx(want)
    rows = format_timeline(timeline, plan).splitlines()[1:-1]
    first = ",".join(str(s) for s, r in enumerate(placement) if r == 0)
    assert len(rows) == len(set(placement)) and rows[0].lstrip().startswith(f"0 ({first}) |")


def test_a_plan_too_long_to_simulate_is_refused_in_one_line() -> None:
    """Replica counts 39, 76, 75 and 110 (what the planner gave resnet50-like profiles on 300
    workers) repeat every 815100 minibatches: the simulation ran out of memory (22 GB before
    it was killed, at 1000 workers)."""
    plan = plan_of("pipedream", [39, 76, 75, 110])
    with pytest.raises(PlanningError) as refused:
        _max_minibatches(plan, None, FAST)
    assert str(refused.value) == (
        "simulating this plan takes 9781200 minibatches of 1 microbatch on 300 ranks, "
        "5,868,720,000 forwards and backwards (at most 2,000,000); use replica counts with a "
        "smaller least common multiple: [39, 76, 75, 110] repeat only every 815100 minibatches "
        "(training needs --steps in multiples of it too)"
    )
    assert _max_minibatches(plan_of("pipedream", [2, 1]), None, FAST) == MAX_ACTIONS // 6


@pytest.mark.parametrize(
    ("steps", "fixes"),
    [
        (
            None,
            "fewer microbatches per minibatch (plan --microbatches), or replica counts with a "
            "smaller least common multiple: [4] repeat only every 4 minibatches (training "
            "needs --steps in multiples of it too)",
        ),
        (100, "--steps 12, or fewer microbatches per minibatch (plan --microbatches)"),
    ],
)
def test_a_plan_of_many_microbatches_too_long_to_simulate_blames_them(
    steps: int | None, fixes: str
) -> None:
    """It blamed only the replica counts; --steps given, they are no cause at all."""
    plan = plan_of("1f1b", [4], microbatches=16384)
    with pytest.raises(PlanningError) as refused:
        _max_minibatches(plan, steps, FAST)
    needed = steps or default_steps(plan, FAST)
    assert str(refused.value) == (
        f"simulating this plan takes {needed} minibatches of 16384 microbatches on 4 ranks, "
        f"{needed * 2 * 4 * 16384:,} forwards and backwards (at most 2,000,000); use {fixes}"
    )


def test_a_plan_too_long_to_simulate_for_its_workers_alone_says_fewer_workers() -> None:
    plan = plan_of("pipedream", [1] * 710)
    with pytest.raises(PlanningError) as refused:
        _max_minibatches(plan, None, FAST)
    assert str(refused.value) == (
        "simulating this plan takes 1424 minibatches of 1 microbatch on 710 ranks, "
        "2,022,080 forwards and backwards (at most 2,000,000); use fewer workers"
    )


@pytest.mark.parametrize(
    ("averages", "lengths"),
    [
        # no cycle shows: two runs whose averages agree within 1% end the doubling
        ([30.0, 20.0, 20.1, 99.0], [1, 2, 4]),
        # averages that keep moving: doubled as often as allowed
        ([30.0, 20.0, 25.0, 30.0, 35.0, 40.0], [1, 2, 4, 8, 16]),
    ],
)
def test_a_run_without_a_cycle_stops_doubling_once_its_average_settles(
    monkeypatch: pytest.MonkeyPatch, averages: list[float], lengths: list[int]
) -> None:
    plan = plan_of("pipedream", [1, 1])
    runs: list[int] = []

    def run(plan: Plan, work: object, network: object, steps: int) -> Timeline:
        runs.append(steps // default_steps(plan))
        ms = averages[len(runs) - 1]
        return Timeline((), steps, (), ms, (0, steps), steady=False)

    monkeypatch.setattr(simulator, "_simulate", run)
    timeline = simulate(plan, equal(2, 1.0, 2.0), FAST)
    assert runs == lengths
    assert timeline.time_per_minibatch_ms == averages[len(lengths) - 1]


def test_a_ranks_interface_takes_in_one_message_at_a_time() -> None:
    # three replicas of stage 0 send their first activations at 0.1 ms, 10 ms each on its own
    # link: without interfaces all reach stage 1 at 10.1 ms, which runs them back to back;
    # through rank 3's interface they arrive at 10.1, 20.1 and 30.1 ms
    plan = plan_of("pipedream", [3, 1])
    work = [StageWork(0.1, 0.1, 0.0, 10_000.0), StageWork(0.1, 0.1, 0.0, 0.0)]
    starts = {}
    for interface in (False, True):
        network = Network((4,), (1e6,), interface=interface)  # 10 kB take 10 ms
        timeline = simulate(plan, work, network, num_minibatches=6)
        forwards = [e for e in timeline.events if e.rank == 3 and e.kind == "F"]
        starts[interface] = [round(e.start_ms, 3) for e in forwards[:3]]
    assert starts == {False: [10.1, 10.3, 10.5], True: [10.1, 20.1, 30.1]}


def test_a_message_waiting_for_an_interface_leaves_its_link_to_others() -> None:
    # the same three replicas, all the run: stage 1's worker takes in one 10 ms activation
    # per minibatch and sends one 10 ms gradient back, through its two directions, so 10 ms
    # per minibatch is what its interface allows; an activation waiting for it must not hold
    # its link meanwhile (booked ahead, it held the gradient back: 13.3 ms). Links of their
    # own: each replica's round trip of 20 ms, three at once
    plan = plan_of("pipedream", [3, 1])
    work = [StageWork(0.1, 0.1, 0.0, 10_000.0), StageWork(0.1, 0.1, 0.0, 0.0)]
    times = {}
    for interface in (False, True):
        network = Network((4,), (1e6,), interface=interface)
        times[interface] = simulate(plan, work, network, num_minibatches=48).time_per_minibatch_ms
    assert times == pytest.approx({False: 20 / 3, True: 10.0})


def test_a_run_too_short_for_a_steady_state_says_so() -> None:
    # 4 stages of F = 1, B = 2 under pipedream: the first minibatch completes at 12 ms (the
    # fill), then one every 3 ms; 4 minibatches average 21 / 4 = 5.25 ms, the fill included,
    # which is no steady state, and no ground to call the schedule fragile
    prediction = Prediction(3.0, 1.0, 0, (3.0,) * 4, (0.0,) * 4, 12.0, cost_model="symmetric")
    plan = replace(plan_of("pipedream", [1, 1, 1, 1]), prediction=prediction)
    work = equal(4, 1.0, 2.0)
    short = simulate(plan, work, FAST, num_minibatches=4)
    assert short.completions_ms == (12.0, 15.0, 18.0, 21.0)
    assert short.from_start and not short.steady
    assert default_steps(plan, FAST) == 12
    report = format_report(short, plan, enough_steps=default_steps(plan, FAST)).splitlines()
    assert report[:3] == [
        "simulated time per minibatch: 5.250 ms (the average over all 4 minibatches from the "
        "start, fill and drain included)",
        "no steady state: 4 minibatches are too few for the pipeline's fill, a steady state and "
        "its drain; simulate at least --steps 12, or leave --steps out (the simulator then runs "
        "until its steady state shows)",
        "plan's prediction (symmetric cost model): 3.000 ms (simulated / predicted = 1.750; the "
        "simulated time includes the fill)",
    ]
    noisy = jittered(plan, work, FAST)
    line = format_jitter(short, noisy, steps_given=True)
    assert "fragile" not in line
    assert line.endswith(
        f"{noisy.time_per_minibatch_ms:.3f} ms per minibatch (the mean between minibatches "
        f"{noisy.measured[0]} and {noisy.measured[1]}; not compared with the fixed time above, "
        "which is no steady state)"
    )
    # 12 minibatches reach it: 3 ms between minibatches 4 and 7
    steady = simulate(plan, work, FAST, num_minibatches=12)
    assert steady.steady and not steady.from_start
    assert format_report(steady, plan).splitlines()[:2] == [
        "simulated time per minibatch: 3.000 ms (steady state between minibatches 4 and 7 of 12)",
        "plan's prediction (symmetric cost model): 3.000 ms (simulated / predicted = 1.000)",
    ]
