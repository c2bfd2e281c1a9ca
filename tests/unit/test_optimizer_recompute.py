"""Planning a run that recomputes activations in backward (``plan --recompute``, a plan's
``recompute: true``): each backward runs its layers' forward again, and a stage keeps only its
inputs per microbatch in flight plus the activations of the one microbatch being recomputed.
Before, ``plan`` had no such option and ``simulate`` ignored the plan's field: a model that
fits only with recomputation was refused, and its time was predicted without the second
forward."""

from __future__ import annotations

import dataclasses

import pytest

from pipedream.cli import main
from pipedream.errors import PlanningError
from pipedream.formats import (
    LayerProfile,
    Plan,
    Profile,
    StagePlan,
    Topology,
    load_plan,
    save_profile,
)
from pipedream.optimizer.cost_model import LayerCosts
from pipedream.optimizer.memory import MemoryModel
from pipedream.optimizer.planner import PlanOptions, make_plan
from pipedream.optimizer.simulator import stage_work
from pipedream.optimizer.table_memory import worker_memory

MB = 1_000_000

# four layers: forward 1, 2, 3, 4 ms, backward twice that; 1 MB out of each, 10 MB saved
PROFILE = Profile(
    workload="toy",
    microbatch_size=8,
    device="cpu",
    dtype="float32",
    layers=tuple(
        LayerProfile(f"l{i}", "Linear", float(i + 1), 2.0 * (i + 1), MB, MB, saved_bytes=10 * MB)
        for i in range(4)
    ),
)


def test_each_layer_pays_its_forward_twice() -> None:
    assert LayerCosts.from_profile(PROFILE).compute_ms == (3.0, 6.0, 9.0, 12.0)
    assert LayerCosts.from_profile(PROFILE, recompute=True).compute_ms == (4.0, 8.0, 12.0, 16.0)


def test_a_stage_holds_its_inputs_in_flight_and_one_microbatchs_activations() -> None:
    memory = MemoryModel("1f1b", 4)  # the first of 4 stages holds 4 microbatches in flight
    for recompute, activations in ((False, 4 * 20 * MB), (True, 0 + 20 * MB)):
        costs = LayerCosts.from_profile(PROFILE, recompute=recompute)
        first = memory.stage_bytes(costs, first=0, last=1, workers_from=4, replicas=1)
        # weights and gradients (2 x 2 MB), no optimizer state
        assert first == 4 * MB + activations
    # a later stage keeps the 1 MB it received per microbatch in flight (3, from stage 1 on)
    costs = LayerCosts.from_profile(PROFILE, recompute=True)
    later = memory.stage_bytes(costs, first=2, last=2, workers_from=2, replicas=1)
    assert later == 2 * MB + 2 * 1 * MB + 10 * MB


def test_a_plan_that_fits_only_recomputing() -> None:
    topology = Topology.single_level(2)
    # the leanest split stores 36 MB on a worker (l1..l3: 6 MB of weights and gradients and one
    # microbatch's 30 MB); recomputing, 25 MB (l2..l3: 4 + its 1 MB input + 20)
    options = PlanOptions(schedule="1f1b", microbatches=2, straight=True, memory=30 * MB)
    with pytest.raises(PlanningError, match="no partition of 4 layers over 2 workers fits in"):
        make_plan(PROFILE, topology=topology, options=options)
    plan = make_plan(
        PROFILE, topology=topology, options=dataclasses.replace(options, recompute=True)
    )
    assert plan.recompute
    assert plan.prediction is not None
    assert plan.prediction.memory_bytes == (24 * MB, 25 * MB)
    assert [(s.first_layer, s.last_layer) for s in plan.stages] == [("l0", "l1"), ("l2", "l3")]


def test_the_simulation_runs_the_forward_again_in_backward() -> None:
    plan = Plan(
        "toy", "zb-h1", 8, 2, 2, (StagePlan("l0", "l1", 1, (0,)), StagePlan("l2", "l3", 1, (1,)))
    )
    plain, again = (
        stage_work(plan, PROFILE),
        stage_work(dataclasses.replace(plan, recompute=True), PROFILE),
    )
    assert [w.backward_ms for w in plain] == [6.0, 14.0]
    assert [w.backward_ms for w in again] == [9.0, 21.0]  # + the forwards, 3 and 7 ms
    # split: I is half of the backward and the recomputed forward, W the other half
    assert [w.input_share for w in again] == pytest.approx([(3 + 3) / 9, (7 + 7) / 21])
    assert [w.forward_ms for w in again] == [w.forward_ms for w in plain]


def test_the_tables_memory_of_a_recomputing_plan() -> None:
    """1f1b on 2 stages, 2 microbatches: rank 0 runs F0 F1 B0 B1. Plain, it holds both
    microbatches' 20 MB; recomputing, their inputs (the data loader's: nothing counted) and,
    while a backward runs, that microbatch's 20 MB."""
    plan = Plan(
        "toy", "1f1b", 8, 2, 2, (StagePlan("l0", "l1", 1, (0,)), StagePlan("l2", "l3", 1, (1,)))
    )
    spans = [(0, 1), (2, 3)]
    weights = 2 * 2 * MB
    plain = worker_memory(plan, LayerCosts.from_profile(PROFILE), spans)
    again = worker_memory(plan, LayerCosts.from_profile(PROFILE, recompute=True), spans)
    assert plain == {0: weights + 2 * 20 * MB, 1: weights + 1 * 20 * MB}
    # stage 0 keeps no input, stage 1 its 1 MB; each backward recomputes its 20 MB
    assert again == {0: weights + 20 * MB, 1: weights + 1 * MB + 20 * MB}


def test_plan_recompute_on_the_command_line(tmp_path, capsys) -> None:
    save_profile(PROFILE, tmp_path / "profile.yaml")
    argv = ["plan", str(tmp_path / "profile.yaml"), "--workers", "2", "--schedule", "1f1b"]
    assert main([*argv, "--straight", "--recompute", "-o", str(tmp_path / "plan.yaml")]) == 0
    assert load_plan(tmp_path / "plan.yaml").recompute


def test_a_run_that_recomputes_says_its_plan_did_not(tmp_path) -> None:
    """The summary set a recomputing run's time beside a prediction made without it."""
    from pipedream.formats import Prediction, save_plan

    from launching import run_main

    prediction = Prediction(1.0, 1000.0, 0, (1.0,), (0.0,), 1.0)
    plan = Plan(
        "mlp",
        "1f1b",
        4,
        1,
        1,
        (StagePlan("0", "8", 1, (0,)),),
        workload_args={"samples": "64"},
        prediction=prediction,
    )
    for recompute, name in ((False, "plain"), (True, "recomputing")):
        save_plan(dataclasses.replace(plan, recompute=recompute), tmp_path / f"{name}.yaml")
    note = "(made without recomputation: plan --recompute predicts this run)"
    for name, says in (("plain", True), ("recomputing", False)):
        result = run_main(
            "train", str(tmp_path / f"{name}.yaml"), "--steps", "2", "--recompute",
            "--run-dir", str(tmp_path / name), "--no-progress",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        assert (note in result.stderr) is says, result.stderr[-2000:]


def test_a_split_backward_keeps_the_recomputed_graph_until_w() -> None:
    """zb-h1 on 2 stages: rank 1 runs F0 I0 F1 I1 W0 W1. Its I recomputes the 20 MB and keeps
    them, with what it leaves for W (counted as the activations once more, as without
    recomputing), until W: recomputing only adds the 1 MB inputs (82 MB at I1, 80 without).
    It was counted as 1 MB + 20 MB per microbatch waiting for W."""
    plan = Plan(
        "toy", "zb-h1", 8, 2, 2, (StagePlan("l0", "l1", 1, (0,)), StagePlan("l2", "l3", 1, (1,)))
    )
    spans, weights = [(0, 1), (2, 3)], 2 * 2 * MB
    plain = worker_memory(plan, LayerCosts.from_profile(PROFILE), spans)
    again = worker_memory(plan, LayerCosts.from_profile(PROFILE, recompute=True), spans)
    assert plain == {0: weights + 60 * MB, 1: weights + 80 * MB}  # F0 F1 I0: 3 x 20 on rank 0
    assert again == {0: weights + 40 * MB, 1: weights + 82 * MB}


def test_the_first_stage_keeps_its_data_input_in_flight() -> None:
    """The profile's ``input_bytes``: one microbatch of the model's input, which the first
    stage keeps per microbatch in flight when it recomputes (it counted 0 before)."""
    images = dataclasses.replace(PROFILE, input_bytes=3 * MB)
    costs = LayerCosts.from_profile(images, recompute=True)
    memory = MemoryModel("1f1b", 4)
    first = memory.stage_bytes(costs, first=0, last=1, workers_from=4, replicas=1)
    assert first == 4 * MB + 4 * 3 * MB + 20 * MB  # 4 microbatches' inputs in flight
    plain = LayerCosts.from_profile(images)  # without recomputing: in its saved activations
    assert memory.stage_bytes(plain, first=0, last=1, workers_from=4, replicas=1) == (
        4 * MB + 4 * 20 * MB
    )
    plan = Plan(
        "toy", "1f1b", 8, 2, 2, (StagePlan("l0", "l1", 1, (0,)), StagePlan("l2", "l3", 1, (1,)))
    )
    held = worker_memory(plan, costs, [(0, 1), (2, 3)])
    assert held == {0: 4 * MB + 2 * 3 * MB + 20 * MB, 1: 4 * MB + 1 * MB + 20 * MB}
    # the dynamic program sees it too: 26 MB on the first stage no longer fits in 25
    options = PlanOptions(
        schedule="1f1b", microbatches=2, straight=True, memory=25 * MB, recompute=True
    )
    topology = Topology.single_level(2)
    assert make_plan(PROFILE, topology=topology, options=options).prediction is not None
    with pytest.raises(PlanningError, match="no partition of 4 layers over 2 workers fits in"):
        make_plan(images, topology=topology, options=options)


def test_a_profile_records_its_input_bytes(tmp_path) -> None:
    from pipedream.formats import load_profile

    assert (
        main(["profile", "mlp", "--warmup", "0", "--repeats", "1", "-o", str(tmp_path / "p")]) == 0
    )
    profile = load_profile(tmp_path / "p")
    assert profile.input_bytes == profile.microbatch_size * 16 * 4  # float32 rows of width 16
    assert "input_bytes: " in (tmp_path / "p").read_text()
