"""The checkpoint protocol of a running job: who writes what, when, and where a run resumes.

Replica 0 of every stage writes its stage file; rank 0 gathers the checksums and writes the
manifest last, then prunes old checkpoints (``--keep``). A resumed run picks the newest complete
and valid checkpoint (``--resume auto``) or a given one, written under any plan of the same
workload and minibatch shape.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipedream.errors import CheckpointError, LaunchError
from pipedream.formats.plan import Plan
from pipedream.runtime.checkpoint import (
    find_latest_checkpoint,
    load_manifest,
    save_stage_file,
    stage_payload,
    step_directories,
    write_manifest,
)
from pipedream.runtime.stage_worker import StageWorker

__all__ = [
    "check_run_dir",
    "newest_checkpoint",
    "prune_checkpoints",
    "recipe_change",
    "restart_point",
    "resume_point",
    "write_checkpoint",
]


def write_checkpoint(
    directory: Path,
    stages: Sequence[tuple[int, StageWorker, Collection[str]]],
    plan: Plan,
    *,
    rank: int,
    step: int,
    keep: int,
    seed: int,
    tied: Sequence[Sequence[str]] = (),
    loss_scale: dict[str, Any] | None = None,
    recipe: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
) -> None:
    """Collective: every rank calls it at the same step, after the pipeline drained.

    ``stages``: the rank's stages (one, or several under interleaved and V schedules), each
    with its worker and the names in its state dict that another stage's file stores (copies
    of tied tensors, ``omit``); ``tied``: the names of each tensor the model reaches under
    several names; ``loss_scale``: fp16's scale and its count of good updates, the same on
    every rank (rank 0 writes it into the manifest); ``recipe``: how the run trained beyond
    the workload (``precision``, ``clip_grad_norm``), which a resumed run compares with its
    own (:func:`recipe_change`); ``model_config``: a ``transformers`` model's config
    (``transformers_config``, from which ``export --hf`` builds the model). The first replica
    of every stage writes the stage's file.
    """
    entries = []
    for stage, worker, omit in stages:
        if plan.stages[stage].ranks[0] != rank:
            continue
        payload = stage_payload(
            worker.module,
            worker.optimizer,
            stage=stage,
            step=step,
            data_position=step * plan.microbatches,
            param_names=worker.param_names,
            omit=omit,
        )
        entries.append((stage, *save_stage_file(directory, stage, payload)))
    gathered: list[Any] = [None] * plan.world_size
    dist.all_gather_object(gathered, entries)
    if rank == 0:
        files = sorted(entry for rank_entries in gathered for entry in rank_entries)
        write_manifest(
            directory,
            step=step,
            files=[(name, digest) for _, name, digest in files],
            extra={
                "schedule": plan.schedule,
                "num_stages": plan.num_stages,
                "workload": plan.workload,
                "workload_args": dict(plan.workload_args),
                "microbatch_size": plan.microbatch_size,
                "microbatches": plan.microbatches,
                "seed": seed,
                **(recipe or {}),
                **({"loss_scale": loss_scale} if loss_scale is not None else {}),
                **({"transformers_config": model_config} if model_config is not None else {}),
            },
            tied=tied,
        )
        if keep > 0:
            prune_checkpoints(directory.parent, keep=keep)
    dist.barrier()


def prune_checkpoints(checkpoints: Path, *, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; returns what was deleted.

    Incomplete directories (no manifest: a write that died) older than the newest complete
    checkpoint are deleted too.
    """
    steps = step_directories(checkpoints)
    complete = [p for p in steps if (p / "manifest.yaml").is_file()]
    if not complete:
        return []
    survivors = set(complete[-keep:])
    newest = steps.index(complete[-1])
    doomed = [p for p in steps[:newest] if p not in survivors]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def newest_checkpoint(run_dir: Path) -> tuple[Path, int] | None:
    """The newest checkpoint under ``run_dir`` written to the end (it has its manifest) and
    its step; its files are not read (``--resume auto`` checks them)."""
    for step_dir in reversed(step_directories(run_dir / "checkpoints")):
        try:
            return step_dir, int(load_manifest(step_dir)["step"])
        except CheckpointError:
            continue
    return None


def restart_point(resume: str | None, run_dir: str | None) -> str:
    """Where workers that torchrun restarted (``--max-restarts``) continue: the newest
    checkpoint of the run (``auto``), unless the run began from a checkpoint ``resume`` and
    has written none since."""
    if resume is None or resume == "auto" or run_dir is None:
        return "auto"
    newest = newest_checkpoint(Path(run_dir))
    try:
        began = int(load_manifest(resume)["step"])
    except CheckpointError:  # gone (--keep pruned it): the run has newer ones
        return "auto"
    return "auto" if newest is not None and newest[1] >= began else resume


def check_run_dir(run_dir: str | None, start: int) -> None:
    """Refuse to train from step ``start`` (a fresh run, or one resumed from a given
    checkpoint) in a run directory that holds a sound checkpoint of a later step, of a run that
    went further: ``--keep`` would delete this run's own checkpoints before it, and ``--resume
    auto`` (a restart too) would take it for this run's. (``--resume auto`` starts from the
    newest sound one, so it never meets one.)"""
    if run_dir is None:
        return
    newest = find_latest_checkpoint(Path(run_dir) / "checkpoints")
    if newest is not None and int(load_manifest(newest)["step"]) > start:
        raise LaunchError(
            f"{run_dir} holds a checkpoint after step {start}, where this run starts: "
            f"{newest.name}, of a run that went further; continue that one with --resume "
            "auto, or train in another --run-dir"
        )


def recipe_change(manifest: dict[str, Any], precision: str, clip: float | None) -> str:
    """How a resumed run trains otherwise than the run that wrote ``manifest`` did, in words
    ("" where alike, or for a checkpoint that does not record it)."""
    if "precision" not in manifest:
        return ""
    then = (manifest["precision"], manifest.get("clip_grad_norm"))
    if then == (precision, clip):
        return ""

    def words(precision: str, clip: float | None) -> str:
        clipping = f"clipping gradients to norm {clip:g}" if clip is not None else "no clipping"
        return f"{precision}, {clipping}"

    lost = " (its fp16 loss scale is dropped)" if then[0] == "fp16" != precision else ""
    return f"was trained in {words(*then)}; this run trains in {words(precision, clip)}{lost}"


def resume_point(
    resume: str | None, run_dir: str | None, plan: Plan, *, note: bool = True
) -> Path | None:
    """The checkpoint to resume from (``--resume auto|PATH``), checked against the plan;
    ``note``: say so when ``auto`` finds none (one rank per node does)."""
    if resume is None:
        return None
    if resume == "auto":
        if run_dir is None:
            raise LaunchError("--resume auto needs --run-dir (the run whose checkpoints to use)")
        found = find_latest_checkpoint(Path(run_dir) / "checkpoints")
        if found is None:
            if note:
                print(
                    f"pipedream: no checkpoint in {run_dir}; starting from scratch",
                    file=sys.stderr,
                )
            return None
        path = found
    else:
        path = Path(resume)
    manifest = load_manifest(path)
    samples = (manifest.get("microbatch_size"), manifest.get("microbatches"))
    if manifest.get("workload") != plan.workload:
        raise CheckpointError(
            f"{path}: was written for workload {manifest.get('workload')!r}, the plan trains "
            f"{plan.workload!r}; resume with a plan for the same workload"
        )
    if samples != (plan.microbatch_size, plan.microbatches):
        raise CheckpointError(
            f"{path}: minibatches of {samples[1]} x {samples[0]} samples, the plan uses "
            f"{plan.microbatches} x {plan.microbatch_size}; the data position would not match, "
            "so keep microbatch_size and microbatches when resuming"
        )
    return path
