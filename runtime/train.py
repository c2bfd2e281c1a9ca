"""``pipedream train``: one process of a pipeline job, started by torchrun (or launch.sh).

Every rank loads the plan and the workload, validates the action tables of every rank, joins the
process group, takes its stage's slice of the model and runs its own table. The run is cut into
segments at checkpoints: a segment's tables drain the pipeline, so every checkpoint is a
consistent state (docs/architecture.md, "The runtime") and a resumed run equals an
uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipedream import wording
from pipedream.data import MicrobatchStream
from pipedream.errors import (
    AlreadyReported,
    CheckpointError,
    PipedreamError,
    RunFailure,
    WorkloadError,
)
from pipedream.formats.plan import Plan, load_plan
from pipedream.formats.trace import RunSettings, TracedAction, remove_traces, write_trace
from pipedream.host_memory import configure_host_memory
from pipedream.precision import SCALES_LOSS, precision_words
from pipedream.runtime.agreement import agree_on_setup, refuse_together
from pipedream.runtime.checkpoint import load_manifest, restore_stage, step_dir_name, untaken
from pipedream.runtime.checkpoint_protocol import (
    check_run_dir,
    newest_checkpoint,
    recipe_change,
    restart_point,
    resume_point,
    write_checkpoint,
)
from pipedream.runtime.comm import P2P
from pipedream.runtime.environment import (
    LaunchEnv,
    Placement,
    device_and_backend,
    read_launch_env,
)
from pipedream.runtime.evaluation import append_evaluation, evaluate_during_run, evaluated_steps
from pipedream.runtime.executor import Executor, LocalStage, wait_collective
from pipedream.runtime.gc_freeze import frozen_heap
from pipedream.runtime.global_norm import ClipPart, GlobalNorm
from pipedream.runtime.grad_buckets import GradientBuckets
from pipedream.runtime.loss_log import LossLog
from pipedream.runtime.loss_scale import LossScaler, check_scalable
from pipedream.runtime.metrics import MetricsLogger
from pipedream.runtime.out_of_memory import DeviceOutOfMemory, how_to_fit, said_in_one_line
from pipedream.runtime.rng_state import seed_segment
from pipedream.runtime.routing import input_needs_grad
from pipedream.runtime.segments import Segments
from pipedream.runtime.stage_layout import StageLayout, stage_layout
from pipedream.runtime.stage_worker import StageWorker, WorkerConfig
from pipedream.runtime.summary import RankStats, failure_reason, peak_memory_bytes, report
from pipedream.runtime.train_options import (
    MAX_TIMEOUT_S,
    TrainOptions,
    check_global_norm,
    check_options,
    check_segments,
    needs_global_norm,
    segments,
)
from pipedream.schedules import (
    Action,
    Posting,
    build_tables,
    lookup,
    message_routes,
    spec_from_plan,
    validate_plan_schedule,
)
from pipedream.workload import Workload, load_workload
from pipedream.workloads.hf_pretrained import config_record

__all__ = ["IN_ORDER_ENV", "make_deterministic", "train"]

IN_ORDER_ENV = "PIPEDREAM_IN_ORDER_P2P"
"""Set to 1, gloo ranks exchange messages as NCCL ranks do (headers on a group of their own,
read in the order they were sent; payloads on a group per direction, not posted ahead):
the tests run the NCCL transport's protocol on machines without GPUs."""


def make_deterministic() -> None:
    """Deterministic kernels (``--deterministic``): the same run gives the same numbers, also on
    a GPU. cuBLAS needs its workspace setting before its first use; attention runs the plain
    (math) kernel, whose backward is deterministic (the flash, memory-efficient and cuDNN ones
    are off: their backwards are not, and with the first two off a bf16 attention on a Hopper
    GPU would run cuDNN's); an operation that has no deterministic kernel warns instead of
    stopping the run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)


@dataclass(frozen=True)
class _Setup:
    """What a rank works out before it meets the others."""

    options: TrainOptions
    """The options, with the resume point and seed settled."""
    workload: Workload
    layout: StageLayout
    resume_from: Path | None
    todo: Segments | None
    """The stretches to train (None: the checkpoint is already at ``--steps``)."""
    placement: Placement | None = None
    posting: Posting | None = None
    note: str = ""
    """A restart's note, said once every rank's setup went well (a setup that fails again
    resumes nothing)."""


def train(options: TrainOptions) -> int:
    _enable_faulthandler()
    configure_host_memory()  # before anything is allocated: every step reuses its memory
    if options.deterministic:
        make_deterministic()
    plan = load_plan(options.plan_path)
    check_options(options)
    check_global_norm(options, plan)
    if options.resume is None:  # from step 0 (a resumed run's start is known further down)
        check_segments(options, plan)
    env = read_launch_env(plan, source=options.plan_path)
    setup: _Setup | None = None
    failure: PipedreamError | None = None
    try:
        setup = _set_up(options, plan, env)
    except PipedreamError as exc:
        if not env.under_torchrun:
            raise
        failure = exc

    timeout = timedelta(seconds=options.timeout)
    if env.under_torchrun:
        # torchrun's store outlives worker restarts (--max-restarts): a namespace per attempt
        # keeps the new workers from reading the dead ones' addresses
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"pipedream/attempt-{env.restart_count}", store)
        # a mistake every rank made is said once per node, not once per rank
        agree_on_setup(
            store,
            failure,
            rank=env.rank,
            world_size=env.world_size,
            local_rank=env.local_rank,
            timeout=timeout,
        )
    assert setup is not None  # a failure raised above
    if setup.note and env.local_rank == 0:
        print(setup.note, file=sys.stderr)
    if setup.todo is None:
        return 0  # nothing to do (said by _set_up)
    options, todo = setup.options, setup.todo
    assert setup.placement is not None and setup.posting is not None
    backend, device = setup.placement.backend, setup.placement.device
    if env.under_torchrun:
        dist.init_process_group(
            backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
        )
    else:
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    workload, layout, resume_from = setup.workload, setup.layout, setup.resume_from
    placement, posting = setup.placement, setup.posting
    job: _RankJob | None = None
    try:
        job = _RankJob(options, plan, env, workload, layout, placement=placement, posting=posting)
        return job.run(todo, resume_from)
    except KeyboardInterrupt:  # Ctrl-C: torchrun passes it to every rank
        if job is None:
            raise
        if env.rank == 0:
            print(f"pipedream train: interrupted; {_how_to_continue(job.run_dir)}", file=sys.stderr)
        return 1
    finally:
        gc.collect()  # drop lingering gloo work objects (in cycles) while the interpreter lives
        dist.destroy_process_group()
        gc.collect()


def _enable_faulthandler() -> None:
    """Have a rank that a C++ library aborts print every thread's Python stack, on the process's
    own stderr: ``sys.stderr`` may have no file descriptor (a notebook, a caller that captures
    it), and the dump is then skipped rather than the run refused."""
    stream = sys.__stderr__
    if faulthandler.is_enabled() or stream is None:
        return
    try:
        faulthandler.enable(file=stream, all_threads=True)
    except (OSError, ValueError):  # io.UnsupportedOperation: no file descriptor behind it
        pass


def _set_up(options: TrainOptions, plan: Plan, env: LaunchEnv) -> _Setup:
    """Everything a rank checks and builds before it meets the others: the resume point, the
    workload and its stages, the device, the schedule's tables (a user error here is every
    rank's: :func:`train` has it said once per node)."""
    source = options.plan_path
    speaks = env.local_rank == 0  # notes every rank would print: one line per node
    note = ""
    if env.restart_count > 0:  # torchrun restarted the workers (--max-restarts)
        resume = restart_point(options.resume, options.run_dir)
        where = "the newest checkpoint" if resume == "auto" else f"{resume}, where the run began"
        note = f"pipedream: restart {env.restart_count}: resuming from {where}"
        options = dataclasses.replace(options, resume=resume)
    workload = load_workload(
        plan.workload, plan.workload_args, microbatch_size=plan.microbatch_size, source=source
    )
    if (options.precision or plan.precision) in SCALES_LOSS:
        where = "--precision fp16" if options.precision else "the plan's precision fp16"
        check_scalable(workload.model, where=where)
    if options.eval_every and workload.evaluate is None:
        raise WorkloadError(
            f"--eval-every {options.eval_every}: the workload {plan.workload} defines no "
            "evaluation (Workload.evaluate); give it one, or leave --eval-every out"
        )
    layout = stage_layout(workload, plan, source=source)
    resume_from = resume_point(options.resume, options.run_dir, plan, note=speaks)
    manifest = load_manifest(resume_from) if resume_from is not None else {}
    start = manifest.get("step", 0)
    if options.seed is None:  # a resumed run goes on with the data order and draws it had
        options = dataclasses.replace(options, seed=manifest.get("seed", 0))
    check_segments(options, plan, start=start)
    if options.resume != "auto":
        check_run_dir(options.run_dir, start)
    if start >= options.steps:
        if speaks:
            print(
                f"pipedream: {resume_from} is already at step {start} >= --steps "
                f"{options.steps}; nothing to do",
                file=sys.stderr,
            )
        return _Setup(options, workload, layout, resume_from, None, note=note)
    todo = segments(options.steps, options.checkpoint_interval, start)
    placement = device_and_backend(env, options.device)
    posting = validate_plan_schedule(
        plan,
        todo.counts,
        source=source,
        edges=layout.edges,
        tied=layout.tied_pairs,
        in_order=_in_order(placement.backend),
        global_norm=needs_global_norm(options, plan),
    )
    return _Setup(options, workload, layout, resume_from, todo, placement, posting, note)


def _how_to_continue(run_dir: Path) -> str:
    """Where an interrupted run can continue from: its newest checkpoint written to the end."""
    newest = newest_checkpoint(run_dir)
    if newest is None:
        return "no checkpoint was written yet (--checkpoint-every N lets a run continue)"
    return (
        f"its newest checkpoint is {newest[0]} (step {newest[1]}): continue with "
        f"--resume auto --run-dir {run_dir}"
    )


class _RankJob:
    """This rank's part of the job: its stage, worker, logger and checkpoints."""

    def __init__(
        self,
        options: TrainOptions,
        plan: Plan,
        env: LaunchEnv,
        workload: Workload,
        layout: StageLayout,
        *,
        placement: Placement,
        posting: Posting,
    ) -> None:
        self.options = options
        self.plan = plan
        self.precision = options.precision or plan.precision
        """What the forwards run in: ``--precision``, else the plan's."""
        self.recompute = options.recompute or plan.recompute
        """Whether backwards recompute their stage's forward: ``--recompute`` or the plan's."""
        self.env = env
        self.workload = workload
        self.layout = layout
        self.placement = placement
        self.device = placement.device
        self.backend = placement.backend
        self.rank = env.rank
        self.buckets: dict[int, GradientBuckets] = {}
        """Per replicated stage of this rank: its allreduce in buckets (set up by run)."""
        self.in_order = _in_order(self.backend)
        """Messages follow NCCL's discipline (on gloo too where IN_ORDER_ENV asks for it)."""
        self.clip = options.clip_grad_norm
        """The global gradient norm the updates clip to (None: no clipping)."""
        self.scaler = LossScaler(self.device) if self.precision in SCALES_LOSS else None
        """fp16's loss scale (None: another precision)."""
        self.global_norm = needs_global_norm(options, plan)
        """Every update waits for the whole model's gradient norm (a ``C`` per update)."""
        self.groups, self.header_group, self.payload_groups, self.clip_group = _new_groups(
            plan,
            layout,
            in_order=self.in_order,
            clip=self.global_norm,
            timeout=timedelta(seconds=options.timeout),
        )
        self.eval_group = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=MAX_TIMEOUT_S))
            if options.eval_every and env.world_size > 1
            else None
        )
        """Where the ranks wait for an evaluation during the run (``--eval-every``), however
        long it takes within a week: an evaluation is no silent peer."""
        self.model_config = config_record(workload.model)
        """A ``transformers`` model's config, which checkpoints record (None: another model)."""
        self.logger: MetricsLogger | None = None
        """The loss's logger, on the rank that reports (set by run)."""
        self.peak_outside_evaluations = 0
        """On a GPU: the peak allocated memory before the latest evaluation during the run."""
        self.posting = posting
        """How far ahead receives are posted and how many sends stay in flight."""
        self.stage_indices = plan.stages_of_rank(self.rank)
        """The stages this rank runs: one, or several (interleaved and V schedules)."""
        self.last_stage = plan.num_stages - 1
        assert options.seed is not None  # train() settles it
        self.seed = options.seed
        self.run_dir = _agree_on_run_dir(options.run_dir)
        self.last_checkpoint: Path | None = None
        self.stored_elsewhere: dict[int, set[str]] = {}
        """Stage -> the names in its state dict that another stage's file stores."""
        self.stretches: list[tuple[int, int]] = []
        """(first minibatch, minibatches) of each stretch between checkpoints started so far:
        the tables the trace's actions ran."""

    def _table(self, first: int, count: int) -> list[Action]:
        spec = spec_from_plan(
            self.plan,
            first,
            count,
            self.layout.edges,
            self.layout.tied_pairs,
            global_norm=self.global_norm,
        )
        return build_tables(spec, only_ranks=(self.rank,))[self.rank]

    def _worker(self, stage: int, table: list[Action], first: int) -> StageWorker:
        plan = self.plan
        data = None
        if stage in (0, self.last_stage):  # inputs on the first stage, targets on the last
            data = MicrobatchStream(self.workload.dataset, plan.microbatch_size, self.seed)
        config = WorkerConfig(
            stage=stage,
            num_stages=plan.num_stages,
            microbatches=plan.microbatches,
            device=self.device,
            recompute=self.recompute,
            precision=self.precision,
            skip_nonfinite=self.options.on_nonfinite == "skip",
            replicas=plan.stages[stage].replicas,
            replica_phase=first % plan.stages[stage].replicas,
        )
        module = self.layout.build(stage)
        # before the worker moves the module: which tensors other stages store, by identity
        self.stored_elsewhere[stage] = self.layout.stored_elsewhere(stage, module)
        return StageWorker(
            config,
            module,
            table,
            optimizer_factory=self.workload.optimizer,
            loss_fn=self.workload.loss_fn,
            data=data,
            initial_version=first // plan.stages[stage].replicas,
            model_io=self.layout.model_io,
            tied=self.layout.tied_links(stage, module),
            input_grads=input_needs_grad(self.layout.ios[stage]),
            lr_schedule=self.workload.lr_schedule,
            loss_scale=self.scaler.scale if self.scaler and stage == self.last_stage else None,
        )

    def _buckets(self, stage: int, worker: StageWorker) -> GradientBuckets:
        """The stage's replica allreduce in buckets, fed by the worker's backwards."""

        def wait(work: Any, what: str) -> None:
            nccl, timeout = self.backend == "nccl", self.options.timeout
            wait_collective(work, what, rank=self.rank, nccl=nccl, timeout=timeout)

        buckets = GradientBuckets(
            worker.accumulations(),
            self.groups[stage],
            num_replicas=self.plan.stages[stage].replicas,
            wait=wait,
        )
        worker.watch_gradients(buckets.accumulated)
        return buckets

    def _logger(self, start: int) -> MetricsLogger | None:
        """The first replica of the last stage computes the loss and reports it; ``start``:
        the minibatch the run begins at (a resumed run's checkpoint step)."""
        plan = self.plan
        last = plan.stages[self.last_stage]
        if self.last_stage not in self.stage_indices or last.ranks[0] != self.rank:
            return None
        unused = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if unused and self.device.type == "cpu" and self.options.device == "auto":
            print(
                f"pipedream: note: {wording.count(unused, 'GPU')} for "
                f"{self.env.local_world_size} ranks on this node: training on the CPU; "
                "--device cuda-shared puts the ranks on the GPUs",
                file=sys.stderr,
            )
        steps = self.options.steps
        todo = wording.count(steps - start, "minibatch")
        if start:
            todo += f" {start}..{steps - 1} (resumed at step {start})"
        print(
            f"pipedream: {plan.workload} on {self.placement.describe(plan.world_size)}, "
            f"{wording.count(plan.num_stages, 'stage')}, schedule {plan.schedule}, "
            + precision_words(self.precision)
            + ("recomputing activations, " if self.recompute else "")
            + (f"clipping gradients to norm {self.clip:g}, " if self.clip is not None else "")
            + f"{todo} "
            f"of {plan.microbatches} x {plan.microbatch_size} samples; "
            f"{_posting_note(self.posting)}run dir {self.run_dir}",
            file=sys.stderr,
            flush=True,
        )
        return MetricsLogger(
            self.run_dir / "metrics.jsonl",
            total_steps=self.options.steps,
            first_step=start,
            minibatches_per_update=last.replicas,
            samples_per_step=plan.microbatch_size * plan.microbatches * last.replicas,
            progress=self.options.progress,
        )

    def _segments(
        self,
        todo: Segments,
        workers: dict[int, StageWorker],
        loss_log: LossLog,
        trace: list[TracedAction] | None,
        peaks: dict[str, int],
    ) -> tuple[float, float]:
        """Run the segments between checkpoints, writing one after each; returns the seconds
        spent in actions and the seconds the segments ran (from their first action to their
        last, the queued GPU work included, checkpoint writes not), and raises the peaks seen."""
        compute_s = elapsed_s = 0.0
        for first, count in todo:
            if first != todo[0][0]:
                table = self._table(first, count)
                for stage, worker in workers.items():
                    replicas = self.plan.stages[stage].replicas
                    worker.start_segment(table, initial_version=first // replicas)
            seed_segment(self.seed, self.rank, first)  # what a resumed run draws too
            executor = self._executor(workers, loss_log, trace)
            self.stretches.append((first, count))
            start = time.perf_counter()
            try:
                executor.run()
                loss_log.read()  # every loss of the segment checked before its checkpoint
            except DeviceOutOfMemory as exc:
                fit = how_to_fit(self.plan, exc.stage, recompute=self.recompute)
                where = self.last_checkpoint or "none yet"
                raise DeviceOutOfMemory(
                    f"{exc}; {fit}; the last good checkpoint: {where}", stage=exc.stage
                ) from None
            except RunFailure as exc:
                where = self.last_checkpoint or "none yet"
                raise type(exc)(f"{exc}; the last good checkpoint: {where}") from None
            compute_s += executor.compute_s  # on a GPU, waits for the segment's queued work
            elapsed_s += time.perf_counter() - start
            for worker in workers.values():
                peaks["max_versions"] = max(peaks["max_versions"], worker.versions.max_versions)
                peaks["max_copies"] = max(peaks["max_copies"], worker.versions.max_copies)
                peaks["max_in_flight"] = max(peaks["max_in_flight"], worker.max_in_flight)
            step = first + count
            directory = self.run_dir / "checkpoints" / step_dir_name(step)
            write_checkpoint(
                directory,
                [
                    (stage, worker, self.stored_elsewhere[stage])
                    for stage, worker in workers.items()
                ],
                self.plan,
                rank=self.rank,
                step=step,
                keep=self.options.keep,
                seed=self.seed,
                tied=[tensor.names for tensor in self.layout.tied],
                loss_scale=self.scaler.state_dict() if self.scaler is not None else None,
                recipe={"precision": self.precision, "clip_grad_norm": self.clip},
                model_config=self.model_config,
            )
            self.last_checkpoint = directory
            every = self.options.eval_every
            if every and step % every == 0 and step < self.options.steps:
                self._evaluate(directory, step)  # the last one is the summary's
        return compute_s, elapsed_s

    def _evaluate(self, checkpoint: Path, step: int) -> None:
        """The workload's evaluation at ``checkpoint``, on the reporting rank, while the
        others wait (``--eval-every``); a step ``evaluations.jsonl`` already holds (a resumed
        run's first checkpoint) is not evaluated again. An evaluation that fails stops every
        rank, said once per node: by the evaluating rank on its node, before the others learn
        of it (torchrun stops a node's ranks once one has exited), and by the first rank of
        every other node."""
        failure = None
        node = self.env.rank - self.env.local_rank  # torchrun numbers a node's ranks in a row
        if self.logger is not None and step not in evaluated_steps(self.run_dir):
            failure = self._evaluate_here(checkpoint, step)
            if failure is not None:
                print(f"pipedream train: error: {failure}", file=sys.stderr, flush=True)
        if self.eval_group is not None:  # everyone learns how it went, however long it took
            outcome = [(failure, node)]
            reporter = self.plan.stages[self.last_stage].ranks[0]
            try:
                dist.broadcast_object_list(outcome, src=reporter, group=self.eval_group)
            except RuntimeError:  # a rank died (killed, out of memory): torch's DistError
                if failure is not None:
                    raise AlreadyReported(failure) from None
                who = "a rank" if self.rank == reporter else f"rank {reporter}"
                raise RunFailure(
                    f"rank {self.rank}: {who} stopped while the evaluation at step {step} was "
                    f"made or reported; {self._resume_advice(checkpoint, evaluate=False)}"
                ) from None
            failure, reporter_node = outcome[0]
            if failure is not None and self.logger is None:
                if reporter_node != node and self.env.local_rank == 0:  # another node's line
                    print(f"pipedream train: error: {failure}", file=sys.stderr, flush=True)
        if failure is not None:
            raise AlreadyReported(failure)

    def _evaluate_here(self, checkpoint: Path, step: int) -> str | None:
        """Evaluate ``checkpoint`` on this, the reporting rank; what went wrong, if anything."""
        assert self.logger is not None
        on_gpu = self.device.type == "cuda"
        if on_gpu:  # the summary's peak is the training's, not the evaluation's copy's
            self.peak_outside_evaluations = max(
                self.peak_outside_evaluations, peak_memory_bytes(self.device)
            )
        try:
            metrics = evaluate_during_run(self.workload, checkpoint, self.device)
        except Exception as exc:  # the workload's code: one line, every rank stops
            return (
                f"the workload's evaluation at step {step} failed ({failure_reason(exc)}); "
                f"pipedream evaluate {checkpoint} shows where; fix it, then "
                f"{self._resume_advice(checkpoint, evaluate=True)}"
            )
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)
        append_evaluation(self.run_dir, step, metrics)
        said = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "step")
        self.logger.say(f"step {step:>6}/{self.options.steps}  evaluation: {said}")
        return None

    def _resume_advice(self, checkpoint: Path, *, evaluate: bool) -> str:
        """How to continue from ``checkpoint``; ``evaluate``: its evaluation is still to make
        (a resumed run makes it first)."""
        inside = self.run_dir.resolve() in checkpoint.resolve().parents
        how = "--resume auto" if inside else f"--resume {checkpoint}"
        return f"{how} continues from {checkpoint}" + (", evaluating it first" if evaluate else "")

    def _fitting(self, stage: int, doing: str) -> contextlib.AbstractContextManager[None]:
        """Out of device memory while ``doing`` something for ``stage``: one line."""
        return said_in_one_line(
            f"rank {self.rank} ran out of memory on {self.device} {doing}",
            plan=self.plan,
            stage=stage,
            recompute=self.recompute,
        )

    def run(self, todo: Segments, resume_from: Path | None) -> int:
        first, count = todo[0]
        table = self._table(first, count)
        workers = {}
        for stage in self.stage_indices:  # a stage too big for its device: one line
            with self._fitting(stage, f"placing stage {stage} (its weights and buffers)"):
                workers[stage] = self._worker(stage, table, first)
        own = self.stage_indices[0]
        if resume_from is not None:
            with self._fitting(own, f"restoring {resume_from}"):
                self._restore(workers, resume_from)
                saved_scale = load_manifest(resume_from).get("loss_scale")
                if self.scaler is not None and saved_scale is not None:
                    self.scaler.load_state_dict(saved_scale)  # an fp16 run goes on with it
            self.last_checkpoint = resume_from
        with self._fitting(own, "allocating the buckets of the replicas' allreduce"):
            self.buckets = {
                stage: self._buckets(stage, worker)
                for stage, worker in workers.items()
                if stage in self.groups
            }
        logger = self.logger = self._logger(first)
        every = self.options.eval_every
        if resume_from is not None and every and first > 0 and first % every == 0:
            self._evaluate(resume_from, first)  # unless the interrupted run did
        trace: list[TracedAction] | None = [] if self.options.trace else None
        peaks = {"max_versions": 0, "max_copies": 0, "max_in_flight": 0}
        with frozen_heap():  # no full collection pauses the loop (runtime/gc_freeze.py)
            start = time.perf_counter()
            loss_log = LossLog(logger, microbatches=self.plan.microbatches, device=self.device)
            try:
                compute_s, running_s = self._segments(todo, workers, loss_log, trace, peaks)
            except BaseException:  # a failure, Ctrl-C: the actions that ran show where it stopped
                if trace is not None:
                    self._write_trace(trace, complete=False)
                raise
            elapsed = time.perf_counter() - start
        # a skipped microbatch is skipped at every stage: count it once, at the loss if here
        counted = workers.get(self.last_stage) or workers[self.stage_indices[0]]
        stats = RankStats(
            rank=self.rank,
            stage=self.stage_indices[0],
            stages=self.stage_indices,
            compute_s=compute_s,
            elapsed_s=running_s,
            copy_bytes=sum(worker.versions.copy_bytes for worker in workers.values()),
            peak_memory_bytes=max(peak_memory_bytes(self.device), self.peak_outside_evaluations),
            skipped=len(counted.skipped),
            tied_copy_bytes=sum(worker.copy_bytes for worker in workers.values()),
            **peaks,
        )
        everyone: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(everyone, stats)
        if trace is not None:
            self._write_trace(trace, complete=True)
        # the others are done: they must not wait, under the run's timeout, for the report's
        # evaluation of the whole model on this rank
        dist.barrier()
        if logger is not None:
            assert self.last_checkpoint is not None
            summary = report(
                plan=self.plan,
                steps=self.options.steps - todo[0][0],
                first_step=todo[0][0],
                workload=self.workload,
                logger=logger,
                elapsed=elapsed,
                ranks=everyone,
                checkpoint=self.last_checkpoint,
                run_dir=self.run_dir,
                device=self.device,
                recompute=self.recompute,
                precision=self.precision,
                loss_scale=self._loss_scale_report(),
            )
            if self.options.eval_every and "evaluation" in summary:
                append_evaluation(self.run_dir, self.options.steps, summary["evaluation"])
            logger.close()
        return 0

    def _restore(self, workers: dict[int, StageWorker], directory: Path) -> None:
        """Restore every stage of the rank from the checkpoint, and with the other ranks check
        that the plan's model took all of it. A checkpoint that does not fit is refused in one
        message per node: every rank's problem, or the tensors no stage took."""
        problem, restored = None, []
        try:
            for worker in workers.values():
                restored.append(
                    restore_stage(
                        directory, worker.module, worker.optimizer, param_names=worker.param_names
                    )
                )
                # the first version must be taken of the restored weights, not the initial ones
                worker.start_segment(
                    worker.versions.table, initial_version=worker.versions.live_version
                )
        except CheckpointError as exc:
            problem = str(exc)
        everyone: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(everyone, (problem, restored))
        if any(found is not None for found, _ in everyone):
            refuse_together([found for found, _ in everyone], local_rank=self.env.local_rank)
        left = untaken([each for _, theirs in everyone for each in theirs])
        if left:
            manifest = load_manifest(directory)
            message = (
                f"{directory}: {len(left)} of its tensors are not in the plan's model "
                f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}): it was written for "
                f"{manifest.get('workload')} {manifest.get('workload_args') or {}}, the plan "
                f"trains {self.plan.workload} {self.plan.workload_args}; resume with the "
                "workload_args the checkpoint was written with"
            )
            refuse_together([message] * self.env.world_size, local_rank=self.env.local_rank)
        changed = [c for _, theirs in everyone for each in theirs for c in each.changed_settings]
        if changed and self.rank == 0:
            print(settings_note(directory, changed), file=sys.stderr)
        if self.rank == 0:
            note = recipe_change(load_manifest(directory), self.precision, self.clip)
            if note:
                print(f"pipedream: note: {directory} {note}", file=sys.stderr)

    def _write_trace(self, trace: list[TracedAction], *, complete: bool) -> None:
        write_trace(
            self.run_dir,
            trace,
            rank=self.rank,
            stage=self.stage_indices[0],
            world_size=self.env.world_size,
            edges=self.layout.edges,
            tied=self.layout.tied_pairs,
            stretches=self.stretches,
            plan=self.plan,
            complete=complete,
            run=RunSettings(self.precision, self.recompute),
        )

    def _executor(
        self,
        workers: dict[int, StageWorker],
        loss_log: LossLog,
        trace: list[TracedAction] | None,
    ) -> Executor:
        last = workers.get(self.last_stage)
        global_norm = self._global_norm(workers)

        def on_update(action: Action, microbatches: list[int]) -> None:
            if last is None or action.stage != self.last_stage:
                return
            losses = [(mb, last.losses.pop(mb)) for mb in microbatches if mb in last.losses]
            norm = global_norm.norm_of(action.index) if global_norm is not None else None
            skipped = global_norm is not None and global_norm.skips(action.index)
            loss_log.add(action.index, losses, grad_norm=norm, skipped=skipped)

        stages = {
            stage: LocalStage(
                worker,
                self.layout.ios[stage],
                num_replicas=self.plan.stages[stage].replicas,
                buckets=self.buckets.get(stage),
            )
            for stage, worker in workers.items()
        }
        plan = self.plan
        places = {
            stage: plan.stages_of_rank(ranks.ranks[0]).index(stage)
            for stage, ranks in enumerate(plan.stages)
        }
        return Executor(
            stages,
            next(iter(workers.values())).versions.table,
            P2P(
                rank=self.rank,
                device=self.device,
                timeout=self.options.timeout,
                post_early=not self.in_order,
                staged=self.placement.staged,
                nccl=self.in_order,
                header_group=self.header_group,
                payload_groups=self.payload_groups if self.in_order else None,
                messages_in_flight=self.posting.messages_in_flight,
            ),
            rank=self.rank,
            places=places,
            check_versions=lookup(plan.schedule).vertical_sync,
            receive_window=self.posting.window,
            timeout=self.options.timeout,
            on_update=on_update,
            trace=trace,
            global_norm=global_norm,
        )

    def _loss_scale_report(self) -> tuple[int, float] | None:
        """fp16: the updates this run skipped for an overflow and the final scale."""
        if self.scaler is None:
            return None
        return self.scaler.skipped, float(self.scaler.scale)

    def _global_norm(self, workers: dict[int, StageWorker]) -> GlobalNorm | None:
        """This rank's share of every update's global norm, to clip or to check fp16's
        gradients (None: neither); a stage's first replica counts its gradient in the norm."""
        if not self.global_norm:
            return None

        def wait(work: Any, what: str) -> None:
            nccl, timeout = self.backend == "nccl", self.options.timeout
            wait_collective(work, what, rank=self.rank, nccl=nccl, timeout=timeout)

        parts = [
            ClipPart(worker, counted=self.plan.stages[stage].ranks[0] == self.rank)
            for stage, worker in workers.items()
        ]
        # float64 on every rank where any stage has float64 weights: one dtype to allreduce
        float64 = any(p.dtype == torch.float64 for p in self.workload.model.parameters())
        return GlobalNorm(
            parts,
            device=self.device,
            wait=wait,
            group=self.clip_group,
            float64=float64,
            max_norm=self.clip,
            scaler=self.scaler,
        )


def settings_note(checkpoint: Path, changed: list[str]) -> str:
    """What a resumed run says of the optimizer settings that differ from ``checkpoint``'s, as
    every stage found them (``"lr 0.1 -> 0.05"``, ``"weight_decay 0.01 -> 0.0 for 0.bias,
    2.bias"``): each once, ``;`` between them (a change may name parameters, with commas)."""
    return (
        f"pipedream: the workload's optimizer settings differ from those of {checkpoint} and are "
        f"used: {'; '.join(dict.fromkeys(changed))} (the optimizer's state is the checkpoint's)"
    )


def _new_groups(
    plan: Plan, layout: StageLayout, *, in_order: bool, clip: bool, timeout: timedelta
) -> tuple[dict[int, Any], Any, dict[tuple[int, int], Any], Any]:
    """The process groups besides the default one: each replicated stage's (its allreduce),
    with ``clip`` one of all ranks (the gradient norm's allreduce, apart from the messages),
    and under NCCL's discipline the headers' (gloo, so reading one never waits for the GPU) and
    one per direction between two ranks (a communicator and a stream of its own). Every rank
    creates every group, in the same order. Each waits ``timeout`` (``--timeout``) for a peer,
    as the default group does: ``new_group``'s own default is 30 minutes on gloo and 10 on
    NCCL, and on NCCL the groups' timeout is what ends a transfer that never completes."""
    replicas = {
        index: dist.new_group(list(stage.ranks), timeout=timeout)
        for index, stage in enumerate(plan.stages)
        if stage.replicas > 1
    }
    norm = dist.new_group(timeout=timeout) if clip else None
    if not in_order:
        return replicas, None, {}, norm
    header = dist.new_group(backend="gloo", timeout=timeout)
    routes = message_routes(plan, edges=layout.edges, tied=layout.tied_pairs)
    payloads = {route: dist.new_group(sorted(route), timeout=timeout) for route in routes}
    return replicas, header, payloads, norm


def _in_order(backend: str) -> bool:
    """Whether messages follow NCCL's discipline: on NCCL, and on gloo where ``IN_ORDER_ENV``
    asks for it."""
    return backend == "nccl" or os.environ.get(IN_ORDER_ENV) == "1"


def _posting_note(posting: Posting) -> str:
    """The start line's note of a bound on sends in flight raised above the default (none for
    the default; the runtime raises nothing else)."""
    assert posting.window == Posting().window, posting
    if posting == Posting():
        return ""
    return (
        f"{posting.messages_in_flight} sent messages in flight (raised: with fewer, ranks could "
        "wait for each other's sends forever); "
    )


def _agree_on_run_dir(requested: str | None) -> Path:
    """All ranks use rank 0's choice (a timestamp differs between processes). The traces an
    earlier run left there are deleted first (rank 0: every rank's on its node, before any
    rank can write; each other rank: its own, on nodes that do not share the directory), so
    that ``traces/`` holds this run's timelines or none."""
    choice = [requested or time.strftime("runs/%Y%m%d-%H%M%S")]
    rank = dist.get_rank()
    if rank == 0:
        path = Path(choice[0])
        path.mkdir(parents=True, exist_ok=True)
        removed = remove_traces(path)
        if removed:
            print(
                f"pipedream: note: deleted the traces of an earlier run in {path / 'traces'} "
                f"({removed} file(s)): traces/ holds this run's timelines or none",
                file=sys.stderr,
            )
    dist.broadcast_object_list(choice, src=0)
    path = Path(choice[0])
    if rank != 0:
        path.mkdir(parents=True, exist_ok=True)
        remove_traces(path, rank=rank)
    return path
