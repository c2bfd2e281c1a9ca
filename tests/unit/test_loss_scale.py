"""fp16 training (``--precision fp16``): a dynamic loss scale the same on every rank, as
``torch.amp.GradScaler`` keeps it in a plain loop. A pipeline skips the updates a plain loop
with ``GradScaler`` skips, on every stage at once, and ends on its weights."""

from __future__ import annotations

import pytest
import torch

from pipedream.errors import ScheduleError
from pipedream.runtime.loss_scale import LossScaler, LossScaleSettings
from pipedream.schedules import SCHEDULES, PipelineSpec

from plain_loop import plain_loop
from reference_run import reference_layout_weights
from runs import max_rel_diff

ARGS = {"dtype": "float32"}
"""``dtype_model``: its output gradients times 65536 overflow float16 in the first update."""
TWO = [["0", "1"], ["2", "3", "4"]]
FOUR = [["0"], ["1"], ["2"], ["3", "4"]]


def test_the_scale_halves_on_an_overflow_and_doubles_after_enough_good_updates() -> None:
    scaler = LossScaler(torch.device("cpu"), LossScaleSettings(init_scale=8.0, growth_interval=2))
    seen = []
    for found in (0.0, 0.0, 0.0, 1.0, 0.0):
        scaler.update(torch.tensor(found))
        seen.append(float(scaler.scale))
    assert seen == [8.0, 16.0, 16.0, 8.0, 8.0]
    grads = [torch.tensor([16.0, 8.0]), torch.tensor([float("inf")], dtype=torch.float32)]
    assert float(scaler.unscale(grads[:1])) == 0.0 and grads[0].tolist() == [2.0, 1.0]
    assert float(scaler.unscale(grads[1:])) == 1.0
    fresh = LossScaler(torch.device("cpu"))
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.state_dict() == {"scale": 8.0, "growth_tracker": 1}


@pytest.mark.parametrize(
    ("schedule", "stages", "placement", "clip"),
    [
        ("1f1b", TWO, None, None),
        ("gpipe", TWO, None, None),
        ("zb-h1", TWO, None, None),
        ("zbv", FOUR, [0, 1, 1, 0], None),
        ("1f1b", TWO, None, 0.5),
        ("pipedream", [["0", "1", "2", "3", "4"]], None, None),  # one stage: any schedule
    ],
)
def test_fp16_skips_what_grad_scaler_skips_and_ends_on_its_weights(
    schedule: str, stages: list[list[str]], placement: list[int] | None, clip: float | None
) -> None:
    m = 1 if schedule == "pipedream" else 2
    got = reference_layout_weights(
        "dtype_model:build", ARGS, stages, schedule=schedule, microbatches=m, steps=8,
        microbatch_size=4, placement=placement, precision="fp16", clip=clip,
    )  # fmt: skip
    scales: list[float] = []
    want, _ = plain_loop(
        "dtype_model:build", ARGS, steps=8, microbatches=m, microbatch_size=4,
        precision="fp16", clip=clip, scales=scales,
    )  # fmt: skip
    assert max_rel_diff(got, want) < 1e-6
    assert scales[0] == 2.0**15  # the first update overflowed, and was skipped


def test_a_pipeline_of_an_asynchronous_schedule_cannot_scale_its_loss() -> None:
    with pytest.raises(ScheduleError, match="schedule '2bw' updates each stage"):
        PipelineSpec("2bw", ((0,), (1,)), 2, 2, global_norm=True).validate()


def test_plan_of_an_fp16_profile_keeps_to_what_fp16_can_train() -> None:
    """A plan whose stages had 2, 1 and 1 replicas was written, and train refused it; auto
    left out the unequal ones and then found nothing, where straight pipelines fit."""
    from pipedream.errors import PlanningError
    from pipedream.formats.profile import LayerProfile, Profile
    from pipedream.formats.topology import Topology
    from pipedream.optimizer.planner import PlanOptions, plan_profile

    layers = tuple(  # slow layers with small weights, then fast ones with large weights
        LayerProfile(str(i), "Linear", *((10.0, 20.0, 1000, 1000) if i < 4 else
                                         (1.0, 2.0, 1000, 400_000_000)))
        for i in range(9)
    )  # fmt: skip
    profile = Profile("mlp", 4, "cpu", "float32", layers, precision="fp16")
    with pytest.raises(PlanningError, match=r"in fp16.*stages have \[2, 1, 1\]: plan with"):
        plan_profile(profile, topology=Topology.single_level(4), options=PlanOptions("1f1b"))
    with pytest.raises(PlanningError, match="schedule 'pipedream' updates each stage"):
        pipedream = PlanOptions("pipedream")
        plan_profile(profile, topology=Topology.single_level(4), options=pipedream)
    auto = PlanOptions("auto", microbatches=4)
    plan = plan_profile(profile, topology=Topology.single_level(5), options=auto).plan
    assert len({stage.replicas for stage in plan.stages}) == 1
    assert not SCHEDULES[plan.schedule].asynchronous


def test_the_default_schedule_of_an_fp16_profile_flushes() -> None:
    """``make_plan`` with the default options planned PipeDream's schedule, which fp16 refuses
    for a pipeline (only the command line chose 1f1b)."""
    from pipedream.formats.profile import LayerProfile, Profile
    from pipedream.formats.topology import Topology
    from pipedream.optimizer.planner import PlanOptions, make_plan

    layers = tuple(LayerProfile(str(i), "Linear", 1.0, 2.0, 1000, 1000) for i in range(4))
    for precision, schedule in (("fp16", "1f1b"), ("bf16", "pipedream")):
        profile = Profile("mlp", 4, "cpu", "float32", layers, precision=precision)
        plan = make_plan(profile, topology=Topology.single_level(2), options=PlanOptions())
        assert plan.schedule == schedule
