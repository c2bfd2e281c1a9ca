"""Device and backend choice (``pipedream train --device``), checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from pipedream.errors import LaunchError
from pipedream.runtime import environment as launch_env
from pipedream.runtime.environment import LaunchEnv, Placement, choose_placement

CPU = Placement(torch.device("cpu"), "gloo")


def test_gloo_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    placement = launch_env.device_and_backend(LaunchEnv(1, 2, 1, under_torchrun=True))
    assert placement == CPU
    assert placement.describe(2) == "2 gloo processes"


def test_nccl_with_one_gpu_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    placement = launch_env.device_and_backend(
        LaunchEnv(6, 8, 2, under_torchrun=True, local_world_size=4)
    )
    assert placement == Placement(torch.device("cuda", 2), "nccl", gpus=4)
    assert chosen == [torch.device("cuda", 2)]
    assert placement.describe(8) == "8 nccl processes, one GPU each"


@pytest.mark.parametrize("local_rank", [0, 1, 2, 3])
def test_gloo_on_every_rank_when_some_local_rank_has_no_gpu(local_rank: int) -> None:
    """4 processes on a node with 2 GPUs: by default all of them use gloo on the CPU (never a
    mix of backends)."""
    assert choose_placement("auto", local_rank=local_rank, local_world_size=4, gpus=2) == CPU


@pytest.mark.parametrize("local_rank", [0, 1, 2, 3])
def test_ranks_share_the_gpus_when_asked(local_rank: int) -> None:
    """--device cuda-shared: 4 ranks on 2 GPUs take GPU rank mod 2 and talk over gloo through
    host memory."""
    placement = choose_placement("cuda-shared", local_rank=local_rank, local_world_size=4, gpus=2)
    assert placement == Placement(torch.device("cuda", local_rank % 2), "gloo", True, 2)
    assert placement.describe(4) == (
        "4 gloo processes sharing 2 GPUs (messages through host memory)"
    )
    one = choose_placement("cuda-shared", local_rank=local_rank, local_world_size=4, gpus=1)
    assert one.device == torch.device("cuda", 0) and one.describe(4).endswith(
        "sharing 1 GPU (messages through host memory)"
    )
    # with a GPU for every rank, sharing still uses only as many as there are ranks
    many = choose_placement("cuda-shared", local_rank=local_rank, local_world_size=4, gpus=8)
    assert many.device == torch.device("cuda", local_rank) and many.gpus == 4


def test_explicit_choices_and_their_errors() -> None:
    assert choose_placement("cpu", local_rank=0, local_world_size=2, gpus=2) == CPU
    assert choose_placement("cuda", local_rank=1, local_world_size=2, gpus=2).backend == "nccl"
    with pytest.raises(LaunchError, match="runs 4 ranks but has 2 GPU.*--device cuda-shared"):
        choose_placement("cuda", local_rank=0, local_world_size=4, gpus=2)
    with pytest.raises(LaunchError, match="no GPU that PyTorch can use; use --device cpu"):
        choose_placement("cuda-shared", local_rank=0, local_world_size=2, gpus=0)
    # it suggested --device cuda-shared, which needs a GPU too
    with pytest.raises(LaunchError, match=r"^--device cuda: this node has no GPU .* cpu \(or"):
        choose_placement("cuda", local_rank=0, local_world_size=1, gpus=0)
    with pytest.raises(LaunchError, match="use one of auto, cpu, cuda, cuda-shared"):
        choose_placement("tpu", local_rank=0, local_world_size=1, gpus=0)
