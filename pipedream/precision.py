"""Training precisions: ``fp32`` (the model's own dtypes), ``bf16`` (``torch.autocast`` with
bfloat16) and ``fp16`` (autocast with float16, and a dynamic loss scale).

Under ``bf16`` every forward runs in autocast: matrix products and convolutions compute in
bfloat16, the weights and the optimizer's state keep the model's dtype, and a stage sends
each output in the dtype it made (a bfloat16 matmul's output travels in half the bytes of an
fp32 one). The last stage casts its bfloat16 outputs to fp32 before the loss, as a plain
autocast loop does. The profiler measures in the same precision (``pipedream profile
--precision``), the plan records it, and ``pipedream train`` runs in it unless told otherwise.

``fp16`` computes as ``bf16`` does, in float16, whose range is far narrower: its gradients are
scaled as ``torch.amp.GradScaler`` scales them (``runtime/loss_scale.py``), which needs every
update to wait for the whole model's gradients, so a pipeline of several stages trains in fp16
only under a schedule that flushes (:data:`SCALES_LOSS`).

The names are pure Python (the file formats check them without torch); :func:`autocast`
imports torch when called.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_PRECISION",
    "PRECISIONS",
    "SCALES_LOSS",
    "autocast",
    "loss_input",
    "precision_words",
]

PRECISIONS = ("fp32", "bf16", "fp16")
"""The precisions a profile is measured in and a run trains in."""
DEFAULT_PRECISION = "fp32"
"""The model's own dtypes, no autocast: what a profile or plan without ``precision`` means."""
SCALES_LOSS = ("fp16",)
"""The precisions whose training scales the loss (and checks every update for overflow)."""
_AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The context a forward runs in: autocast to bfloat16 on ``device`` for ``bf16``, to
    float16 for ``fp16``, nothing for ``fp32``."""
    assert precision in PRECISIONS, precision
    if precision in _AUTOCAST:
        import torch

        return torch.autocast(device.type, dtype=getattr(torch, _AUTOCAST[precision]))
    return contextlib.nullcontext()


def loss_input(precision: str, output: torch.Tensor) -> torch.Tensor:
    """A model output as the loss takes it: under ``bf16`` (``fp16``) a bfloat16 (float16)
    output in fp32 (as a plain autocast loop computes its loss; a model in bfloat16 too),
    otherwise as it is (a model in bfloat16 or float64 keeps its dtype)."""
    import torch

    if precision in _AUTOCAST and output.dtype == getattr(torch, _AUTOCAST[precision]):
        return output.float()
    return output


def precision_words(precision: str) -> str:
    """How a start line names a run's precision, with a trailing ``", "`` ("" for fp32)."""
    return {"bf16": "bf16 (autocast), ", "fp16": "fp16 (autocast, loss scaling), "}.get(
        precision, ""
    )
