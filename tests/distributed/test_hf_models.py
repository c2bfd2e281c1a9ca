"""Hugging Face ``transformers`` causal language models through the whole workflow on gloo:
GPT-2 and a Llama-style model (RoPE, RMSNorm, grouped-query attention), tied and untied, built
from configs here (no download), profiled, planned and trained in 2 and 4 stages; under
``1f1b`` equal to single-process training of the same model on the same microbatches, under
``pipedream`` learning. A model taking ``input_ids`` and ``attention_mask`` (padded data) in 3
stages, and a user's ``module:function`` returning a ``transformers`` model."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from pipedream.cli import main
from pipedream.data import MicrobatchStream
from pipedream.formats import load_plan, save_profile
from pipedream.model_io import call_model
from pipedream.profiler.command import profile_workload
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.runtime.stage_layout import stage_layout
from pipedream.workload import load_workload

from launching import write_plan
from workers import run_plan

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

pytest.importorskip("transformers")

B = 4
SIZE = {"layers": "2", "dim": "32", "heads": "4", "vocab": "64", "seq": "16", "samples": "256"}
SGD = {"optimizer": "sgd", "lr": "0.2"}


def _profile_and_plan(
    tmp: Path, args: dict[str, str], *, workers: int, schedule: str, m: int
) -> Path:
    """``pipedream profile`` and ``pipedream plan --straight`` (in this process)."""
    profile = profile_workload("hf-lm", args, microbatch_size=B, warmup=0, repeats=1)
    save_profile(profile, tmp / "profile.yaml")
    plan = tmp / "plan.yaml"
    options = ["--workers", str(workers), "--straight", "--schedule", schedule]
    assert (
        main(
            ["plan", str(tmp / "profile.yaml"), *options, "--microbatches", str(m), "-o", str(plan)]
        )
        == 0
    )
    assert load_plan(plan).num_stages == workers
    return plan


def _train(tmp: Path, plan: Path, steps: int, *extra: str) -> list[float]:
    """Launch the plan; the loss of every minibatch."""
    result = run_plan(
        plan,
        "--steps",
        str(steps),
        "--run-dir",
        str(tmp / "run"),
        "--timeout",
        "120",
        "--no-progress",
        *extra,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (tmp / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _single_process(args: dict[str, str], steps: int, m: int):
    """The same model trained in one process on the same microbatches: weights, losses."""
    workload = load_workload("hf-lm", args, microbatch_size=B)
    data = MicrobatchStream(workload.dataset, B, 0)
    optimizer = workload.optimizer(workload.model.parameters())
    losses = []
    for k in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for j in range(m):
            inputs, targets = data.microbatch(k * m + j)
            loss = workload.loss_fn(call_model(workload.model, inputs), targets)
            (loss / m).backward()
            total += float(loss.detach()) / m
        optimizer.step()
        losses.append(total)
    return workload.model.state_dict(), losses


def _equals_single_process(tmp: Path, args: dict[str, str], steps: int, m: int, losses) -> None:
    got = load_full_state_dict(tmp / "run" / "checkpoints" / f"step-{steps:06d}")
    want, want_losses = _single_process(args, steps, m)
    assert set(got) == set(want)  # the model's own state dict: tied names, no extra buffers
    diff = max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want
    )
    assert diff < 1e-5
    assert losses == pytest.approx(want_losses, rel=1e-5)


@pytest.mark.parametrize(
    ("config", "extra", "workers"),
    [("gpt2", {}, 4), ("llama", {"kv_heads": "2"}, 2)],
    ids=["gpt2-tied-4", "llama-gqa-tied-2"],
)
def test_tied_model_under_1f1b_equals_single_process(
    tmp_path: Path, config: str, extra: dict[str, str], workers: int
) -> None:
    args = {"config": config, **SIZE, **SGD, "tie": "true", **extra}
    m, steps = 2, 4
    plan = _profile_and_plan(tmp_path, args, workers=workers, schedule="1f1b", m=m)
    profile = (tmp_path / "profile.yaml").read_text()
    assert "tied:" in profile and "lm_head" in profile  # the embedding and head share it
    losses = _train(tmp_path, plan, steps)
    _equals_single_process(tmp_path, args, steps, m, losses)


USER_MODULE = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def gpt2(layers: int = 2, dim: int = 32):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=4, vocab_size=64, n_positions=16,
                        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config)
"""


def test_users_untied_gpt2_under_pipedream_learns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``module:function`` returning a transformers model; the options it does not take
    (``seq``, ``lr``) go to the data and optimizer around it."""
    (tmp_path / "user_lm.py").write_text(textwrap.dedent(USER_MODULE))
    options = [
        "--workload-arg",
        "seq=16",
        "--workload-arg",
        "lr=0.003",
        "--microbatch-size",
        str(B),
    ]
    env = {"PYTHONPATH": str(tmp_path)}
    profile, plan = tmp_path / "profile.yaml", tmp_path / "plan.yaml"
    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks get it from PYTHONPATH
    profiled = main(
        ["profile", "user_lm:gpt2", *options, "--repeats", "1", "--warmup", "0", "-o", str(profile)]
    )
    assert profiled == 0
    assert "tied:" not in profile.read_text()
    assert (
        main(
            [
                "plan",
                str(profile),
                "--workers",
                "2",
                "--straight",
                "--schedule",
                "pipedream",
                "-o",
                str(plan),
            ]
        )
        == 0
    )
    result = run_plan(
        plan,
        "--steps",
        "40",
        "--run-dir",
        str(tmp_path / "run"),
        "--timeout",
        "120",
        "--no-progress",
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses


def test_untied_llama_under_pipedream_in_four_stages_learns(tmp_path: Path) -> None:
    args = {"config": "llama", **SIZE, "kv_heads": "2", "tie": "false", "lr": "0.003"}
    plan = _profile_and_plan(tmp_path, args, workers=4, schedule="pipedream", m=1)
    assert "tied:" not in (tmp_path / "profile.yaml").read_text()
    losses = _train(tmp_path, plan, 40)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses


def test_attention_mask_reaches_every_stage_under_1f1b(tmp_path: Path) -> None:
    """Padded data: the model takes input_ids and attention_mask; the first stage reads both and
    the mask (as the model turns it into its attention mask) goes to every later stage."""
    args = {"config": "llama", **SIZE, **SGD, "padding": "true"}
    m, steps = 2, 4
    workload = load_workload("hf-lm", args, microbatch_size=B)
    assert set(workload.example_input) == {"input_ids", "attention_mask"}
    assert bool((workload.example_input["attention_mask"] == 0).any())  # padding in the data
    layers = [
        "model.embed_tokens",
        "model.rotary_emb",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    groups = [layers[:2], layers[2:3], layers[3:]]
    plan = {
        "format": "pipedream/plan@1",
        "workload": "hf-lm",
        "workload_args": args,
        "schedule": "1f1b",
        "microbatch_size": B,
        "microbatches": m,
        "world_size": 3,
        "layers": layers,
        "stages": [
            {"first_layer": g[0], "last_layer": g[-1], "replicas": 1, "ranks": [s]}
            for s, g in enumerate(groups)
        ],
    }
    path = write_plan(plan, tmp_path / "plan.yaml")
    ios = stage_layout(workload, load_plan(path), source="plan").ios
    assert ios[0].inputs == ("input_ids", "attention_mask")
    masks = [
        v
        for v in ios[1].inputs
        if v in ios[2].inputs and v in ios[0].outputs and v in ios[0].no_grad
    ]
    assert masks  # a boolean mask made on stage 0 goes straight to stages 1 and 2, no gradient back
    losses = _train(tmp_path, path, steps)
    _equals_single_process(tmp_path, args, steps, m, losses)


def test_attention_mask_under_interleaved_1f1b_equals_single_process(tmp_path: Path) -> None:
    """Two stages per rank: stage 3 (rank 1) takes the hidden states from stage 2 and the mask
    (and the rotary embeddings) from stage 0, both on rank 0. Each stage pair has its own lane
    of tags; keyed by the receiving stage alone, the two messages swapped payloads."""
    args = {"config": "llama", **SIZE, "layers": "4", **SGD, "padding": "true", "tie": "false"}
    m, steps = 4, 3
    layers = [
        "model.embed_tokens",
        "model.rotary_emb",
        *(f"model.layers.{i}" for i in range(4)),
        "model.norm",
        "lm_head",
    ]
    groups = [layers[:3], layers[3:4], layers[4:5], layers[5:]]
    plan = {
        "format": "pipedream/plan@1",
        "workload": "hf-lm",
        "workload_args": args,
        "schedule": "interleaved-1f1b",
        "microbatch_size": B,
        "microbatches": m,
        "world_size": 2,
        "layers": layers,
        "stages": [
            {"first_layer": g[0], "last_layer": g[-1], "replicas": 1, "ranks": [s % 2]}
            for s, g in enumerate(groups)
        ],
    }
    path = write_plan(plan, tmp_path / "plan.yaml")
    workload = load_workload("hf-lm", args, microbatch_size=B)
    ios = stage_layout(workload, load_plan(path), source="plan").ios
    assert [producer for producer, _ in ios[3].producers] == [0, 2]
    losses = _train(tmp_path, path, steps)
    _equals_single_process(tmp_path, args, steps, m, losses)
