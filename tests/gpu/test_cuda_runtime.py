"""The runtime on CUDA: one stage against a plain PyTorch loop on the same GPU, its steady state
without a host synchronisation (counted by PyTorch's GPU trace), and the schedules' oracles,
bf16, recomputation, checkpoint and resume with 2-4 ranks sharing one GPU (``--device
cuda-shared``, messages over gloo through pinned host memory), and a bf16 profile's plan.

Tolerances. With ``--deterministic`` on both sides one stage computes what the plain loop
computes, kernel for kernel: fp32 weights agree to 1e-5 (relative, per tensor). The schedules
on the GPU are compared with oracles computed on the CPU, whose kernels sum in another order:
1e-4. bf16 (autocast) is compared by its loss curve: within 2% of the plain loop's at every
step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.errors import WorkloadError
from pipedream.formats.profile import load_profile
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.runtime.train import make_deterministic
from pipedream.workload import load_workload
from pipedream.workloads.hf_lm import check_transformers_version

from counting_syncs import NONE, count_syncs
from launching import launch, run_main, straight_plan, write_plan
from oracles import stale_oracle
from plain_loop import plain_loop
from runs import even_groups, max_rel_diff, train_and_load

GPT = {"layers": "2", "dim": "64", "heads": "4", "seq": "32", "samples": "512"}  # Adam
MLP = {"layers": "5", "width": "16", "lr": "0.2"}
SHARED = ("--device", "cuda-shared", "--deterministic")


def _one_stage_plan(tmp: Path) -> Path:
    layers = ["embed", "h0", "h1", "norm", "head"]
    plan = straight_plan(
        "gpt", [layers], microbatch_size=8, microbatches=2, schedule="1f1b", workload_args=GPT
    )
    return write_plan(plan, tmp / "plan.yaml")


def _one_stage(tmp: Path, *, steps: int, precision: str) -> tuple[dict, list[float]]:
    run = tmp / f"run-{precision}"
    result = launch(
        _one_stage_plan(tmp),
        "--steps",
        str(steps),
        "--run-dir",
        str(run),
        "--device",
        "cuda",
        "--deterministic",
        "--precision",
        precision,
        "--no-progress",
        "--timeout",
        "120",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 nccl process, one GPU each" in result.stderr
    lines = (run / "metrics.jsonl").read_text().splitlines()
    state = load_full_state_dict(run / "checkpoints" / f"step-{steps:06d}")
    return state, [json.loads(line)["loss"] for line in lines]


def test_one_stage_equals_the_plain_loop_in_fp32(tmp_path: Path) -> None:
    steps = 10
    got, losses = _one_stage(tmp_path, steps=steps, precision="fp32")
    make_deterministic()
    want, want_losses = plain_loop(
        "gpt", GPT, steps=steps, microbatches=2, microbatch_size=8, device="cuda"
    )
    assert max_rel_diff(got, want) < 1e-5
    assert losses == pytest.approx(want_losses, rel=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_stage_follows_the_plain_loop_in_half_precision(tmp_path: Path, precision: str) -> None:
    """bf16, and fp16 with its loss scale against a plain loop's ``GradScaler``."""
    steps = 10
    _, losses = _one_stage(tmp_path, steps=steps, precision=precision)
    make_deterministic()
    _, want_losses = plain_loop(
        "gpt",
        GPT,
        steps=steps,
        microbatches=2,
        microbatch_size=8,
        device="cuda",
        precision=precision,
    )
    assert losses == pytest.approx(want_losses, rel=2e-2)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("clip", [(), ("--clip-grad-norm", "0.5")], ids=["", "clipped"])
def test_one_stage_never_waits_for_the_gpu_between_updates(
    tmp_path: Path, clip: tuple[str, ...]
) -> None:
    """No host synchronisation with the GPU in the steady state, so the host queues minibatches
    ahead of the GPU as a plain loop does: between two updates of a lone stage (bf16, two
    microbatches a minibatch) PyTorch's GPU trace reports no device, stream or event
    synchronisation, also where it clips its gradients (the norm and the factor stay on the
    GPU, the norms are read with the losses). A stream synchronisation is also what every
    blocking copy between host and GPU does (``.item()``, ``.tolist()``, a ``.to()`` without
    ``non_blocking``). The end of the run synchronises (its one read of the losses, the
    checkpoint), which shows the counting works."""
    steps = 12  # fewer than GPU_READ_EVERY: the losses are read once, at the end
    result, (rank,) = count_syncs(
        tmp_path,
        _one_stage_plan(tmp_path),
        *("--steps", str(steps), "--run-dir", str(tmp_path / "run"), "--device", "cuda"),
        *("--precision", "bf16", "--no-progress", "--timeout", "60", *clip),
        nproc=1,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert rank.between_updates == [NONE] * (steps - 1)
    assert rank.after_last_update["stream"] > 0


def _rule(schedule: str, num_stages: int):
    if schedule == "pipedream":
        return lambda t, s: max(0, t - (num_stages - 1 - s))
    if schedule == "2bw":
        return lambda t, s: max(0, t - 1)
    return lambda t, s: t


@pytest.mark.parametrize(
    ("schedule", "num_stages", "m"),
    [("pipedream", 3, 1), ("2bw", 2, 2), ("1f1b", 4, 3), ("gpipe", 2, 2), ("zb-h1", 3, 4)],
)
def test_schedules_on_a_shared_gpu_equal_their_rules(
    tmp_path: Path, schedule: str, num_stages: int, m: int
) -> None:
    names = [n for n, _ in load_workload("mlp", MLP).model.named_children()]
    stages = even_groups(names, num_stages)
    steps = 6
    got = train_and_load(
        tmp_path,
        stages,
        steps=steps,
        schedule=schedule,
        microbatches=m,
        workload_args=MLP,
        extra=SHARED,
    )
    workload = load_workload("mlp", MLP)
    data = MicrobatchStream(workload.dataset, 8, 0)
    want = stale_oracle(
        workload.model,
        stages,
        num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
        loss_fn=workload.loss_fn,
        staleness=_rule(schedule, num_stages),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.2),
    )
    assert max_rel_diff(got, want) < 1e-4


def test_recompute_bf16_replicas_and_resume_on_a_shared_gpu(tmp_path: Path) -> None:
    """Recomputation changes nothing; a run resumed from its checkpoint equals the
    uninterrupted one; bf16 with a replicated stage trains (4 ranks on one GPU)."""
    names = [n for n, _ in load_workload("mlp", MLP).model.named_children()]
    stages = even_groups(names, 2)
    common = {"schedule": "1f1b", "microbatches": 2, "workload_args": MLP}
    plain = train_and_load(
        tmp_path,
        stages,
        steps=8,
        name="plain",
        extra=(*SHARED, "--checkpoint-every", "4"),
        **common,
    )
    again = train_and_load(
        tmp_path,
        stages,
        steps=8,
        name="recompute",
        extra=(*SHARED, "--checkpoint-every", "4", "--recompute"),
        **common,
    )
    assert max_rel_diff(again, plain) < 1e-6
    resumed = train_and_load(
        tmp_path,
        stages,
        steps=8,
        name="plain",
        extra=(
            *SHARED,
            "--checkpoint-every",
            "4",
            "--resume",
            str(tmp_path / "plain" / "checkpoints" / "step-000004"),
        ),
        **common,
    )
    assert max_rel_diff(resumed, plain) == 0.0
    bf16 = train_and_load(
        tmp_path,
        stages,
        steps=8,
        name="bf16",
        replicas=[2, 2],
        extra=(*SHARED, "--precision", "bf16"),
        **common,
    )
    assert all(torch.isfinite(v).all() for v in bf16.values())


@pytest.mark.parametrize("clip", [None, 0.05], ids=["", "clipped"])
def test_tied_gpt2_on_a_shared_gpu_equals_the_plain_loop(
    tmp_path: Path, clip: float | None
) -> None:
    """A Hugging Face GPT-2 whose head reuses its embedding, in 2 stages on one GPU; clipped,
    the gradient norm's allreduce (of a CUDA tensor, on gloo) and the tied gradient's share in
    it."""
    transformers = pytest.importorskip("transformers")
    try:  # an image's own transformers may be older than pipedream takes: skipped, saying why
        check_transformers_version(transformers.__version__, torch.__version__)
    except WorkloadError as exc:
        pytest.skip(str(exc))
    args = {
        "config": "gpt2",
        "layers": "2",
        "dim": "32",
        "heads": "4",
        "vocab": "64",
        "seq": "16",
        "samples": "128",
        "optimizer": "sgd",
        "lr": "0.2",
    }
    layers = [
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]
    plan = straight_plan(
        "hf-lm",
        [layers[:4], layers[4:]],
        schedule="1f1b",
        microbatch_size=4,
        microbatches=2,
        workload_args=args,
    )
    plan["layers"] = layers
    run = tmp_path / "run"
    result = launch(
        write_plan(plan, tmp_path / "plan.yaml"),
        "--steps",
        "4",
        "--run-dir",
        str(run),
        *SHARED,
        "--no-progress",
        "--timeout",
        "120",
        *(("--clip-grad-norm", str(clip)) if clip is not None else ()),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharing 1 GPU (messages through host memory)" in result.stderr
    got = load_full_state_dict(run / "checkpoints" / "step-000004")
    make_deterministic()
    want, _ = plain_loop(
        "hf-lm", args, steps=4, microbatches=2, microbatch_size=4, device="cuda", clip=clip
    )
    assert max_rel_diff(got, want) < 1e-4


def test_a_bf16_profile_on_the_gpu_plans_and_trains_a_bf16_run(tmp_path: Path) -> None:
    """``profile --precision bf16`` on CUDA: the head's logits (a matmul's output) in half the
    bytes of fp32's, the residual stream in fp32; the plan records bf16, and its run on the GPU
    trains in it without being told."""
    args = [arg for key, value in GPT.items() for arg in ("--workload-arg", f"{key}={value}")]
    profiles = {}
    for precision in ("fp32", "bf16"):
        path = tmp_path / f"{precision}.yaml"
        made = run_main("profile", "gpt", *args, "--precision", precision, "-o", str(path))
        assert made.returncode == 0, made.stderr
        profiles[precision] = load_profile(path)
    assert profiles["bf16"].device == "cuda:0" and profiles["bf16"].precision == "bf16"
    sizes = {p: [layer.output_bytes for layer in profiles[p].layers] for p in profiles}
    assert sizes["bf16"][:-1] == sizes["fp32"][:-1] and sizes["bf16"][-1] * 2 == sizes["fp32"][-1]
    plan = tmp_path / "plan.yaml"
    planned = run_main("plan", str(tmp_path / "bf16.yaml"), "--workers", "2", "--straight",
                       "--schedule", "1f1b", "--microbatches", "2", "-o", str(plan))  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    result = launch(
        plan, "--steps", "4", "--run-dir", str(tmp_path / "run"), *SHARED, "--no-progress",
        "--timeout", "120", timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bf16 (autocast)" in result.stderr and "made from a profile in" not in result.stderr


def test_evaluations_during_a_run_on_a_shared_gpu_leave_its_training_alone(
    tmp_path: Path,
) -> None:
    """``--eval-every``: the reporting rank evaluates a copy of the whole model on its GPU
    while the other waits; the run ends on the weights of a run without evaluations."""
    stages = [["embed", "h0"], ["h1", "norm", "head"]]
    common = {"workload": "gpt", "schedule": "1f1b", "microbatches": 2, "workload_args": GPT}
    every = ("--checkpoint-every", "4")
    plain = train_and_load(
        tmp_path, stages, steps=8, name="plain", extra=(*SHARED, *every), **common
    )
    evaluated = train_and_load(
        tmp_path, stages, steps=8, name="evaluated", extra=(*SHARED, *every, "--eval-every", "4"),
        **common,
    )  # fmt: skip
    assert max_rel_diff(evaluated, plain) == 0.0
    lines = (tmp_path / "evaluated" / "evaluations.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [record["step"] for record in records] == [4, 8]
    on_cpu = run_main(
        "evaluate", str(tmp_path / "evaluated" / "checkpoints" / "step-000004"), "--json",
        "--device", "cpu",
    )  # fmt: skip
    assert on_cpu.returncode == 0, on_cpu.stderr
    want = json.loads(on_cpu.stdout)["test_loss"]
    assert abs(records[0]["test_loss"] - want) <= 1e-4 * abs(want)
