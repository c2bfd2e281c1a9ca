"""Precisions (``pipedream.precision``): a model in bfloat16 or float64 trains across stages
as in one process, under ``--precision bf16`` a stage sends what autocast made, and a profile
measures (and a plan records) the precision a run trains in."""

from __future__ import annotations

import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.errors import FormatError
from pipedream.formats.plan import Plan, StagePlan
from pipedream.formats.profile import LayerProfile, Profile
from pipedream.formats.topology import Topology
from pipedream.optimizer.planner import PlanOptions, make_plan
from pipedream.precision import autocast, loss_input
from pipedream.profiler.command import profile_workload
from pipedream.runtime.stage_layout import build_stage_module
from pipedream.runtime.stage_worker import StageWorker, WorkerConfig
from pipedream.schedules import Op, PipelineSpec, build_tables
from pipedream.workload import load_workload

from plain_loop import plain_loop
from reference_run import reference_layout_weights
from runs import max_rel_diff

STAGES = [["0", "1"], ["2", "3", "4"]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_a_model_in_its_own_dtype_trains_across_stages_as_in_one_process(dtype: str) -> None:
    """Every stage's outputs used to be cast to float32 before they were sent, so the next
    stage of a bfloat16 or float64 model failed on its first forward (a dtype mismatch)."""
    args = {"dtype": dtype}
    got = reference_layout_weights(
        "dtype_model:build", args, STAGES, schedule="1f1b", microbatches=2, steps=3,
        microbatch_size=4,
    )  # fmt: skip
    want, _ = plain_loop("dtype_model:build", args, steps=3, microbatches=2, microbatch_size=4)
    assert {tensor.dtype for tensor in got.values()} == {getattr(torch, dtype)}
    assert max_rel_diff(got, want) == 0.0


def test_an_fp32_model_under_bf16_trains_across_stages_as_the_plain_autocast_loop() -> None:
    """The weights stay fp32, and two stages end on the weights of a plain loop that runs the
    same microbatches under autocast. (Casting the bfloat16 messages to fp32, as stages did,
    gives the same numbers here: bfloat16 -> fp32 -> bfloat16 is exact; the test below checks
    what is sent.)"""
    args = {"dtype": "float32"}
    got = reference_layout_weights(
        "dtype_model:build", args, STAGES, schedule="1f1b", microbatches=2, steps=3,
        microbatch_size=4, precision="bf16",
    )  # fmt: skip
    want, _ = plain_loop(
        "dtype_model:build", args, steps=3, microbatches=2, microbatch_size=4, precision="bf16"
    )
    assert {tensor.dtype for tensor in got.values()} == {torch.float32}
    assert max_rel_diff(got, want) == 0.0


@pytest.mark.parametrize(("precision", "sent"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_a_stage_sends_its_output_in_the_dtype_it_made(precision: str, sent: torch.dtype) -> None:
    """Under ``bf16`` a stage ending in a Linear sends bfloat16: half the bytes of fp32 (every
    output used to be cast to fp32 first)."""
    workload = load_workload("dtype_model:build", {"dtype": "float32"}, microbatch_size=4)
    table = build_tables(PipelineSpec("1f1b", ((0,), (1,)), 1, 1))[0]
    worker = StageWorker(
        WorkerConfig(0, 2, 1, precision=precision),
        build_stage_module(workload.model, ["0"]),
        table,
        optimizer_factory=workload.optimizer,
        loss_fn=workload.loss_fn,
        data=MicrobatchStream(workload.dataset, 4, 0),
    )
    forward = next(action for action in table if action.op is Op.FORWARD)
    (output,) = worker.forward(forward, None)
    assert output.dtype == sent and output.shape == (4, 16)


def test_the_loss_takes_fp32_where_autocast_lowered_the_output() -> None:
    cpu = torch.device("cpu")
    with autocast("bf16", cpu):
        lowered = torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3))
    assert lowered.dtype == torch.bfloat16
    assert loss_input("bf16", lowered).dtype == torch.float32
    own = torch.ones(2, dtype=torch.bfloat16)  # a bfloat16 model's output under fp32
    assert loss_input("fp32", own).dtype == torch.bfloat16
    assert loss_input("fp32", own.double()).dtype == torch.float64


# -- the profile in a precision ---------------------------------------------------------------
# dtype_model in float32, microbatches of 4: Linear(8, 16), ReLU, Linear(16, 16), ReLU,
# Linear(16, 1). Under bf16 a Linear's output is bfloat16 (half the bytes), and it keeps the
# bfloat16 copies autocast made of its input (where that was float32) and of its weight for
# its backward: layer 0 keeps 4 x 8 x 2 + 16 x 8 x 2 = 320 bytes, where in fp32 it keeps only
# its input and weight (counted elsewhere: 0).
FP32 = {"output": [256, 256, 256, 256, 16], "saved": [0, 256, 0, 256, 0]}
BF16 = {"output": [128, 128, 128, 128, 8], "saved": [320, 128, 512, 128, 32]}


@pytest.mark.parametrize(("precision", "want"), [("fp32", FP32), ("bf16", BF16)])
@pytest.mark.parametrize("depth", [None, 1], ids=["children", "traced"])
def test_the_profile_measures_bytes_in_its_precision(
    precision: str, want: dict[str, list[int]], depth: int | None
) -> None:
    profile = profile_workload(
        "dtype_model:build", {"dtype": "float32"}, warmup=0, repeats=1, precision=precision,
        depth=depth,
    )  # fmt: skip
    assert profile.precision == precision and profile.dtype == "float32"
    assert [layer.output_bytes for layer in profile.layers] == want["output"]
    assert [layer.saved_bytes for layer in profile.layers] == want["saved"]
    if depth is not None:  # traced: what crosses each cut, as the stages send it
        assert profile.cut_bytes == tuple(want["output"][:-1])
        assert profile.values is not None
        assert [(v.made_by, v.bytes) for v in profile.values] == [
            (None, 128),
            *(zip("0123", want["output"][:-1])),
        ]


def test_profiles_and_plans_record_their_precision_and_refuse_an_unknown_one() -> None:
    layer = LayerProfile("0", "Linear", 1.0, 1.0, 8, 8)
    profile = Profile("toy", 4, "cpu", "float32", (layer,), precision="bf16")
    assert profile.to_dict()["precision"] == "bf16"
    assert "precision" not in Profile("toy", 4, "cpu", "float32", (layer,)).to_dict()
    assert Profile.from_dict(profile.to_dict()) == profile
    with pytest.raises(FormatError, match=r"precision: unknown precision 'fp8'.*fp32, bf16, fp16"):
        Profile.from_dict({**profile.to_dict(), "precision": "fp8"})
    made = make_plan(profile, topology=Topology.single_level(1), options=PlanOptions())
    assert made.precision == "bf16"
    plan = Plan("toy", "1f1b", 4, 1, 1, (StagePlan("0", "0", 1, (0,)),), precision="bf16")
    assert plan.to_dict()["precision"] == "bf16"
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(FormatError, match=r"precision: unknown precision 'half'"):
        Plan.from_dict({**plan.to_dict(), "precision": "half"})


def test_a_layer_without_parameters_is_measured_on_its_inputs_device() -> None:
    """A softmax's autocast follows its input's device (a CUDA input under CUDA's autocast);
    the profiler took the device of the layer's parameters, the CPU for one without any."""
    from pipedream.profiler.measure import _device_of

    on_meta = torch.ones(2, 3, device="meta")
    assert _device_of(torch.nn.Softmax(-1), on_meta) == torch.device("meta")
    assert _device_of(torch.nn.Softmax(-1)) == torch.device("cpu")
    assert _device_of(torch.nn.Linear(2, 2, device="meta"), (torch.ones(1),)).type == "cpu"


def test_a_tied_gpt2_in_bf16_trains_across_stages_as_the_plain_autocast_loop() -> None:
    """Tied embedding and head in different stages, split backwards (zb-h1), recomputation and
    a learning-rate warm-up, all under bf16: the plain autocast loop's weights."""
    pytest.importorskip("transformers")
    args = {"config": "gpt2", "layers": "2", "dim": "32", "heads": "4", "vocab": "64",
            "seq": "16", "samples": "64", "warmup": "2", "decay": "4"}  # fmt: skip
    layers = ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0",
              "transformer.h.1", "transformer.ln_f", "lm_head"]  # fmt: skip
    got = reference_layout_weights(
        "hf-lm", args, [layers[:4], layers[4:]], schedule="zb-h1", microbatches=2, steps=4,
        microbatch_size=4, layers=layers, recompute=True, precision="bf16",
    )  # fmt: skip
    want, _ = plain_loop(
        "hf-lm", args, steps=4, microbatches=2, microbatch_size=4, precision="bf16"
    )
    assert max_rel_diff(got, want) < 1e-6
