"""The lower bound on a plan's simulated time: hand-computed sums, and never above the
simulation on the original profiles' plans."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipedream.formats import Plan, Profile, StagePlan, Topology
from pipedream.optimizer import placed
from pipedream.optimizer.bounds import flush_chain_ms, minibatch_lower_bound
from pipedream.optimizer.planner import build_plan
from pipedream.optimizer.simulator import Network, StageWork, simulate
from pipedream.optimizer.tree import Cluster, Node
from pipedream.optimizer.verify import lower_bound_ms, simulated_ms
from pipedream.profiler.pipedream_import import import_pipedream_graph
from pipedream.schedules import lookup

PROFILES = Path(__file__).resolve().parents[1] / "data" / "pipedream-profiles"
FREE = Network((64,), (1e12,))  # transfers of 0 bytes: free
SLOW = Network((64,), (2e6,))  # 1000 bytes take 0.5 ms


def plan_of(schedule: str, ranks: list[tuple[int, ...]], microbatches: int = 1) -> Plan:
    stages = tuple(StagePlan(f"l{s}", f"l{s}", len(r), r) for s, r in enumerate(ranks))
    world = len({rank for r in ranks for rank in r})
    return Plan("toy", schedule, 1, microbatches, world, stages)


def simulated(plan: Plan, work: list[StageWork], network: Network) -> float:
    """The steady state's time (a run too short for it can average below the bound: the
    interface test's pipeline without interfaces averages 1/6 ms over 24 minibatches)."""
    timeline = simulate(plan, work, network)
    assert timeline.steady
    return timeline.time_per_minibatch_ms


def test_the_slowest_stage_bounds_a_pipeline_and_is_its_time() -> None:
    work = [StageWork(1.0, 1.0, 0, 0), StageWork(2.0, 3.0, 0, 0), StageWork(1.0, 2.0, 0, 0)]
    plan = plan_of("pipedream", [(0,), (1,), (2,)])
    assert minibatch_lower_bound(plan, work, FREE) == 5.0
    assert simulated(plan, work, FREE) == pytest.approx(5.0)


def test_a_replica_does_its_share_of_the_minibatches_with_their_update_and_allreduce() -> None:
    # stage 0 on 2 replicas, 4 microbatches of F 1 + B 2, 3 gradient additions of 0.1, an update
    # of 0.5 and a ring allreduce of 1 MB at 1 GB/s (4 (2 - 1) / 2 * 1e6 / 1e9 s = 2 ms): 14.8
    # ms per minibatch of its own, every other minibatch: 7.4; stage 1 spends 4 ms
    network = Network((64,), (1e9,))
    work = [
        StageWork(1.0, 2.0, 1e6, 0, update_ms=0.5, accumulate_ms=0.1),
        StageWork(0.5, 0.5, 0, 0),
    ]
    plan = plan_of("1f1b", [(0, 1), (2,)], microbatches=4)
    assert minibatch_lower_bound(plan, work, network) == pytest.approx(7.4)
    assert simulated(plan, work, network) >= 7.4


def test_a_link_carries_both_directions_one_message_at_a_time() -> None:
    # 2 microbatches, an activation and a gradient of 0.5 ms each: the link is busy 2 ms per
    # minibatch, each worker computes 1 ms (2bw does not flush: no chain, below)
    work = [StageWork(0.25, 0.25, 0, 1000.0), StageWork(0.25, 0.25, 0, 0)]
    plan = plan_of("2bw", [(0,), (1,)], microbatches=2)
    assert minibatch_lower_bound(plan, work, SLOW) == pytest.approx(2.0)
    assert simulated(plan, work, SLOW) >= 2.0


def test_a_flushing_pipeline_takes_at_least_its_chain_per_minibatch() -> None:
    # the same under 1f1b, which flushes: forward 0 on worker 0 (0.25), its activation (0.5),
    # forward 0 and backward 0 on worker 1 (0.5), its gradient (0.5), then backward 0 on
    # worker 0, which waits for the gradient of backward 1 (sent at 1.75, there at 2.25) and
    # runs it: 2.5 ms; the link's 2 ms and the workers' 1 ms are less
    work = [StageWork(0.25, 0.25, 0, 1000.0), StageWork(0.25, 0.25, 0, 0)]
    plan = plan_of("1f1b", [(0,), (1,)], microbatches=2)
    assert flush_chain_ms(plan, work, SLOW) == pytest.approx(2.5)
    assert minibatch_lower_bound(plan, work, SLOW) == pytest.approx(2.5)
    assert simulated(plan, work, SLOW) == pytest.approx(2.5)
    # copies of a pipeline run every other minibatch each; the allreduce joins them
    copies = plan_of("1f1b", [(0, 2), (1, 3)], microbatches=2)
    assert flush_chain_ms(copies, work, SLOW) == pytest.approx(2.5 / 2)
    # the chain ends with the first stage's rank: a later rank's update may overlap the next
    # minibatch (one microbatch, 0.25 ms passes: worker 0 is done at 1 ms, worker 1's update
    # of 5 ms ends at 5.75, but worker 1 needs 5.5 ms per minibatch, and so does the pipeline)
    slow_update = [StageWork(0.25, 0.25, 0, 0), StageWork(0.25, 0.25, 0, 0, update_ms=5.0)]
    one = plan_of("1f1b", [(0,), (1,)])
    assert flush_chain_ms(one, slow_update, FREE) == pytest.approx(1.0)
    assert minibatch_lower_bound(one, slow_update, FREE) == pytest.approx(5.5)
    assert simulated(one, slow_update, FREE) == pytest.approx(5.5)
    # unequal replicas update at their own pace: no chain
    assert flush_chain_ms(plan_of("1f1b", [(0, 2), (1,)], microbatches=2), work, SLOW) == 0.0


@pytest.mark.parametrize(("interface", "bound"), [(True, 0.5), (False, 1 / 3)])
def test_an_interface_takes_in_what_all_replicas_send(interface: bool, bound: float) -> None:
    # 3 replicas feed one worker: each link carries a third of the minibatches (an activation
    # and a gradient of 0.5 ms: 1/3 ms per minibatch), the receiver's interface all activations
    network = Network((64,), (2e6,), interface=interface)
    work = [StageWork(0.01, 0.01, 0, 1000.0), StageWork(0.01, 0.01, 0, 0)]
    plan = plan_of("pipedream", [(0, 1, 2), (3,)])
    assert minibatch_lower_bound(plan, work, network) == pytest.approx(bound)
    assert simulated(plan, work, network) >= bound


def test_stages_on_one_worker_hand_over_without_a_message() -> None:
    # zbv on 2 workers: stages 0 and 3 on worker 0, 1 and 2 on worker 1, whose messages
    # between them are not posted; posting one of the others holds the sender 1 ms: worker 1
    # posts 2 per microbatch (the activation to stage 3, the gradient to stage 0) besides its
    # 2 x 0.5 ms of compute: 2 microbatches take 6 ms
    ranks = lookup("zbv").placement
    assert ranks is not None and ranks(4, 2) == [0, 1, 1, 0]
    network = Network((64,), (1e12,), send_ms=1.0)
    work = [StageWork(0.25, 0.25, 0, 1000.0)] * 3 + [StageWork(0.25, 0.25, 0, 0)]
    plan = plan_of("zbv", [(0,), (1,), (1,), (0,)], microbatches=2)
    assert minibatch_lower_bound(plan, work, network) == pytest.approx(6.0)
    assert simulated(plan, work, network) >= 6.0


def test_a_transfer_pool_bounds_compute_alone_and_a_spread_has_no_bound() -> None:
    work = [StageWork(0.25, 0.25, 0, 1000.0), StageWork(0.25, 0.25, 0, 0)]
    plan = plan_of("2bw", [(0,), (1,)], microbatches=2)
    pooled = Network((64,), (2e6,), duplex=2.0)
    assert minibatch_lower_bound(plan, work, pooled) == pytest.approx(1.0)
    spread = Network((64,), (2e6,), message_spread=(0.5, 1.5))
    with pytest.raises(ValueError, match="spread"):
        minibatch_lower_bound(plan, work, spread)


@pytest.fixture(scope="module", params=["vgg16", "resnet50", "gnmt"])
def original(request: pytest.FixtureRequest) -> Profile:
    return import_pipedream_graph(PROFILES / f"{request.param}.txt")


def _trees(layers: int) -> list[tuple[Node, ...]]:
    """Data parallelism, a 3-1 split, and 4 straight stages, on 4 workers."""
    quarter = layers // 4
    return [
        (Node(0, layers - 1, 4),),
        (Node(0, 3 * quarter - 1, 3), Node(3 * quarter, layers - 1, 1)),
        tuple(Node(i * quarter, (i + 1) * quarter - 1, 1) for i in range(3))
        + (Node(3 * quarter, layers - 1, 1),),
    ]


@pytest.mark.parametrize(
    ("schedule", "m"), [("pipedream", 1), ("2bw", 4), ("1f1b", 4), ("gpipe", 4), ("zb-h1", 4)]
)
def test_the_bound_never_exceeds_the_simulation(original: Profile, schedule: str, m: int) -> None:
    topology = Topology.single_level(4, 1e9)
    cluster = Cluster.from_topology(topology, microbatches=m)
    for tree in _trees(len(original.layers)):
        plan, _ = build_plan(original, tree=tree, cluster=cluster, schedule=schedule)
        time_ms = simulated_ms(plan, original, topology)
        assert time_ms is not None
        assert lower_bound_ms(plan, original, topology) <= time_ms * (1 + 1e-9), tree


# (profile, schedule) on 4 workers: candidates simulated with the bounds, and without
SIMULATED = {
    ("vgg16", "interleaved-1f1b"): (1, 12),
    ("vgg16", "zbv"): (1, 4),
    ("resnet50", "zbv"): (1, 4),
}


@pytest.mark.parametrize(("name", "schedule"), sorted(SIMULATED))
def test_placed_plans_simulate_only_what_can_win(
    name: str, schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every candidate simulated (no bound) gives the plan the planner gives, which simulates
    fewer; no candidate simulates below its bound."""
    original = import_pipedream_graph(PROFILES / f"{name}.txt")
    topology = Topology.single_level(4, 1e9)
    runs: list[tuple[float, float]] = []

    def counted(plan: Plan, profile: Profile, topology: Topology) -> float | None:
        time_ms = simulated_ms(plan, profile, topology)
        assert time_ms is not None
        runs.append((lower_bound_ms(plan, profile, topology), time_ms))
        return time_ms

    monkeypatch.setattr(placed, "simulated_ms", counted)
    options = dict(schedule=schedule, microbatches=None, virtual_stages=None, memory_limit=None)
    chosen = placed.placed_search(original, topology, cost_model="symmetric", **options).plan
    with_bounds = len(runs)
    monkeypatch.setattr(placed, "BOUND_SLACK", float("inf"))
    every = placed.placed_search(original, topology, cost_model="symmetric", **options).plan
    assert chosen is not None and every is not None
    assert chosen.plan == every.plan
    assert (with_bounds, len(runs) - with_bounds) == SIMULATED[name, schedule]
    assert all(bound <= time_ms * (1 + 1e-9) for bound, time_ms in runs)
