"""Training precisions: ``fp32`` (the model's own dtypes) and ``bf16`` (``torch.autocast`` with
bfloat16).

Under ``bf16`` every forward runs in autocast: matrix products and convolutions compute in
bfloat16, the weights and the optimizer's state keep the model's dtype, and a stage sends
each output in the dtype it made (a bfloat16 matmul's output travels in half the bytes of an
fp32 one). The last stage casts its bfloat16 outputs to fp32 before the loss, as a plain
autocast loop does. The profiler measures in the same precision (``pipedream profile
--precision``), the plan records it, and ``pipedream train`` runs in it unless told otherwise.

The names are pure Python (the file formats check them without torch); :func:`autocast`
imports torch when called.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_PRECISION", "PRECISIONS", "autocast", "loss_input"]

PRECISIONS = ("fp32", "bf16")
"""The precisions a profile is measured in and a run trains in."""
DEFAULT_PRECISION = "fp32"
"""The model's own dtypes, no autocast: what a profile or plan without ``precision`` means."""


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The context a forward runs in: autocast to bfloat16 on ``device`` for ``bf16``, nothing
    for ``fp32``."""
    assert precision in PRECISIONS, precision
    if precision == "bf16":
        import torch

        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def loss_input(precision: str, output: torch.Tensor) -> torch.Tensor:
    """A model output as the loss takes it: under ``bf16`` a bfloat16 output in fp32 (as a
    plain autocast loop computes its loss; a model in bfloat16 too), otherwise as it is (a
    model in bfloat16 or float64 keeps its dtype)."""
    import torch

    if precision == "bf16" and output.dtype == torch.bfloat16:
        return output.float()
    return output
