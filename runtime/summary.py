"""The end-of-run summary: measured vs predicted time per minibatch, per-rank busy and bubble
fractions, peak memory, weight versions held, and the workload's evaluation."""

from __future__ import annotations

import json
import math
import numbers
import os
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipedream.errors import PipedreamError, WorkloadError
from pipedream.formats.plan import Plan
from pipedream.formats.units import format_bytes
from pipedream.formats.yamlio import atomic_write_text
from pipedream.precision import DEFAULT_PRECISION
from pipedream.runtime.checkpoint import check_fits, load_full_state_dict
from pipedream.runtime.metrics import MetricsLogger
from pipedream.wording import count
from pipedream.workload import Workload

__all__ = [
    "RankStats",
    "checked_metrics",
    "evaluate_checkpoint",
    "failure_reason",
    "finite",
    "peak_memory_bytes",
    "report",
]


@dataclass(frozen=True)
class RankStats:
    """What one rank measured about itself."""

    rank: int
    stage: int
    max_in_flight: int
    """Most microbatches between forward and backward at once."""
    max_versions: int
    """Most weight versions held at once."""
    max_copies: int
    """Most weight copies held at once (versions that could not alias the live weights)."""
    copy_bytes: int
    """Bytes of one copy of the stage's parameters."""
    compute_s: float
    """Seconds in forward, backward and update."""
    elapsed_s: float
    """Seconds the segments ran, each from its first action to its last (its queued GPU work
    included); the checkpoint writes between segments are not counted, so a stage that never
    waits is busy 100%."""
    peak_memory_bytes: int
    """Peak resident memory of the process (CPU) or peak allocated GPU memory."""
    skipped: int
    """Microbatches skipped for a non-finite loss."""
    tied_copy_bytes: int = 0
    """Bytes of the copies of other stages' tied parameters the stage holds."""
    stages: tuple[int, ...] = ()
    """Every stage the rank runs (interleaved and V schedules: several; empty: ``stage``)."""

    @property
    def all_stages(self) -> tuple[int, ...]:
        return self.stages or (self.stage,)

    @property
    def busy_fraction(self) -> float:
        return self.compute_s / self.elapsed_s if self.elapsed_s > 0 else 0.0


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def _unpredicted_note(plan: Plan, *, recompute: bool, precision: str) -> str:
    """What the run did that the plan's prediction leaves out: recomputation, or another
    precision than the profile's."""
    notes = []
    if recompute and not plan.recompute:
        notes.append("made without recomputation: plan --recompute predicts this run")
    if precision != plan.precision:
        notes.append(
            f"made from a profile in {plan.precision}, and the run trained in {precision}: a "
            f"plan from profile --precision {precision} predicts it"
        )
    return "".join(f" ({note})" for note in notes)


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None (``null``): JSON has no NaN, and
    strict readers (``jq``, JavaScript) refuse Python's ``NaN`` (a run that logged no loss, an
    evaluation of a diverged model)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def _planned_memory(plan: Plan, stages: tuple[int, ...]) -> int | None:
    """The plan's estimate of the memory of a worker running ``stages`` (None: no prediction):
    a stage's ``memory_bytes`` is its workers' (under interleaved-1f1b and zbv already the whole
    rank's, all of its stages). The summary sets it beside a GPU's peak allocated memory, which
    holds the same tensors (a CPU's resident set holds the libraries too)."""
    if plan.prediction is None:
        return None
    return int(max(plan.prediction.memory_bytes[stage] for stage in stages))


def report(
    *,
    plan: Plan,
    steps: int,
    workload: Workload,
    first_step: int = 0,
    logger: MetricsLogger,
    elapsed: float,
    ranks: list[RankStats],
    checkpoint: Path,
    run_dir: Path,
    device: torch.device | None = None,
    recompute: bool = False,
    precision: str = DEFAULT_PRECISION,
    loss_scale: tuple[int, float] | None = None,
) -> dict[str, Any]:
    """Print the summary on stderr and write ``summary.json``; returns the summary. The
    workload's evaluation runs on ``device`` (the reporting rank's; default the CPU);
    ``recompute``: the run recomputed activations, ``precision``: what its forwards ran in; a
    plan made otherwise does not predict it, and the time line says so; ``loss_scale``: under
    fp16, the updates skipped for an overflow and the final scale."""
    measured = logger.time_per_step_ms()
    host_cpu = logger.host_cpu_per_step_ms()
    predicted = plan.prediction.time_per_minibatch_ms if plan.prediction else None
    first = logger.losses[0] if logger.losses else float("nan")
    final = logger.losses[-1] if logger.losses else float("nan")
    summary: dict[str, Any] = {
        "minibatches": steps,
        "first_minibatch": first_step,
        "wall_time_s": round(elapsed, 3),
        "time_per_minibatch_ms_measured": round(measured, 3) if measured else None,
        "host_cpu_ms_per_minibatch": round(host_cpu, 3) if host_cpu is not None else None,
        "time_per_minibatch_ms_predicted": predicted,
        "first_loss": first,
        "final_loss": final,
        "ranks": [
            {
                **asdict(r),
                "busy_fraction": round(r.busy_fraction, 4),
                "planned_memory_bytes": _planned_memory(plan, r.all_stages),
            }
            for r in sorted(ranks, key=lambda r: r.rank)
        ],
        "checkpoint": str(checkpoint),
    }
    lines = [
        f"done: {count(steps, 'minibatch')}"
        + (f" ({first_step}..{first_step + steps - 1}, resumed)" if first_step else "")
        + f" in {elapsed:.1f} s; loss {first:.4f} -> {final:.4f}",
        "time per minibatch: "
        + (
            f"{measured:.2f} ms measured (steady state; the host thread's CPU {host_cpu:.2f} ms)"
            if measured and host_cpu is not None
            else "n/a measured"
        )
        + (
            f", {predicted:.2f} ms predicted by the plan"
            if predicted is not None
            else " (hand-written plan: no prediction)"
        )
        + (
            _unpredicted_note(plan, recompute=recompute, precision=precision)
            if predicted is not None
            else ""
        ),
    ]
    on_gpu = device is not None and device.type == "cuda"
    for r in sorted(ranks, key=lambda r: r.rank):
        planned = _planned_memory(plan, r.all_stages) if on_gpu else None  # the same tensors
        lines.append(
            f"  rank {r.rank} {_stages_text(r.all_stages)}: busy {r.busy_fraction:.0%} (bubble "
            f"{1 - r.busy_fraction:.0%}), peak memory {format_bytes(r.peak_memory_bytes)}"
            + (f" (planned {format_bytes(planned)})" if planned is not None else "")
            + ", "
            f"up to {count(r.max_in_flight, 'microbatch')} in flight, "
            f"{count(r.max_versions, 'weight version')} "
            f"held ({count(r.max_copies, 'copy')} x {format_bytes(r.copy_bytes)})"
            + (
                f", a copy of {format_bytes(r.tied_copy_bytes)} of tied parameters"
                if r.tied_copy_bytes
                else ""
            )
        )
    skipped = sum(r.skipped for r in ranks if plan.num_stages - 1 in r.all_stages)
    if skipped:
        lines.append(f"skipped {skipped} microbatches with a non-finite loss (zero gradient)")
    summary["skipped_microbatches"] = skipped
    if loss_scale is not None:
        skipped_updates, scale = loss_scale
        updates = len(logger.losses)
        lines.append(
            f"fp16 loss scaling: skipped {skipped_updates} of {count(updates, 'update')} for an "
            f"overflow; loss scale {scale:g} at the end"
        )
        summary["skipped_updates"] = skipped_updates
        summary["loss_scale"] = scale
    cores = os.cpu_count() or 1
    if plan.world_size > cores and not torch.cuda.is_available():
        lines.append(
            f"note: {plan.world_size} processes share {cores} CPU cores, so measured times "
            "include that contention; the prediction assumes one worker per process"
        )
    failure = None
    if workload.evaluate is not None:
        try:
            metrics = evaluate_checkpoint(workload, checkpoint, device or torch.device("cpu"))
        except Exception as exc:  # the workload's code: said after the summary is written
            failure = (
                f"the workload's evaluation of the final checkpoint failed ({failure_reason(exc)})"
                f"; the run is complete: pipedream evaluate {checkpoint} shows where it fails, "
                "and evaluates it once fixed"
            )
            summary["evaluation_error"] = failure
        else:
            summary["evaluation"] = metrics
            lines.append("evaluation: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    lines.append(f"checkpoint: {checkpoint}")
    text = json.dumps(finite(summary), indent=2, allow_nan=False)  # strict JSON readers
    atomic_write_text(run_dir / "summary.json", text + "\n")
    print("\n".join(lines), file=sys.stderr, flush=True)
    if failure is not None:
        raise WorkloadError(failure)
    return summary


def evaluate_checkpoint(
    workload: Workload, checkpoint: Path, device: torch.device
) -> dict[str, float]:
    """``workload.evaluate`` of the whole model at ``checkpoint``, computed on ``device``.

    The model is first moved to one device: the reporting rank's stage shares the model's
    tensors and moved its own layers to its device, the other stages' layers stayed where the
    model was built. Where the whole model does not fit on that GPU, it is evaluated on the
    CPU instead.
    """
    assert workload.evaluate is not None
    state = load_full_state_dict(checkpoint)
    check_fits(workload.model.state_dict(), state, checkpoint, doing="evaluate it")
    try:
        model = workload.model.to(device)
        model.load_state_dict(state)
        metrics = workload.evaluate(model)
    except torch.cuda.OutOfMemoryError:
        model = workload.model.to("cpu")
        torch.cuda.empty_cache()
        model.load_state_dict(state)
        metrics = workload.evaluate(model)
    return checked_metrics(metrics)


def failure_reason(exc: Exception) -> str:
    """What a workload's failed evaluation says, in one line: its exception's first line,
    named by its type unless it is one of pipedream's own messages."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, PipedreamError):
        return reason
    return f"{type(exc).__name__}: {reason:.200}"


def checked_metrics(metrics: Any) -> dict[str, float]:
    """What a workload's evaluate returned, refused in one line unless names to numbers."""
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
        for k, v in metrics.items()
    ):
        raise WorkloadError(
            f"the workload's evaluate returned {metrics!r:.80}; it must return a dict of "
            "names to numbers, e.g. {'test_loss': 2.31}"
        )
    return dict(metrics)


def _stages_text(stages: tuple[int, ...]) -> str:
    if len(stages) == 1:
        return f"stage {stages[0]}"
    return "stages " + ", ".join(str(stage) for stage in stages)
