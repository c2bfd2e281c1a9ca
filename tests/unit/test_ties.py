"""Tied tensors: finding them, counting them once in a profile, the manifest's names, and the
state dict a checkpoint rebuilds (in process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from pipedream.errors import CheckpointError
from pipedream.formats.plan import Plan, StagePlan
from pipedream.profiler.command import format_table, profile_workload
from pipedream.runtime.checkpoint import (
    load_full_state_dict,
    load_manifest,
    save_stage_file,
    write_manifest,
)
from pipedream.runtime.stage_layout import SharedTensor, stage_layout
from pipedream.ties import expand_aliases, find_tied
from pipedream.workload import load_workload

ARGS = {"layers": "2", "dim": "16", "heads": "2", "seq": "8", "vocab": "32", "tie": "true"}


def test_find_tied_names_the_tensor_by_its_first_name() -> None:
    model = load_workload("gpt", ARGS).model
    (tied,) = find_tied(model)
    assert tied.names == ("embed.tok.weight", "head.weight") and tied.is_parameter
    assert tied.nbytes == 32 * 16 * 4
    assert find_tied(load_workload("gpt", {**ARGS, "tie": "false"}).model) == ()


def test_expand_aliases_maps_every_name_to_the_stored_tensor() -> None:
    stored = torch.ones(2)
    state = expand_aliases({"a": stored, "b": torch.zeros(1)}, [("c", "a"), ("x", "y")])
    assert state["c"] is stored and state["a"] is stored and set(state) == {"a", "b", "c"}


def test_profile_counts_a_tied_parameter_once() -> None:
    profile = profile_workload("gpt", ARGS, microbatch_size=2, warmup=0, repeats=1)
    model = load_workload("gpt", ARGS).model
    total = sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    assert sum(layer.parameter_bytes for layer in profile.layers) == total
    head = profile.layers[profile.index_of("head")]
    assert head.parameter_bytes == 0 and head.optimizer_state_bytes == 0  # counted in embed
    (tied,) = profile.tied
    assert (tied.name, tied.layers, tied.bytes) == ("embed.tok.weight", ("embed", "head"), 2048)
    assert "tied: embed.tok.weight (2.0 KiB) is used by embed, head" in format_table(profile)


def test_layout_of_a_split_tied_model() -> None:
    workload = load_workload("gpt", ARGS)
    stages = (
        StagePlan("embed", "h0", 1, (0,)),
        StagePlan("h1", "h1", 1, (1,)),
        StagePlan("norm", "head", 1, (2,)),
    )
    plan = Plan("gpt", "1f1b", 2, 1, 3, stages, workload_args=ARGS)
    layout = stage_layout(workload, plan, source="plan")
    assert layout.shared == (SharedTensor("embed.tok.weight", (0, 2), True),)
    assert layout.tied_pairs == ((0, 2),)
    first, last = layout.build(0), layout.build(2)
    assert layout.tied_links(0, first).owned == {2: ("embed.tok.weight",)}
    assert layout.tied_links(2, last).copies == {0: ("head.weight",)}  # its own name there
    assert layout.stored_elsewhere(2, last) == {"head.weight"}
    assert layout.stored_elsewhere(0, first) == set()


def test_checkpoint_keeps_the_tie(tmp_path: Path) -> None:
    weight = torch.randn(4, 2)
    files = [
        save_stage_file(tmp_path, 0, {"model": {"embed.weight": weight}}),
        save_stage_file(tmp_path, 1, {"model": {"norm.weight": torch.ones(2)}}),
    ]
    write_manifest(tmp_path, step=1, files=files, extra={}, tied=[("embed.weight", "head.weight")])
    state = load_full_state_dict(tmp_path)
    assert state["head.weight"] is state["embed.weight"] and torch.equal(
        state["head.weight"], weight
    )
    manifest = yaml.safe_load((tmp_path / "manifest.yaml").read_text())
    for bad in (["embed.weight"], [["embed.weight"]], "embed.weight", [["a", 3]]):
        (tmp_path / "manifest.yaml").write_text(yaml.safe_dump({**manifest, "tied": bad}))
        with pytest.raises(CheckpointError, match="tied: expected a list of lists"):
            load_manifest(tmp_path)
