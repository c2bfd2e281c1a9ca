"""Where a process sits in the job: torchrun's environment, checked against the plan, and the
backend and device it uses."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pipedream.errors import LaunchError
from pipedream.formats.plan import Plan

__all__ = ["LaunchEnv", "device_and_backend", "read_launch_env"]


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job (from torchrun's environment variables)."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    under_torchrun: bool
    """False for a single process started without torchrun."""
    local_world_size: int = 1
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE)."""
    restart_count: int = 0
    """How often torchrun restarted the workers (``--max-restarts``)."""


def read_launch_env(plan: Plan, *, source: str) -> LaunchEnv:
    """Read torchrun's variables and check them against the plan before joining anything."""
    if "WORLD_SIZE" not in os.environ:
        if plan.world_size != 1:
            raise LaunchError(
                f"{source}: world_size: the plan needs {plan.world_size} processes but this is a "
                f"single process; launch it with `./launch.sh {source}` (or torchrun "
                f"--nproc-per-node {plan.world_size} -m pipedream.cli train {source})"
            )
        return LaunchEnv(0, 1, 0, under_torchrun=False)
    world_size = _env_int("WORLD_SIZE", minimum=1)
    if world_size != plan.world_size:
        raise LaunchError(
            f"{source}: world_size: the plan needs {plan.world_size} processes but torchrun "
            f"started {world_size}; launch with `./launch.sh {source}` (it sets "
            f"--nproc-per-node from the plan) or re-plan with --workers {world_size}"
        )
    rank = _env_int("RANK", default=0)
    if rank >= world_size:
        raise LaunchError(
            f"environment variable RANK={rank} is not below WORLD_SIZE={world_size}; "
            "let torchrun (./launch.sh) set the ranks"
        )
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=_env_int("LOCAL_RANK", default=0),
        under_torchrun=True,
        local_world_size=_env_int("LOCAL_WORLD_SIZE", default=1, minimum=1),
        restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", default=0),
    )


def _env_int(name: str, *, default: int | None = None, minimum: int = 0) -> int:
    """An integer environment variable set by torchrun, with a clear error when it is not."""
    raw = os.environ.get(name)
    if raw is None:
        assert default is not None
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise LaunchError(
            f"environment variable {name}={raw!r} is not a whole number >= {minimum}; "
            "let torchrun (./launch.sh) set it"
        )
    return value


def device_and_backend(env: LaunchEnv) -> tuple[torch.device, str]:
    """NCCL with one GPU per rank when every local rank has one, else gloo on the CPU.

    The choice depends only on the node's GPU count and process count, so all ranks of a node
    agree (a mix of backends would hang).
    """
    local = max(env.local_world_size, env.local_rank + 1)
    if torch.cuda.is_available() and torch.cuda.device_count() >= local:
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"
