"""The fluid model of transfers sharing a host's capacity, against hand-computed times."""

from __future__ import annotations

import pytest

from pipedream.formats import Plan, StagePlan
from pipedream.optimizer.simulator import Network, StageWork, default_steps, simulate
from pipedream.optimizer.transfers import Transfer, TransferPool

RATE = 1000.0  # bytes per ms on every link
SIZE = 4000.0  # 4 ms alone


def _transfer(key: str, link: tuple[int, int], units: tuple[int, ...] = (0,)) -> Transfer:
    return Transfer(key, link, units, SIZE, RATE)


def _run(pool: TransferPool, starts: list[tuple[float, Transfer]]) -> dict[str, float]:
    """Start transfers at their times, return when each ended."""
    ended: dict[str, float] = {}
    pending = sorted(starts, key=lambda item: item[0])
    while pending or pool.active:
        due = pool.next_completion()
        if pending and (due is None or pending[0][0] <= due):
            when, transfer = pending.pop(0)
            pool.start(when, transfer)
            continue
        assert due is not None
        for transfer in pool.complete(due):
            ended[transfer.key] = due
    return ended


def test_alone_a_transfer_moves_at_its_link_rate() -> None:
    assert _run(TransferPool(1.5 * RATE), [(0.0, _transfer("a", (0, 1)))]) == {"a": 4.0}


def test_concurrent_transfers_share_the_capacity() -> None:
    # capacity 1.5 links: two at once move at 0.75 each, so 4 ms of work takes 5.333 ms
    ended = _run(
        TransferPool(1.5 * RATE), [(0.0, _transfer("a", (0, 1))), (0.0, _transfer("b", (2, 3)))]
    )
    assert ended == pytest.approx({"a": 16 / 3, "b": 16 / 3})


def test_rates_change_when_a_transfer_starts_and_ends() -> None:
    # a alone for 2 ms (half done), then both at 0.75: a ends 2 + 2 / 0.75 = 4.667; b has
    # moved 2 ms worth by then and finishes its last 2 ms alone: 6.667
    ended = _run(
        TransferPool(1.5 * RATE), [(0.0, _transfer("a", (0, 1))), (2.0, _transfer("b", (2, 3)))]
    )
    assert ended == pytest.approx({"a": 2 + 2 / 0.75, "b": 2 + 2 / 0.75 + 2})


def test_one_link_carries_one_transfer_at_a_time() -> None:
    ended = _run(
        TransferPool(10 * RATE), [(0.0, _transfer("a", (0, 1))), (1.0, _transfer("b", (0, 1)))]
    )
    assert ended == {"a": 4.0, "b": 8.0}


def _directed(key: str, source: int, destination: int) -> Transfer:
    link = (min(source, destination), max(source, destination))
    return Transfer(key, link, (0,), SIZE, RATE, source=source)


def test_duplex_one_the_two_directions_share_the_link() -> None:
    # a alone for 2 ms (half done), then both at half the link: a's last 2 ms of work take 4 ms
    # (ends at 6, where first come first served ends it at 4); b has moved 2 ms worth by then
    # and finishes alone at 8
    ended = _run(
        TransferPool(10 * RATE, duplex=1.0),
        [(0.0, _directed("a", 0, 1)), (2.0, _directed("b", 1, 0))],
    )
    assert ended == pytest.approx({"a": 6.0, "b": 8.0})


def test_full_duplex_each_direction_at_full_speed_one_transfer_at_a_time() -> None:
    ended = _run(
        TransferPool(10 * RATE, duplex=2.0),
        [(0.0, _directed("a", 0, 1)), (0.0, _directed("b", 1, 0)), (1.0, _directed("c", 0, 1))],
    )
    assert ended == pytest.approx({"a": 4.0, "b": 4.0, "c": 8.0})


def test_duplex_and_host_capacity_both_bound_the_rate() -> None:
    # each way at most 1.5 / 2 = 0.75 of the link (duplex); the host (2 links) is not the limit
    ended = _run(
        TransferPool(2 * RATE, duplex=1.5),
        [(0.0, _directed("a", 0, 1)), (0.0, _directed("b", 1, 0))],
    )
    assert ended == pytest.approx({"a": 4 / 0.75, "b": 4 / 0.75})
    # with a host of one link's capacity, the host is: 0.5 each
    ended = _run(
        TransferPool(RATE, duplex=1.5),
        [(0.0, _directed("a", 0, 1)), (0.0, _directed("b", 1, 0))],
    )
    assert ended == pytest.approx({"a": 8.0, "b": 8.0})


def test_a_rank_moves_one_links_worth_in_all_with_per_rank_one() -> None:
    # a (0 -> 1) alone for 2 ms, half done; then b (1 -> 2) shares rank 1 with it: both at half
    # the link, a's last 2 ms of work take 4 ms (ends at 6), b has 2 ms left then (ends at 8).
    # c (2 -> 3) starts at 8 as b ends: alone, 12. d (4 -> 5) shares no rank: 4 ms
    ended = _run(
        TransferPool(10 * RATE, per_rank=1.0),
        [
            (0.0, _directed("a", 0, 1)),
            (2.0, _directed("b", 1, 2)),
            (8.0, _directed("c", 2, 3)),
            (0.0, _directed("d", 4, 5)),
        ],
    )
    assert ended == pytest.approx({"a": 6.0, "b": 8.0, "c": 12.0, "d": 4.0})


def test_per_rank_bounds_by_the_busier_end() -> None:
    # a chain of three at once with 1.5 links per rank: ranks 1 and 2 each carry two, so every
    # transfer moves at 0.75 (the end it shares with another is the limit): 4 / 0.75 ms
    chain = [(0.0, _directed(k, r, r + 1)) for k, r in (("a", 0), ("b", 1), ("c", 2))]
    ended = _run(TransferPool(10 * RATE, per_rank=1.5), chain)
    assert ended == pytest.approx({"a": 4 / 0.75, "b": 4 / 0.75, "c": 4 / 0.75})


def test_an_interface_shares_a_ranks_incoming_transfers_and_its_outgoing_ones_apart() -> None:
    # a (0 -> 2) and b (1 -> 2) both arrive at rank 2: at half the link each, 8 ms; c (2 -> 3)
    # leaves rank 2 meanwhile at full speed (the other way through its interface), 4 ms; d
    # (4 -> 5) shares no interface: 4 ms
    ended = _run(
        TransferPool(10 * RATE, interface=True),
        [
            (0.0, _directed("a", 0, 2)),
            (0.0, _directed("b", 1, 2)),
            (0.0, _directed("c", 2, 3)),
            (0.0, _directed("d", 4, 5)),
        ],
    )
    assert ended == pytest.approx({"a": 8.0, "b": 8.0, "c": 4.0, "d": 4.0})


def test_an_interface_is_per_level() -> None:
    # a (0 -> 2) and b (1 -> 2), of one bandwidth but on links of two levels: each goes
    # through its own interface of rank 2, at full speed
    other = Transfer("b", (1, 2), (0,), SIZE, RATE, source=1, level=1)
    ended = _run(
        TransferPool(10 * RATE, interface=True), [(0.0, _directed("a", 0, 2)), (0.0, other)]
    )
    assert ended == pytest.approx({"a": 4.0, "b": 4.0})


def test_a_transfer_waiting_for_its_link_takes_no_share_of_an_interface() -> None:
    # b waits for a on their link (0, 2); a alone moves through rank 2's interface: 4 ms
    ended = _run(
        TransferPool(10 * RATE, interface=True),
        [(0.0, _directed("a", 0, 2)), (0.0, _directed("b", 0, 2))],
    )
    assert ended == pytest.approx({"a": 4.0, "b": 8.0})


def test_transfers_in_other_units_do_not_interfere() -> None:
    ended = _run(
        TransferPool(RATE),
        [(0.0, _transfer("a", (0, 1), (0,))), (0.0, _transfer("b", (2, 3), (1,)))],
    )
    assert ended == {"a": 4.0, "b": 4.0}


@pytest.mark.parametrize("schedule", ["pipedream", "2bw", "1f1b", "gpipe"])
def test_ample_capacity_changes_nothing(schedule: str) -> None:
    m = 1 if schedule == "pipedream" else 4
    stages = tuple(StagePlan(f"l{s}", f"l{s}", 1, (s,)) for s in range(4))
    plan = Plan("toy", schedule, 1, m, 4, stages)
    work = [StageWork(1.0, 2.0, 0.0, 1e6)] * 4
    independent = Network((4,), (1e9,), 0.1)
    shared = Network((4,), (1e9,), 0.1, unit_capacity=1e12)
    steps = default_steps(plan)
    a = simulate(plan, work, independent, num_minibatches=steps).time_per_minibatch_ms
    b = simulate(plan, work, shared, num_minibatches=steps).time_per_minibatch_ms
    assert b == pytest.approx(a)


def test_a_host_of_one_link_capacity_serialises_every_transfer() -> None:
    # 3 stages, pipedream, no compute: each minibatch moves 4 messages of 1 ms; with the host
    # moving one link's worth at a time the steady state is bound by 4 ms of transfers
    stages = tuple(StagePlan(f"l{s}", f"l{s}", 1, (s,)) for s in range(3))
    plan = Plan("toy", "pipedream", 1, 1, 3, stages)
    work = [StageWork(0.0, 0.0, 0.0, 1e6)] * 3
    network = Network((3,), (1e9,), 0.0, unit_capacity=1e9)
    timeline = simulate(plan, work, network, num_minibatches=default_steps(plan))
    assert timeline.time_per_minibatch_ms == pytest.approx(4.0)
