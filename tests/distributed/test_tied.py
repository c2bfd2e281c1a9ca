"""Tied weights across stages on gloo: the ``gpt`` model whose head reuses its token embedding
(``tie=true``), the embedding on the first stage and the head on the last, against the
documented rule and plain training; checkpoints store the tied tensor once, export and resume
under another plan keep the tie."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from pipedream.cli import main
from pipedream.data import MicrobatchStream
from pipedream.runtime.train import IN_ORDER_ENV
from pipedream.workload import load_workload

from oracles import stale_oracle
from runs import train_and_load
from tied_gpt import ARGS, MICROBATCH, plain_tied_training

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

B = MICROBATCH
THREE = [["embed"], ["h0", "h1"], ["norm", "head"]]
TWO = [["embed", "h0"], ["h1", "norm", "head"]]


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want
    )


def test_pipedream_three_stages_equal_the_tied_rule(tmp_path: Path) -> None:
    steps = 6
    got = train_and_load(
        tmp_path,
        THREE,
        steps=steps,
        workload="gpt",
        workload_args=ARGS,
        schedule="pipedream",
        microbatch_size=B,
        extra=("--checkpoint-every", "3"),
    )
    workload = load_workload("gpt", ARGS)
    data = MicrobatchStream(workload.dataset, B, 0)
    want = stale_oracle(
        workload.model,
        THREE,
        num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t)],
        loss_fn=workload.loss_fn,
        # the checkpoint at 3 drains the pipeline: the next segment starts without staleness
        staleness=lambda t, s: max(3 * (t // 3), t - (2 - s)),
        optimizer=workload.optimizer,
    )
    assert _diff(got, want) < 1e-5
    assert got["head.weight"] is got["embed.tok.weight"]

    # the tied tensor is stored once, by its owner (stage 0); the manifest names all its names
    checkpoint = tmp_path / "run" / "checkpoints" / f"step-{steps:06d}"
    manifest = yaml.safe_load((checkpoint / "manifest.yaml").read_text())
    assert manifest["tied"] == [["embed.tok.weight", "head.weight"]]
    files = [torch.load(checkpoint / f"stage-{s:02d}.pt", weights_only=True) for s in range(3)]
    assert "embed.tok.weight" in files[0]["model"]
    assert not {"embed.tok.weight", "head.weight"} & set(files[2]["model"])
    assert not {"embed.tok.weight", "head.weight"} & set(files[2]["optimizer"]["state"])

    # export: the model's own state dict, the tie intact
    exported = tmp_path / "model.pt"
    assert main(["export", str(checkpoint), "-o", str(exported)]) == 0
    state = torch.load(exported, weights_only=True)
    assert state["head.weight"].data_ptr() == state["embed.tok.weight"].data_ptr()
    fresh = load_workload("gpt", ARGS).model
    fresh.load_state_dict(state)
    assert fresh.head.weight is fresh.embed.tok.weight


def test_replicated_stages_then_resume_under_another_plan(tmp_path: Path) -> None:
    """4 minibatches on 2 replicas of both stages (1f1b), then 4 more resumed from that
    checkpoint on a 3-stage plan: the owner's tensor and its optimizer state reach every stage,
    and the whole run equals plain training (2 updates of 2 minibatches, then 4 of one)."""
    m, first_steps, steps = 2, 4, 8
    common = {
        "workload": "gpt",
        "workload_args": ARGS,
        "schedule": "1f1b",
        "microbatch_size": B,
        "microbatches": m,
    }
    train_and_load(tmp_path, TWO, steps=first_steps, replicas=[2, 2], **common)
    got = train_and_load(tmp_path, THREE, steps=steps, extra=("--resume", "auto"), **common)
    assert got["head.weight"] is got["embed.tok.weight"]

    workload = load_workload("gpt", ARGS)
    data = MicrobatchStream(workload.dataset, B, 0)
    model = workload.model
    optimizer = workload.optimizer(model.parameters())  # one optimizer: its momentum carries on
    batches = [list(range(t * m, (t + 2) * m)) for t in (0, 2)]
    batches += [list(range(t * m, (t + 1) * m)) for t in range(first_steps, steps)]
    for microbatches in batches:
        optimizer.zero_grad()
        for index in microbatches:
            inputs, targets = data.microbatch(index)
            (workload.loss_fn(model(inputs), targets) / len(microbatches)).backward()
        optimizer.step()
    want = {k: v.detach() for k, v in model.named_parameters()}
    assert _diff(got, want) < 1e-5


FOUR = [["embed"], ["h0"], ["h1"], ["norm", "head"]]


@pytest.mark.parametrize(
    ("schedule", "placement", "env"),
    [
        # the copy on rank 1: its messages on the lanes of stage pairs (0, 3) and (3, 0),
        # their receives posted ahead
        ("interleaved-1f1b", (0, 1, 0, 1), {}),
        # the owner and its copy on rank 0 hand over in memory, the rest in NCCL's order
        ("zbv", (0, 1, 1, 0), {IN_ORDER_ENV: "1"}),
    ],
    ids=["interleaved-1f1b", "zbv"],
)
def test_several_stages_per_rank_equal_tied_training(
    tmp_path: Path, schedule: str, placement: tuple[int, ...], env: dict[str, str]
) -> None:
    m, steps = 2, 4
    got = train_and_load(
        tmp_path,
        FOUR,
        steps=steps,
        workload="gpt",
        workload_args=ARGS,
        schedule=schedule,
        microbatch_size=B,
        microbatches=m,
        placement=placement,
        env=env,
    )
    assert got["head.weight"] is got["embed.tok.weight"]
    want = plain_tied_training(steps=steps, microbatches=m)
    assert _diff(got, {k: v for k, v in want.items() if k != "head.weight"}) < 1e-5


def test_clipping_to_a_global_norm_equals_a_plain_loop_with_clip_grad_norm(tmp_path: Path) -> None:
    """``--clip-grad-norm`` on 4 ranks, two copies of a two-stage pipeline: the norm over all
    ranks counts each stage once (at its first replica) and the tied tensor at its owner; the
    metrics give the norm of each update before clipping, as ``clip_grad_norm_`` returns it.
    The progress counts minibatches, as ``--steps`` does: it said "step 1/2" and "2/2" for the
    replicated last stage's two updates of 4 minibatches."""
    m, steps = 2, 4
    said: list[str] = []
    got = train_and_load(
        tmp_path,
        TWO,
        steps=steps,
        workload="gpt",
        workload_args=ARGS,
        schedule="1f1b",
        microbatch_size=B,
        microbatches=m,
        replicas=[2, 2],
        extra=("--clip-grad-norm", "0.3"),
        said=said,
    )
    assert [line.split()[:2] for line in said if line.startswith("step ")] == [
        ["step", "2/4"],
        ["step", "4/4"],
    ]
    assert any("clipping gradients to norm 0.3, " in line for line in said)
    norms: list[float] = []
    want = plain_tied_training(steps=steps, microbatches=m, copies=2, clip=0.3, norms=norms)
    assert _diff(got, {k: v for k, v in want.items() if k != "head.weight"}) < 1e-5
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["grad_norm"] for line in lines]
    assert logged == pytest.approx(norms, rel=1e-5) and min(norms) > 0.3
