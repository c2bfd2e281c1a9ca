"""Evaluations while a run trains (``pipedream train --eval-every N``).

Every ``N`` minibatches the run drains its pipeline and writes a checkpoint, as
``--checkpoint-every`` does (each evaluation is of a checkpoint), and the rank that logs the
loss runs the workload's evaluation of the whole model at it; the other ranks wait for it, on a
group of their own whose timeout is the longest ``--timeout`` (an evaluation may take longer
than a silent peer should). Each result is a line of ``evaluations.jsonl`` in the run
directory, ``{"step": N, "test_loss": ...}``, and a line on stderr; the run's final checkpoint
is evaluated by its summary, which adds its line too.

The evaluation must not touch the model the rank trains: the workload's model shares its
tensors with the rank's own stage, and the end-of-run evaluation moves it to one device and
loads the checkpoint into it. Here a detached copy of its structure holds the checkpoint's
tensors instead (:func:`detached_copy`).
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

__all__ = ["EVALUATIONS_FILE", "append_evaluation", "detached_copy", "evaluate_during_run"]

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
    diverged model's NaN is null)."""
    with (run_dir / EVALUATIONS_FILE).open("a", encoding="utf-8") as file:
        file.write(json.dumps(finite({"step": step, **metrics}), allow_nan=False) + "\n")
