"""``pipedream train``: one process of a pipeline job, started by torchrun (or launch.sh).

Every rank loads the plan and the workload, builds the same action tables and validates them,
then joins the process group, takes its stage's slice of the model and runs its table. The run
is cut into segments at checkpoints: a segment's tables drain the pipeline, so every checkpoint
is a consistent state (DESIGN.md section 8).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipedream.data import MicrobatchStream
from pipedream.errors import CheckpointError, LaunchError
from pipedream.formats.plan import Plan, load_plan
from pipedream.formats.units import format_bytes
from pipedream.runtime.actions import Action
from pipedream.runtime.checkpoint import (
    find_latest_checkpoint,
    load_full_state_dict,
    load_manifest,
    restore_stage,
    save_stage_file,
    stage_payload,
    step_dir_name,
    write_manifest,
)
from pipedream.runtime.comm import P2P
from pipedream.runtime.executor import Executor
from pipedream.runtime.metrics import MetricsLogger
from pipedream.runtime.plan_check import plan_spec, validate_plan_schedule
from pipedream.runtime.schedule import build_tables
from pipedream.runtime.stage import build_stage_module, layer_names, stage_layer_names
from pipedream.runtime.worker import StageWorker, WorkerConfig
from pipedream.workload import Workload, load_workload

__all__ = ["LaunchEnv", "TrainOptions", "read_launch_env", "train"]


@dataclass(frozen=True)
class TrainOptions:
    """Options of ``pipedream train`` (see ``pipedream train --help``)."""

    plan_path: str
    steps: int
    run_dir: str | None = None
    seed: int = 0
    checkpoint_every: int = 0
    resume: str | None = None
    trace: bool = False
    precision: str = "fp32"
    recompute: bool = False
    timeout: float = 300.0
    progress: bool = True


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job (from torchrun's environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    under_torchrun: bool
    local_world_size: int = 1
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE)."""


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


def _device_and_backend(env: LaunchEnv) -> tuple[torch.device, str]:
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


def _segments(steps: int, every: int, start: int = 0) -> list[tuple[int, int]]:
    """(first minibatch, count) of each stretch between checkpoints, from ``start`` on.

    Boundaries are multiples of ``every`` counted from 0, so a resumed run drains and
    checkpoints at exactly the same minibatches as an uninterrupted one.
    """
    bounds = sorted({*range(every, steps, every)} if every > 0 else set()) + [steps]
    out, current = [], start
    for bound in bounds:
        if bound > current:
            out.append((current, bound - current))
            current = bound
    return out


def _rank_table(plan: Plan, first: int, count: int, rank: int) -> list[Action]:
    return build_tables(plan_spec(plan, first, count), only_ranks=(rank,))[rank]


def _check_options(options: TrainOptions, plan: Plan) -> None:
    if options.steps < 1:
        raise LaunchError(f"--steps must be >= 1, got {options.steps}; give the minibatches to run")
    if options.checkpoint_every < 0:
        raise LaunchError(
            f"--checkpoint-every must be >= 0, got {options.checkpoint_every}; "
            "0 means only at the end"
        )
    if options.timeout <= 0:
        raise LaunchError(
            f"--timeout must be > 0 seconds, got {options.timeout}; e.g. --timeout 300"
        )
    for start, count in _segments(options.steps, options.checkpoint_every):
        for index, stage in enumerate(plan.stages):
            if count % stage.replicas:
                raise LaunchError(
                    f"stage {index} has {stage.replicas} replicas, so --steps and "
                    f"--checkpoint-every must be multiples of {stage.replicas} "
                    f"(a segment of {count} minibatches starts at {start})"
                )


def train(options: TrainOptions) -> int:
    plan = load_plan(options.plan_path)
    source = options.plan_path
    _check_options(options, plan)
    env = read_launch_env(plan, source=source)
    workload = load_workload(
        plan.workload, plan.workload_args, microbatch_size=plan.microbatch_size, source=source
    )
    stage_layers = stage_layer_names(plan, layer_names(workload.model), source=source)
    resume_from = _resume_point(options, plan)
    start = load_manifest(resume_from)["step"] if resume_from is not None else 0
    if start >= options.steps:
        print(
            f"pipedream: {resume_from} is already at step {start} >= --steps {options.steps}; "
            "nothing to do",
            file=sys.stderr,
        )
        return 0
    segments = _segments(options.steps, options.checkpoint_every, start)
    validate_plan_schedule(plan, {count for _, count in segments}, source=source)

    device, backend = _device_and_backend(env)
    timeout = timedelta(seconds=options.timeout)
    if env.under_torchrun:
        dist.init_process_group(
            backend, timeout=timeout, device_id=device if backend == "nccl" else None
        )
    else:
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    try:
        return _run(
            options,
            plan,
            env,
            workload,
            stage_layers,
            segments,
            device,
            backend,
            resume_from,
        )
    finally:
        gc.collect()  # drop lingering gloo work objects (in cycles) while the interpreter lives
        dist.destroy_process_group()
        gc.collect()


def _run(
    options: TrainOptions,
    plan: Plan,
    env: LaunchEnv,
    workload: Workload,
    stage_layers: list[list[str]],
    segments: list[tuple[int, int]],
    device: torch.device,
    backend: str,
    resume_from: Path | None,
) -> int:
    rank = env.rank
    groups: dict[int, Any] = {}
    for index, stage in enumerate(plan.stages):  # every rank creates every group, in order
        if stage.replicas > 1:
            groups[index] = dist.new_group(list(stage.ranks))
    stage_index = plan.stage_of_rank(rank)
    stage = plan.stages[stage_index]
    last = plan.num_stages - 1
    run_dir = _agree_on_run_dir(options.run_dir)

    module = build_stage_module(workload.model, stage_layers[stage_index])
    needs_data = stage_index in (0, last)
    data = (
        MicrobatchStream(workload.dataset, plan.microbatch_size, options.seed)
        if needs_data
        else None
    )
    config = WorkerConfig(
        stage=stage_index,
        num_stages=plan.num_stages,
        microbatches=plan.microbatches,
        device=device,
        recompute=options.recompute or plan.recompute,
        precision=options.precision,
    )
    logs_loss = stage_index == last and stage.ranks[0] == rank
    logger = (
        MetricsLogger(
            run_dir / "metrics.jsonl",
            total_steps=options.steps // stage.replicas,
            samples_per_step=plan.microbatch_size * plan.microbatches * stage.replicas,
            progress=options.progress,
        )
        if logs_loss
        else None
    )
    if logs_loss:
        print(
            f"pipedream: {plan.workload} on {plan.world_size} {backend} processes, "
            f"{plan.num_stages} stages, schedule {plan.schedule}, {options.steps} minibatches "
            f"of {plan.microbatches} x {plan.microbatch_size} samples; run dir {run_dir}",
            file=sys.stderr,
            flush=True,
        )
    trace: list[tuple[str, float, float]] | None = [] if options.trace else None
    stats = {"max_versions": 0, "max_copies": 0, "max_in_flight": 0}
    checkpoint_dir = run_dir / "checkpoints"
    first_segment, first_count = segments[0]
    table = _rank_table(plan, first_segment, first_count, rank)
    worker = StageWorker(
        config,
        module,
        table,
        optimizer_factory=workload.optimizer,
        loss_fn=workload.loss_fn,
        data=data,
        initial_version=first_segment // stage.replicas,
    )
    if resume_from is not None:
        restore_stage(resume_from, worker.module, worker.optimizer, stage=stage_index)
        # the first version must be taken of the restored weights, not the initial ones
        worker.start_segment(table, initial_version=first_segment // stage.replicas)
    start = time.perf_counter()
    for first, count in segments:
        if first != first_segment:
            table = _rank_table(plan, first, count, rank)
            worker.start_segment(table, initial_version=first // stage.replicas)

        def on_update(action: Action, microbatches: list[int]) -> None:
            losses = [worker.losses.pop(mb) for mb in microbatches if mb in worker.losses]
            if logger is not None and losses:
                logger.log(action.index, float(torch.stack(losses).mean()))

        executor = Executor(
            worker,
            table,
            P2P(rank=rank, device=device, timeout=options.timeout, post_early=backend == "gloo"),
            rank=rank,
            replica_group=groups.get(stage_index),
            num_replicas=stage.replicas,
            check_versions=plan.schedule == "pipedream-vs",
            timeout=options.timeout,
            on_update=on_update,
            trace=trace,
        )
        executor.run()
        stats["max_versions"] = max(stats["max_versions"], worker.versions.max_versions)
        stats["max_copies"] = max(stats["max_copies"], worker.versions.max_copies)
        stats["max_in_flight"] = max(stats["max_in_flight"], worker.max_in_flight)
        _checkpoint(
            checkpoint_dir / step_dir_name(first + count),
            worker,
            plan,
            rank,
            stage_index,
            first + count,
            data_position=(first + count) * plan.microbatches,
        )
    elapsed = time.perf_counter() - start
    stats.update(stage=stage_index, rank=rank, copy_bytes=worker.versions.copy_bytes)
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, stats)
    if trace is not None:
        _write_trace(run_dir, trace, rank=rank, stage=stage_index, world_size=env.world_size)
    final = checkpoint_dir / step_dir_name(options.steps)
    if logger is not None:
        _summary(options, plan, workload, logger, elapsed, everyone, final, run_dir)
        logger.close()
    dist.barrier()
    return 0


TRACE_FORMAT = "pipedream/trace@1"


def _write_trace(
    run_dir: Path,
    trace: list[tuple[str, float, float]],
    *,
    rank: int,
    stage: int,
    world_size: int,
) -> None:
    """``traces/rank-NNN.json``: every action's start and end, on a clock shared by all ranks.

    The executor records ``time.perf_counter()`` (cheap, monotonic); it is converted to Unix
    seconds with one offset per rank so that the ranks' timelines line up when merged.
    """
    offset = time.time() - time.perf_counter()
    payload = {
        "format": TRACE_FORMAT,
        "rank": rank,
        "stage": stage,
        "world_size": world_size,
        "clock": "unix seconds",
        "events": [
            {"action": name, "start": start + offset, "end": end + offset}
            for name, start, end in trace
        ],
    }
    directory = run_dir / "traces"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank-{rank:03d}.json").write_text(json.dumps(payload))


def _resume_point(options: TrainOptions, plan: Plan) -> Path | None:
    """The checkpoint to resume from (``--resume auto|PATH``), checked against the plan."""
    if options.resume is None:
        return None
    if options.resume == "auto":
        if options.run_dir is None:
            raise LaunchError("--resume auto needs --run-dir (the run whose checkpoints to use)")
        found = find_latest_checkpoint(Path(options.run_dir) / "checkpoints")
        if found is None:
            print(
                f"pipedream: no checkpoint in {options.run_dir}; starting from scratch",
                file=sys.stderr,
            )
            return None
        path = found
    else:
        path = Path(options.resume)
    manifest = load_manifest(path)
    samples = (manifest.get("microbatch_size"), manifest.get("microbatches"))
    if manifest.get("workload") != plan.workload:
        raise CheckpointError(
            f"{path}: was written for workload {manifest.get('workload')!r}, the plan trains "
            f"{plan.workload!r}"
        )
    if samples != (plan.microbatch_size, plan.microbatches):
        raise CheckpointError(
            f"{path}: minibatches of {samples[1]} x {samples[0]} samples, the plan uses "
            f"{plan.microbatches} x {plan.microbatch_size}; the data position would not match"
        )
    return path


def _agree_on_run_dir(requested: str | None) -> Path:
    """All ranks use rank 0's choice (a timestamp differs between processes)."""
    choice = [requested or time.strftime("runs/%Y%m%d-%H%M%S")]
    dist.broadcast_object_list(choice, src=0)
    path = Path(choice[0])
    path.mkdir(parents=True, exist_ok=True)
    return path


def _checkpoint(
    directory: Path,
    worker: StageWorker,
    plan: Plan,
    rank: int,
    stage_index: int,
    step: int,
    *,
    data_position: int,
) -> None:
    """Replica 0 of every stage writes its file; rank 0 writes the manifest last."""
    entry = None
    if plan.stages[stage_index].ranks[0] == rank:
        payload = stage_payload(
            worker.module,
            worker.optimizer,
            stage=stage_index,
            step=step,
            data_position=data_position,
        )
        entry = (stage_index, *save_stage_file(directory, stage_index, payload))
    entries: list[Any] = [None] * plan.world_size
    dist.all_gather_object(entries, entry)
    if rank == 0:
        files = sorted(e for e in entries if e is not None)
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
            },
        )
    dist.barrier()


def _summary(
    options: TrainOptions,
    plan: Plan,
    workload: Workload,
    logger: MetricsLogger,
    elapsed: float,
    everyone: list[dict[str, Any]],
    checkpoint: Path,
    run_dir: Path,
) -> None:
    measured = logger.time_per_step_ms()
    predicted = plan.prediction.time_per_minibatch_ms if plan.prediction else None
    summary: dict[str, Any] = {
        "minibatches": options.steps,
        "wall_time_s": round(elapsed, 3),
        "time_per_minibatch_ms_measured": round(measured, 3) if measured else None,
        "time_per_minibatch_ms_predicted": predicted,
        "final_loss": logger.losses[-1] if logger.losses else None,
        "first_loss": logger.losses[0] if logger.losses else None,
        "stages": sorted(everyone, key=lambda s: s["rank"]),
        "checkpoint": str(checkpoint),
    }
    lines = [
        f"done: {options.steps} minibatches in {elapsed:.1f} s; "
        f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}",
        "time per minibatch: "
        + (f"{measured:.2f} ms measured (steady state)" if measured else "n/a measured")
        + (
            f", {predicted:.2f} ms predicted by the plan"
            if predicted is not None
            else " (hand-written plan: no prediction)"
        ),
    ]
    cores = os.cpu_count() or 1
    if plan.world_size > cores and not torch.cuda.is_available():
        lines.append(
            f"note: {plan.world_size} processes share {cores} CPU cores, so measured times "
            "include that contention; the prediction assumes one worker per process"
        )
    for stats in summary["stages"]:
        lines.append(
            f"  rank {stats['rank']} stage {stats['stage']}: up to {stats['max_in_flight']} "
            f"microbatches in flight, {stats['max_versions']} weight versions held "
            f"({stats['max_copies']} copies x {format_bytes(stats['copy_bytes'])})"
        )
    if workload.evaluate is not None:
        workload.model.load_state_dict(load_full_state_dict(checkpoint))
        metrics = workload.evaluate(workload.model)
        summary["evaluation"] = metrics
        lines.append("evaluation: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    lines.append(f"checkpoint: {checkpoint}")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(lines), file=sys.stderr, flush=True)
