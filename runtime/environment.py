"""Where a process sits in the job: torchrun's environment, checked against the plan, and the
backend and device it uses."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pipedream.errors import LaunchError
from pipedream.formats.plan import Plan
from pipedream.wording import count

__all__ = [
    "DEVICE_CHOICES",
    "LaunchEnv",
    "Placement",
    "choose_placement",
    "device_and_backend",
    "read_launch_env",
]


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


DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda-shared")
"""``pipedream train --device``: where the ranks compute and how they talk."""


@dataclass(frozen=True)
class Placement:
    """Where a rank computes and how its messages travel."""

    device: torch.device
    """The rank's device."""
    backend: str
    """``nccl`` or ``gloo``."""
    staged: bool = False
    """Messages go through (pinned) host memory: gloo between ranks that compute on GPUs."""
    gpus: int = 0
    """GPUs of the node that the node's ranks use."""

    def describe(self, world_size: int) -> str:
        """For the start line: ``4 gloo processes``, ``4 gloo processes sharing 1 GPU``."""
        text = f"{world_size} {self.backend} process{'es' if world_size != 1 else ''}"
        if self.staged:
            gpus = f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}"
            return f"{text} sharing {gpus} (messages through host memory)"
        if self.device.type == "cuda":
            return text + ", one GPU each"
        return text


def choose_placement(
    choice: str, *, local_rank: int, local_world_size: int, gpus: int
) -> Placement:
    """The placement ``--device choice`` asks for on a node with ``gpus`` GPUs.

    It depends only on the node's GPU count and process count, so all ranks of a node agree
    (a mix of backends would hang).

    - ``auto``: NCCL with a GPU of its own for every rank when the node has one for each of its
      ranks, else gloo on the CPU;
    - ``cpu``: gloo on the CPU;
    - ``cuda``: NCCL, a GPU of its own for every rank (an error if there are fewer GPUs);
    - ``cuda-shared``: local rank ``r`` on GPU ``r mod gpus``, gloo between the ranks with
      every message copied through pinned host memory (so a one-GPU machine runs, checks and
      profiles a whole pipeline on CUDA).
    """
    if choice not in DEVICE_CHOICES:
        raise LaunchError(f"--device {choice!r}: use one of {', '.join(DEVICE_CHOICES)}")
    local = max(local_world_size, local_rank + 1)
    exclusive = gpus >= local
    if choice == "cpu" or (choice == "auto" and not exclusive):
        return Placement(torch.device("cpu"), "gloo")
    if choice in ("auto", "cuda"):
        if gpus < 1:
            raise LaunchError(
                "--device cuda: this node has no GPU that PyTorch can use; use --device cpu "
                "(or auto)"
            )
        if not exclusive:
            raise LaunchError(
                f"--device cuda: the node runs {local} ranks but has {count(gpus, 'GPU')}; give "
                "every rank its own GPU, or let ranks share them with --device cuda-shared"
            )
        return Placement(torch.device("cuda", local_rank), "nccl", gpus=local)
    if gpus < 1:
        raise LaunchError(
            "--device cuda-shared: this node has no GPU that PyTorch can use; use --device cpu "
            "(or auto)"
        )
    used = min(gpus, local)
    return Placement(torch.device("cuda", local_rank % used), "gloo", staged=True, gpus=used)


def device_and_backend(env: LaunchEnv, choice: str = "auto") -> Placement:
    """This rank's :func:`choose_placement` on its node; selects its GPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    placement = choose_placement(
        choice, local_rank=env.local_rank, local_world_size=env.local_world_size, gpus=gpus
    )
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    return placement
