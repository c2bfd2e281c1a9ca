"""The built-in ``gpt`` workload with an evaluation that takes its time or fails
(``eval_workload:build``): for ``train --eval-every``, whose other ranks must wait out a slow
evaluation longer than ``--timeout``, and whose failed evaluation a resumed run makes again."""

from __future__ import annotations

import time

from torch import nn

from pipedream.workload import Workload, load_workload

__all__ = ["build"]

GPT = {"layers": "2", "dim": "16", "heads": "2", "seq": "8", "vocab": "16", "samples": "64"}


def build(pause: float = 0.0, fail: bool = False, microbatch_size: int = 8) -> Workload:
    """``gpt`` at :data:`GPT`'s sizes; its first evaluation in a process sleeps ``pause``
    seconds first, and with ``fail`` every one raises instead of returning."""
    workload = load_workload("gpt", GPT, microbatch_size=microbatch_size)
    evaluate = workload.evaluate
    assert evaluate is not None
    calls = []

    def slow(model: nn.Module) -> dict[str, float]:
        if not calls:
            time.sleep(pause)
        calls.append(1)
        if fail:
            raise ValueError("the held-out set is missing")
        return evaluate(model)

    workload.evaluate = slow
    return workload
