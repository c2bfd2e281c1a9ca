"""The random generators a stage draws from: replayed for a recomputed forward, and kept in its
checkpoint file, the GPU's included (a GPU's dropout draws from the GPU's generator; a resumed
run that restarted it would repeat the masks of the run's first steps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream.runtime.checkpoint import (
    restore_stage,
    save_stage_file,
    stage_payload,
    write_manifest,
)
from pipedream.runtime.rng_state import capture, replayed

CPU = torch.device("cpu")


def test_a_replayed_block_draws_again_and_leaves_the_generator_where_it_was() -> None:
    torch.manual_seed(5)
    state = capture(CPU)
    first = torch.rand(4)
    after_first = torch.get_rng_state()
    with replayed(state):
        again = torch.rand(4)
    assert torch.equal(again, first)
    assert torch.equal(torch.get_rng_state(), after_first)
    assert state.cuda is None


class _FakeGpuGenerator:
    """``torch.cuda``'s generator functions for GPU 1, on a machine without a GPU."""

    def __init__(self) -> None:
        self.state = torch.tensor([11, 22], dtype=torch.uint8)
        self.set_to: list[tuple[torch.Tensor, object]] = []

    def get_rng_state(self, device: object) -> torch.Tensor:
        assert device == 1
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor, device: object) -> None:
        self.set_to.append((state, device))


def test_a_gpu_stage_checkpoints_and_restores_its_gpus_generator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeGpuGenerator()
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    gpu = torch.device("cuda", 1)
    module = nn.Linear(2, 2)
    torch.manual_seed(3)
    cpu_state = torch.get_rng_state()
    payload = stage_payload(module, None, stage=0, step=4, data_position=4, device=gpu)
    assert torch.equal(payload["cuda_rng"], fake.state)
    assert torch.equal(payload["rng"], cpu_state)
    assert "cuda_rng" not in stage_payload(module, None, stage=0, step=4, data_position=4)

    name, digest = save_stage_file(tmp_path, 0, payload)
    write_manifest(tmp_path, step=4, files=[(name, digest)], extra={})
    torch.rand(3)  # the generators move on after the checkpoint
    restore_stage(tmp_path, nn.Linear(2, 2), None, stage=0, device=gpu)
    assert torch.equal(torch.get_rng_state(), cpu_state)
    ((state, device),) = fake.set_to
    assert torch.equal(state, fake.state) and device == gpu
    restore_stage(tmp_path, nn.Linear(2, 2), None, stage=0, device=CPU)  # resumed on a CPU
    assert len(fake.set_to) == 1
