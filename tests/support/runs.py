"""Run a plan on its ranks and read back the final weights (for distributed tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from pipedream.runtime.checkpoint import load_full_state_dict

from launching import straight_plan, write_plan
from workers import run_plan

__all__ = ["even_groups", "max_rel_diff", "train_and_load"]


def even_groups(names: list[str], num_stages: int) -> list[list[str]]:
    """Split layer names into ``num_stages`` contiguous groups of near-equal size."""
    bounds = [round(i * len(names) / num_stages) for i in range(num_stages + 1)]
    return [names[bounds[i] : bounds[i + 1]] for i in range(num_stages)]


def max_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor max |got - want| / max |want| over the state dict."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want
    )


def train_and_load(
    tmp: Path,
    stages: list[list[str]],
    *,
    steps: int,
    workload: str = "mlp",
    workload_args: dict[str, str] | None = None,
    schedule: str = "pipedream",
    microbatch_size: int = 8,
    microbatches: int = 1,
    replicas: list[int] | None = None,
    extra: tuple[str, ...] = (),
    name: str = "run",
    placement: tuple[int, ...] | None = None,
    env: dict[str, str] | None = None,
    said: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Launch the plan for ``steps`` minibatches; return the merged final weights.
    ``placement``: the rank of every stage, where ranks run several stages (interleaved, V);
    ``said``: gets the lines the run wrote to stderr."""
    plan = straight_plan(
        workload,
        stages,
        schedule=schedule,
        microbatch_size=microbatch_size,
        microbatches=microbatches,
        workload_args=workload_args,
        replicas=replicas,
    )
    if placement is not None:
        for stage, rank in zip(plan["stages"], placement, strict=True):
            stage["ranks"] = [rank]
        plan["world_size"] = len(set(placement))
    path = write_plan(plan, tmp / f"{name}.yaml")
    run_dir = tmp / name
    result = run_plan(
        path,
        "--steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        "--timeout",
        "60",
        "--no-progress",
        *extra,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    if said is not None:
        said += result.stderr.splitlines()
    return load_full_state_dict(run_dir / "checkpoints" / f"step-{steps:06d}")
