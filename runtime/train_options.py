"""The options of ``pipedream train`` and the checks that need no process group: each rank
makes them, and ``launch.sh`` makes them before it starts any rank, so that a bad option ends
with one line rather than one per rank and torchrun's failure report."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from pipedream.errors import LaunchError
from pipedream.formats.plan import Plan
from pipedream.precision import SCALES_LOSS
from pipedream.runtime.segments import Segments
from pipedream.schedules import MAX_TABLE_ACTIONS, actions_per_minibatch, spec_from_plan
from pipedream.schedules.global_norm import global_norm_problem

__all__ = [
    "TrainOptions",
    "check_global_norm",
    "check_options",
    "check_segments",
    "needs_global_norm",
    "segments",
    "train_options",
]


@dataclass(frozen=True)
class TrainOptions:
    """Options of ``pipedream train`` (see ``pipedream train --help``)."""

    plan_path: str
    steps: int
    run_dir: str | None = None
    seed: int | None = None
    """The data order's and the random draws' seed; None: 0, or a resumed checkpoint's."""
    checkpoint_every: int = 0
    eval_every: int = 0
    """Evaluate the whole model every this many minibatches, at a checkpoint (0: only at the
    end)."""
    resume: str | None = None
    keep: int = 0
    on_nonfinite: str = "stop"
    trace: bool = False
    precision: str | None = None
    """``fp32``, ``bf16`` or ``fp16`` (:mod:`pipedream.precision`); None: the plan's."""
    recompute: bool = False
    clip_grad_norm: float | None = None
    """Clip every update's gradient to this global norm (:mod:`pipedream.runtime.global_norm`);
    None: no clipping."""
    device: str = "auto"
    deterministic: bool = False
    timeout: float = 300.0
    progress: bool = True

    @property
    def checkpoint_interval(self) -> int:
        """Minibatches between checkpoints (0: only at the end): ``--checkpoint-every``, else
        ``--eval-every``, whose evaluations are of checkpoints."""
        return self.checkpoint_every or self.eval_every


def segments(steps: int, every: int, start: int = 0) -> Segments:
    """(first minibatch, count) of each stretch between checkpoints, from ``start`` on.

    Boundaries are multiples of ``every`` counted from 0, so a resumed run drains and
    checkpoints at exactly the same minibatches as an uninterrupted one.
    """
    return Segments(start=start, steps=steps, every=every)


MIN_TIMEOUT_S = 1.0
"""Shortest ``--timeout``: the process groups' rendezvous needs about that long (0.001 s timed
it out)."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest ``--timeout``, a week: long enough for any silent peer worth waiting for, and far
below what the process groups' timers hold (``inf`` and ``1e308`` overflowed them)."""


def check_options(options: TrainOptions) -> None:
    """Options that cannot work (each rank checks them, and ``launch.sh`` before it starts
    any)."""
    if options.steps < 1:
        raise LaunchError(f"--steps must be >= 1, got {options.steps}; give the minibatches to run")
    if options.checkpoint_every < 0:
        raise LaunchError(
            f"--checkpoint-every must be >= 0, got {options.checkpoint_every}; "
            "0 means only at the end"
        )
    if options.eval_every < 0:
        raise LaunchError(
            f"--eval-every must be >= 0, got {options.eval_every}; 0 evaluates only at the end"
        )
    every = options.checkpoint_every
    if options.eval_every and every and options.eval_every % every:
        raise LaunchError(
            f"--eval-every {options.eval_every} is not a multiple of --checkpoint-every {every}: "
            f"each evaluation is of a checkpoint; use e.g. --eval-every "
            f"{max(every, options.eval_every // every * every)}"
        )
    if options.keep < 0:
        raise LaunchError(f"--keep must be >= 0, got {options.keep}; 0 keeps every checkpoint")
    if not MIN_TIMEOUT_S <= options.timeout <= MAX_TIMEOUT_S:  # also nan
        raise LaunchError(
            f"--timeout must be {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} seconds, got "
            f"{options.timeout:g}; e.g. --timeout 300"
        )
    if options.run_dir is not None:
        check_run_dir_path(options.run_dir)
    check_max_norm(options.clip_grad_norm)


def check_max_norm(max_norm: float | None) -> None:
    """``--clip-grad-norm`` must be a finite positive number."""
    if max_norm is not None and not (math.isfinite(max_norm) and max_norm > 0):
        raise LaunchError(
            f"--clip-grad-norm must be a finite positive number, got {max_norm:g}; e.g. "
            "--clip-grad-norm 1.0 (leave it out not to clip)"
        )


def needs_global_norm(options: TrainOptions, plan: Plan) -> bool:
    """Whether every update waits for the whole model's gradient norm: to clip it, or for
    fp16's overflow check (``--precision fp16``, or a plan made from an fp16 profile)."""
    precision = options.precision or plan.precision
    return options.clip_grad_norm is not None or precision in SCALES_LOSS


def check_global_norm(options: TrainOptions, plan: Plan) -> None:
    """``--clip-grad-norm`` and fp16 need a schedule that flushes (or one stage) and equal
    replicas at every stage (:func:`pipedream.schedules.global_norm.global_norm_problem`)."""
    if not needs_global_norm(options, plan):
        return
    problem = global_norm_problem(spec_from_plan(plan, 0, plan.steps_multiple, global_norm=True))
    if not problem:
        return
    if options.clip_grad_norm is not None:
        raise LaunchError(f"--clip-grad-norm {options.clip_grad_norm:g}: {problem}")
    where = "--precision fp16" if options.precision else "the plan's precision fp16"
    raise LaunchError(
        f"{where} (its loss scale skips an overflowing update on every stage): {problem}; or "
        "train in bf16"
    )


_RUN_DIR_ENTRIES = {
    "checkpoints": "a directory",
    "traces": "a directory",
    "metrics.jsonl": "a file",
    "evaluations.jsonl": "a file",
    "summary.json": "a file",
}
"""What a run directory holds at these names (a run writes them)."""


def check_run_dir_path(run_dir: str) -> None:
    """``--run-dir`` must be a directory, or a path where one can be made: a file on the way
    (or one where the run writes a directory, and the reverse) gave a traceback from every
    rank, some only after training."""
    if not run_dir.strip():
        raise LaunchError("--run-dir is empty; give the run's directory, e.g. --run-dir runs/a")
    path = Path(run_dir)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise LaunchError(
                    f"--run-dir {run_dir}: {folder} is not a directory; give another path"
                )
            break
    for name, kind in _RUN_DIR_ENTRIES.items():
        entry = path / name
        if entry.exists() and entry.is_dir() != (kind == "a directory"):
            raise LaunchError(
                f"--run-dir {run_dir}: {entry} is not {kind}, where the run writes one; "
                "move it away or give another --run-dir"
            )


def check_segments(options: TrainOptions, plan: Plan, *, start: int = 0) -> None:
    """The stretches between checkpoints, from ``start`` (where a resumed run begins), must be
    whole rounds of every stage's replicas, and short enough for a rank's action table."""
    multiple = plan.steps_multiple
    stretches = segments(options.steps, options.checkpoint_interval, start)
    flag = "--eval-every" if options.eval_every and not options.checkpoint_every else None
    flag = flag or "--checkpoint-every"  # the option that sets the checkpoints
    for first, count in stretches.representatives():
        if count % multiple:
            resumed = f"; the run resumes at step {start}" if start else ""
            counts = sorted({stage.replicas for stage in plan.stages if stage.replicas > 1})
            if len(counts) == 1:
                index = next(i for i, stage in enumerate(plan.stages) if stage.replicas > 1)
                which, lcm = f"stage {index} has {multiple} replicas", ""
            else:
                listed = ", ".join(str(c) for c in counts[:-1])
                which = f"the stages have {listed} and {counts[-1]} replicas"
                lcm = ", their least common multiple"
            if start % multiple:  # a checkpoint another plan wrote: multiples do not fit
                steps = start + max(multiple, count - count % multiple)
                raise LaunchError(
                    f"{which}, so every stretch between checkpoints must be a multiple of "
                    f"{multiple}{lcm}; the run resumes at step {start}, not a multiple of "
                    f"{multiple} (a checkpoint of another plan), so checkpoints at multiples of "
                    f"{flag} do not fit: train without {flag} to a step "
                    f"{multiple} x k after {start} (e.g. --steps {steps}), then resume from there"
                )
            raise LaunchError(
                f"{which}, so --steps and {flag} must be multiples of {multiple}"
                f"{lcm} (a segment of {count} minibatches starts at {first}{resumed})"
            )
    longest = max(stretches.counts, default=0)
    per_minibatch = actions_per_minibatch(plan)
    if longest * per_minibatch > MAX_TABLE_ACTIONS:
        fitting = MAX_TABLE_ACTIONS // per_minibatch // multiple * multiple
        fix = (
            f"use {flag} {fitting} or less (each stretch between checkpoints runs as one table)"
            if fitting >= 1
            else "use fewer microbatches per minibatch"
        )
        every = options.checkpoint_interval
        given = f"{flag} {every}" if every else "no --checkpoint-every"
        raise LaunchError(
            f"a stretch of {longest} minibatches between checkpoints (--steps {options.steps}, "
            f"{given}) needs action tables of up to {longest * per_minibatch:,} actions per "
            f"rank (at most {MAX_TABLE_ACTIONS:,}: about 2 GB of host memory, built before the "
            f"stretch starts); {fix}"
        )


def train_options(args: argparse.Namespace) -> TrainOptions:
    """The options of ``pipedream train`` as its command line gave them."""
    return TrainOptions(
        plan_path=args.plan,
        steps=args.steps,
        run_dir=args.run_dir,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        resume=args.resume,
        keep=args.keep,
        on_nonfinite=args.on_nonfinite,
        trace=args.trace,
        precision=args.precision,
        recompute=args.recompute,
        clip_grad_norm=args.clip_grad_norm,
        device=args.device,
        deterministic=args.deterministic,
        timeout=args.timeout,
        progress=not args.no_progress,
    )
