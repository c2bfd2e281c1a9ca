"""The local search by simulation around the dynamic program's plan (pipedream.optimizer.refine),
alone with made-up times and in the planner on the original VGG-16 profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipedream.cli import main
from pipedream.formats import Profile, Topology, save_profile
from pipedream.formats.topology import Level
from pipedream.optimizer.planner import PlanOptions, plan_profile
from pipedream.optimizer.refine import Moves, _balanced_cut, neighbours, refine
from pipedream.optimizer.tree import Node, Tree
from pipedream.profiler.pipedream_import import import_pipedream_graph

VGG16 = Path(__file__).resolve().parents[1] / "data" / "pipedream-profiles" / "vgg16.txt"
EVEN = [1.0] * 6
"""Six layers of equal compute."""

Stages = list[tuple[int, int, int]]


def _tree(*stages: tuple[int, int, int]) -> Tree:
    return tuple(Node(*stage) for stage in stages)


def _stages(tree: Tree) -> Stages:
    return [(node.first, node.last, node.replicas) for node in tree]


def test_the_neighbours_of_a_replicated_plan() -> None:
    found = [_stages(t) for t in neighbours(_tree((0, 2, 2), (3, 5, 1)), Moves(3, True), EVEN)]
    assert found == [
        [(0, 0, 2), (1, 5, 1)],  # the cut moved by -2, -1, +1, +2 (4 steps leave no layer)
        [(0, 1, 2), (2, 5, 1)],
        [(0, 3, 2), (4, 5, 1)],
        [(0, 4, 2), (5, 5, 1)],
        [(0, 2, 1), (3, 5, 2)],  # a replica moved
        [(0, 5, 3)],  # the two stages merged
        [(0, 0, 1), (1, 2, 1), (3, 5, 1)],  # stage 0 split 1:1 (layer 0 against 1..2: 1 vs 2)
    ]


def test_one_replica_per_stage_only_moves_cuts_unless_workers_may_idle() -> None:
    straight = _tree((0, 1, 1), (2, 3, 1), (4, 5, 1))
    assert [_stages(t) for t in neighbours(straight, Moves(3, False), EVEN)] == [
        [(0, 0, 1), (1, 3, 1), (4, 5, 1)],
        [(0, 2, 1), (3, 3, 1), (4, 5, 1)],
        [(0, 1, 1), (2, 2, 1), (3, 5, 1)],
        [(0, 1, 1), (2, 4, 1), (5, 5, 1)],
    ]
    # with --fewer-workers, a merge may leave a worker idle and a split may use an idle one
    fewer = Moves(3, False, fewer_workers=True)
    assert [_stages(t) for t in neighbours(_tree((0, 3, 1), (4, 5, 1)), fewer, EVEN)] == [
        [(0, 1, 1), (2, 5, 1)],
        [(0, 2, 1), (3, 5, 1)],
        [(0, 4, 1), (5, 5, 1)],
        [(0, 5, 1)],
        [(0, 1, 1), (2, 3, 1), (4, 5, 1)],
        [(0, 3, 1), (4, 4, 1), (5, 5, 1)],
    ]


def test_idle_workers_take_or_give_replicas_only_with_fewer_workers() -> None:
    tree = _tree((0, 5, 2))
    assert [_stages(t) for t in neighbours(tree, Moves(3, True), EVEN)] == [[(0, 2, 1), (3, 5, 1)]]
    assert [_stages(t) for t in neighbours(tree, Moves(3, True, fewer_workers=True), EVEN)] == [
        [(0, 2, 1), (3, 5, 1)],
        [(0, 5, 3)],
        [(0, 5, 1)],
    ]


def test_no_neighbour_has_more_stages_than_allowed() -> None:
    two = Moves(4, True, max_stages=2)
    found = [_stages(t) for t in neighbours(_tree((0, 2, 2), (3, 5, 2)), two, EVEN)]
    assert all(len(stages) <= 2 for stages in found)
    assert [(0, 5, 4)] in found


@pytest.mark.parametrize(
    ("layer_ms", "left", "right", "cut"),
    [
        (EVEN, 2, 1, 3),  # 4 layers on 2 replicas against 2 on one: 2 each
        (EVEN, 1, 1, 2),
        (EVEN, 1, 2, 1),
        ([10.0, 1.0, 1.0, 1.0, 1.0, 1.0], 1, 1, 0),  # the heavy first layer alone
        ([1.0, 1.0, 1.0, 1.0, 1.0, 10.0], 1, 1, 4),  # the heavy last layer alone
    ],
)
def test_a_split_balances_compute_per_replica(
    layer_ms: list[float], left: int, right: int, cut: int
) -> None:
    prefix = [0.0]
    for ms in layer_ms:
        prefix.append(prefix[-1] + ms)
    assert _balanced_cut(prefix, 0, 5, left, right) == cut


def _levels(tree: Tree) -> list[tuple[int, int, int, Stages]]:
    return [(n.first, n.last, n.replicas, _stages(n.inner)) for n in tree]


def test_the_neighbours_of_a_plan_of_two_levels() -> None:
    """2 servers of 2 workers: the outer cut moves and its stages' inner pipelines grow and
    shrink at that end (none may empty), then each server's own pipeline takes the edits of
    a one-level plan."""
    tree = (
        Node(0, 3, 1, (Node(0, 1, 1), Node(2, 3, 1))),
        Node(4, 5, 1, (Node(4, 5, 2),)),
    )
    assert [_levels(t) for t in neighbours(tree, Moves(2, True), EVEN)] == [
        [(0, 2, 1, [(0, 1, 1), (2, 2, 1)]), (3, 5, 1, [(3, 5, 2)])],  # the outer cut
        [(0, 4, 1, [(0, 1, 1), (2, 4, 1)]), (5, 5, 1, [(5, 5, 2)])],
        [(0, 3, 1, [(0, 0, 1), (1, 3, 1)]), (4, 5, 1, [(4, 5, 2)])],  # the first server's
        [(0, 3, 1, [(0, 2, 1), (3, 3, 1)]), (4, 5, 1, [(4, 5, 2)])],
        [(0, 3, 1, [(0, 3, 2)]), (4, 5, 1, [(4, 5, 2)])],
        [(0, 3, 1, [(0, 1, 1), (2, 3, 1)]), (4, 5, 1, [(4, 4, 1), (5, 5, 1)])],  # the second's
    ]


def test_servers_move_between_outer_stages_and_the_stage_count_is_the_runtimes() -> None:
    tree = (Node(0, 2, 2, (Node(0, 2, 2),)), Node(3, 5, 1, (Node(3, 4, 1), Node(5, 5, 1))))
    # 3 stages at most: the first servers' pipeline may not split (it would make 4)
    assert [_levels(t) for t in neighbours(tree, Moves(2, True, max_stages=3), EVEN)] == [
        [(0, 0, 2, [(0, 0, 2)]), (1, 5, 1, [(1, 4, 1), (5, 5, 1)])],
        [(0, 1, 2, [(0, 1, 2)]), (2, 5, 1, [(2, 4, 1), (5, 5, 1)])],
        [(0, 3, 2, [(0, 3, 2)]), (4, 5, 1, [(4, 4, 1), (5, 5, 1)])],
        [(0, 2, 1, [(0, 2, 2)]), (3, 5, 2, [(3, 4, 1), (5, 5, 1)])],  # a server moved
        [(0, 2, 2, [(0, 2, 2)]), (3, 5, 1, [(3, 3, 1), (4, 5, 1)])],
        [(0, 2, 2, [(0, 2, 2)]), (3, 5, 1, [(3, 5, 2)])],
    ]


def _by_table(times: dict[tuple[tuple[int, int, int], ...], float], work: int = 1):
    """A made-up simulation: the listed plans' times (else 1000 ms), each costing ``work``."""
    calls: list[Stages] = []

    def simulate(tree: Tree) -> tuple[float | None, int]:
        calls.append(_stages(tree))
        return times.get(tuple(_stages(tree)), 1000.0), work

    return simulate, calls


def test_the_search_walks_to_the_fastest_neighbour_while_one_is_faster() -> None:
    start = _tree((0, 2, 2), (3, 5, 1))
    simulate, calls = _by_table(
        {
            ((0, 3, 2), (4, 5, 1)): 90.0,
            ((0, 4, 2), (5, 5, 1)): 80.0,  # the fastest neighbour of the start
            ((0, 5, 3),): 85.0,
            ((0, 4, 1), (5, 5, 2)): 70.0,  # a neighbour of that one
        }
    )
    found = refine(start, 100.0, simulate=simulate, moves=Moves(3, True), layer_ms=EVEN, budget=99)
    assert _stages(found.tree) == [(0, 4, 1), (5, 5, 2)]
    assert (found.time_ms, found.start_ms, found.budget_spent) == (70.0, 100.0, False)
    # every plan simulated once: the start's 7 neighbours, then those of the 2 steps not
    # seen before
    assert found.tried == len(calls) == len({tuple(c) for c in calls})
    assert calls[:7] == [_stages(t) for t in neighbours(start, Moves(3, True), EVEN)]


def test_the_start_stays_when_no_neighbour_is_faster() -> None:
    start = _tree((0, 2, 2), (3, 5, 1))
    simulate, calls = _by_table({})
    found = refine(start, 100.0, simulate=simulate, moves=Moves(3, True), layer_ms=EVEN, budget=99)
    assert (found.tree, found.time_ms, found.tried, found.budget_spent) == (start, 100.0, 7, False)


def test_plans_that_do_not_fit_are_skipped() -> None:
    start = _tree((0, 2, 2), (3, 5, 1))

    def simulate(tree: Tree) -> tuple[float | None, int]:
        if len(tree) == 1:
            return None, 0  # the merged plan does not fit
        return (90.0, 1) if _stages(tree) == [(0, 3, 2), (4, 5, 1)] else (1000.0, 1)

    found = refine(start, 100.0, simulate=simulate, moves=Moves(3, True), layer_ms=EVEN, budget=99)
    assert (_stages(found.tree), found.time_ms) == ([(0, 3, 2), (4, 5, 1)], 90.0)
    # tried, but not simulated: the summary does not count them as simulated
    assert (found.tried, found.simulated) == (found.simulated + 1, found.simulated)


def test_the_search_stops_at_its_budget_with_the_fastest_seen() -> None:
    start = _tree((0, 2, 2), (3, 5, 1))
    simulate, calls = _by_table({((0, 1, 2), (2, 5, 1)): 90.0}, work=10)
    # 3 simulations of 10 spend a budget of 25: the second found 90 ms
    found = refine(start, 100.0, simulate=simulate, moves=Moves(3, True), layer_ms=EVEN, budget=25)
    assert (_stages(found.tree), found.time_ms, found.tried) == ([(0, 1, 2), (2, 5, 1)], 90.0, 3)
    assert found.budget_spent


def test_a_neighbour_whose_bound_cannot_win_is_not_simulated() -> None:
    """The walk of the first test, with every plan's lower bound 81 ms but the two it steps
    to: the start's neighbours are simulated until the 80 ms one, and after it every plan
    bounded at 81 ms is ruled out; same walk, 5 simulations instead of 11."""
    start = _tree((0, 2, 2), (3, 5, 1))
    times = {
        ((0, 3, 2), (4, 5, 1)): 90.0,
        ((0, 4, 2), (5, 5, 1)): 80.0,
        ((0, 5, 3),): 85.0,
        ((0, 4, 1), (5, 5, 2)): 70.0,
    }
    steps = {((0, 4, 2), (5, 5, 1)), ((0, 4, 1), (5, 5, 2))}

    def bound(tree: Tree) -> float:
        return 0.0 if tuple(_stages(tree)) in steps else 81.0

    simulate, calls = _by_table(times)
    found = refine(
        start,
        100.0,
        simulate=simulate,
        moves=Moves(3, True),
        layer_ms=EVEN,
        budget=99,
        bound=bound,
        slack=0.0,
    )
    unbounded, all_calls = _by_table(times)
    walked = refine(
        start, 100.0, simulate=unbounded, moves=Moves(3, True), layer_ms=EVEN, budget=99
    )
    assert (found.tree, found.time_ms) == (walked.tree, walked.time_ms)
    assert found.tried == walked.tried == len(all_calls) == 11
    assert calls == [
        [(0, 0, 2), (1, 5, 1)],
        [(0, 1, 2), (2, 5, 1)],
        [(0, 3, 2), (4, 5, 1)],
        [(0, 4, 2), (5, 5, 1)],  # 80 ms: the rest of the start's neighbours are ruled out
        [(0, 4, 1), (5, 5, 2)],  # the only neighbour of the step bounded below 80 ms
    ]
    assert (found.simulated, found.ruled_out) == (5, 6)
    assert walked.simulated == 11


@pytest.fixture(scope="module")
def vgg16() -> Profile:
    return import_pipedream_graph(VGG16)


# (topology, the simulated time the search starts from, the stages it ends with, their time)
WALKS = {
    # 10 workers at 1 GB/s: the dynamic program's 6-3-1 split simulates at 148.5 ms per
    # minibatch; merging its first two stages gives a 9-1 split, whose cut then moves seven
    # layers earlier: 81.2 ms
    "10 workers": (
        Topology.single_level(10, 1e9),
        148.508,
        [("node1", "node25", 9), ("node26", "node41", 1)],
        81.190,
    ),
    # 4 servers of 4 workers (10 GB/s inside, 1 GB/s between): the dynamic program runs the
    # first 32 layers on 3 servers and a pipeline of 3 stages on the fourth, one of them a
    # layer without compute on 2 workers (64.8 ms); the search ends with the last 16 layers
    # on the fourth server alone (55.1 ms)
    "4 servers of 4": (
        Topology((Level("gpus", 4, 1e10), Level("servers", 4, 1e9))),
        64.809,
        [("node1", "node25", 12), ("node26", "node41", 4)],
        55.089,
    ),
}


@pytest.mark.parametrize("cluster", sorted(WALKS))
def test_the_planner_finds_a_faster_plan_beside_the_dynamic_programs(
    vgg16: Profile, cluster: str
) -> None:
    topology, start_ms, stages, time_ms = WALKS[cluster]
    result = plan_profile(vgg16, topology=topology, options=PlanOptions())
    assert result.refined is not None
    assert result.refined.start_ms == pytest.approx(start_ms, abs=1e-3)
    plan = result.plan
    assert [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages] == stages
    assert plan.stages[-1].ranks[-1] == topology.num_workers - 1  # the last worker's stage
    assert plan.prediction is not None and plan.prediction.method == "simulated"
    assert plan.prediction.time_per_minibatch_ms == pytest.approx(time_ms, abs=1e-3)
    assert result.refined.time_ms == plan.prediction.time_per_minibatch_ms


def test_the_search_leaves_the_original_arithmetic_alone(vgg16: Profile) -> None:
    original = PlanOptions(schedule="1f1b", cost_model="pipedream")
    flat = Topology.single_level(4, 1e9)
    assert plan_profile(vgg16, topology=flat, options=original).refined is None


def test_no_search_keeps_the_fastest_of_the_three_and_says_nothing(
    vgg16: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = PlanOptions(search=False)
    result = plan_profile(vgg16, topology=Topology.single_level(10, 1e9), options=options)
    assert result.refined is None
    assert [s.replicas for s in result.plan.stages] == [6, 3, 1]
    assert result.plan.prediction is not None
    assert result.plan.prediction.time_per_minibatch_ms == pytest.approx(148.508, abs=1e-3)
    profile = tmp_path / "vgg16.yaml"
    save_profile(vgg16, profile)
    argv = ["plan", str(profile), "--workers", "10", "-o", str(tmp_path / "plan.yaml")]
    assert main([*argv, "--no-search"]) == 0
    out = capsys.readouterr().out
    assert "predicted time per minibatch: 148.508 ms" in out and "local search" not in out
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "predicted time per minibatch: 81.190 ms" in out
    assert (
        "local search by simulation: 54 plans tried (18 simulated, 36 ruled out by a lower "
        "bound), from 148.508 ms (the fastest of the candidates simulated before it) to "
        "this plan's 81.190 ms" in out
    )
