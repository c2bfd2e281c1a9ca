"""Backend and device choice (DESIGN.md section 8), checked structurally without a GPU."""

from __future__ import annotations

import pytest
import torch

from pipedream.runtime import launch_env
from pipedream.runtime.launch_env import LaunchEnv


def test_gloo_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device, backend = launch_env.device_and_backend(LaunchEnv(1, 2, 1, under_torchrun=True))
    assert (device, backend) == (torch.device("cpu"), "gloo")


def test_nccl_with_one_gpu_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    device, backend = launch_env.device_and_backend(
        LaunchEnv(6, 8, 2, under_torchrun=True, local_world_size=4)
    )
    assert (device, backend) == (torch.device("cuda", 2), "nccl")
    assert chosen == [torch.device("cuda", 2)]


@pytest.mark.parametrize("local_rank", [0, 1, 2, 3])
def test_gloo_on_every_rank_when_some_local_rank_has_no_gpu(
    monkeypatch: pytest.MonkeyPatch, local_rank: int
) -> None:
    """4 processes on a node with 2 GPUs: all of them use gloo (never a mix of backends)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env = LaunchEnv(local_rank, 4, local_rank, under_torchrun=True, local_world_size=4)
    assert launch_env.device_and_backend(env) == (torch.device("cpu"), "gloo")
