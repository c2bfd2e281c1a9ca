"""Evaluations while a run trains (``pipedream train --eval-every N``).

Every ``N`` minibatches the run drains its pipeline and writes a checkpoint, as
``--checkpoint-every N`` does (each evaluation is of a checkpoint), and the rank that logs the
loss runs the workload's evaluation of the whole model at it; the other ranks wait for it, on a
group of their own whose timeout is the longest ``--timeout`` (an evaluation may take longer
than a silent peer should). Each result is a line of ``evaluations.jsonl`` in the run
directory, ``{"step": N, "test_loss": ...}``, and a line on stderr; the run's final checkpoint
is evaluated by its summary, which adds its line too. A resumed run evaluates the checkpoint it
starts from where the file lacks it (an evaluation that failed or was interrupted).

The evaluation must not touch the model the rank trains: the workload's model shares its
tensors with the rank's own stage, and the end-of-run evaluation moves it to one device and
loads the checkpoint into it. Here a detached copy of its structure holds the checkpoint's
tensors instead (:func:`detached_copy`), so a run with evaluations ends on the weights of the
same run without them (with the same checkpoints: checkpoints drain an asynchronous pipeline
and reseed the random draws, which changes its numbers).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedream.runtime.checkpoint import check_fits, load_full_state_dict
from pipedream.runtime.summary import checked_metrics, finite
from pipedream.workload import Workload

__all__ = [
    "EVALUATIONS_FILE",
    "append_evaluation",
    "detached_copy",
    "evaluate_during_run",
    "evaluated_steps",
]

EVALUATIONS_FILE = "evaluations.jsonl"
"""The run directory's file of evaluations, one JSON line each."""


def detached_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules whose parameters are placeholders on the ``meta`` device
    (nothing allocated, nothing shared), for ``load_state_dict(..., assign=True)`` to fill.
    Buffers are copied: those a state dict leaves out (a rotary embedding's frequencies, say)
    must stay real."""
    memo: dict[int, Any] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


def evaluate_during_run(
    workload: Workload, checkpoint: Path, device: torch.device
) -> dict[str, float]:
    """``workload.evaluate`` of the whole model at ``checkpoint``, on ``device`` (on the CPU
    where the whole model does not fit there beside the training), leaving the workload's
    model, and so the training, as it was."""
    assert workload.evaluate is not None
    state = load_full_state_dict(checkpoint)
    check_fits(workload.model.state_dict(), state, checkpoint, doing="evaluate it")
    model = detached_copy(workload.model)
    model.load_state_dict(state, assign=True)
    try:
        metrics = workload.evaluate(model.to(device))
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        metrics = workload.evaluate(model.to("cpu"))
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the copy's memory goes back to the training
    return checked_metrics(metrics)


def append_evaluation(run_dir: Path, step: int, metrics: dict[str, float]) -> None:
    """Add the evaluation at ``step`` to the run's ``evaluations.jsonl`` (strict JSON: a
    diverged model's NaN is null; a number the workload calls ``step`` gives way)."""
    record = {"step": step, **{key: value for key, value in metrics.items() if key != "step"}}
    path = run_dir / EVALUATIONS_FILE
    cut = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with path.open("a", encoding="utf-8") as file:
        file.write(("\n" if cut else "") + json.dumps(finite(record), allow_nan=False) + "\n")


def evaluated_steps(run_dir: Path) -> set[int]:
    """The steps the run's ``evaluations.jsonl`` holds (none where it does not exist)."""
    path = run_dir / EVALUATIONS_FILE
    if not path.is_file():
        return set()
    steps = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short when a run was killed
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            steps.add(record["step"])
    return steps
