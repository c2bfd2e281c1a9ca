"""The whole model's gradient norm of an update, across the ranks of a pipeline: gradient
clipping (``--clip-grad-norm``) and fp16's overflow check (:mod:`~pipedream.runtime.loss_scale`).

Clipping does what ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` does in a
plain loop, on a model split over ranks: each rank adds the squares of its stages' gradient
norms, one allreduce of that single number over all ranks gives the whole model's squared norm,
and every rank scales its gradients by ``min(1, max_norm / (norm + 1e-6))`` before its updates.
Each stage's gradient counts once: a replicated stage's replicas hold the same averaged
gradient after their allreduce, so only its first replica adds it; a tied parameter's gradient
counts at its owner, which holds the sum of all its uses. The tables say when (a ``C`` per rank
and update, :mod:`pipedream.schedules.global_norm`).

Under fp16 every rank first divides its gradients by the loss scale and counts those that are
not finite; the count travels in the same allreduce as the squared norm, and where any rank
found one, every rank skips the update.

Clipping waits for nothing on the host: the norm, the factor and the scaling stay on the device
(on NCCL the allreduce is queued on the GPU), and the last stage logs the norm in
``metrics.jsonl`` (``grad_norm``), read with the losses. fp16 reads once per update whether to
skip it, as ``GradScaler.step`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipedream.runtime.loss_scale import LossScaler
from pipedream.runtime.stage_worker import StageWorker

__all__ = [
    "CLIP_EPS",
    "ClipPart",
    "GlobalNorm",
    "clip_factor",
    "sum_of_squares",
]

CLIP_EPS = 1e-6
"""Added to the norm before dividing, as ``clip_grad_norm_`` does."""


@dataclass(frozen=True)
class ClipPart:
    """One stage of this rank, as the norm sees it."""

    worker: StageWorker
    counted: bool
    """Whether its gradient adds to the norm (the stage's first replica does)."""


def sum_of_squares(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """The sum of the gradients' squared entries on ``device``, in float32, or in float64
    where a gradient is (0 for none). Half-precision gradients are summed in float32, where
    ``clip_grad_norm_`` sums them in their own dtype: the norm is the more accurate, and a
    model whose weights are bfloat16 clips a little differently from a plain loop."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    dtype = torch.float64 if torch.float64 in by_dtype else torch.float32
    norms = [
        norm.to(device=device, dtype=dtype)
        for group_dtype, group in by_dtype.items()
        for norm in torch._foreach_norm(group, 2, dtype=torch.promote_types(group_dtype, dtype))
    ]
    if not norms:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.stack(norms).square().sum()


def clip_factor(total_sq: Tensor, max_norm: float) -> tuple[Tensor, Tensor]:
    """The norm from the summed squares, and the factor ``min(1, max_norm / (norm + eps))``."""
    norm = total_sq.sqrt()
    return norm, torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)


class GlobalNorm:
    """This rank's share of an update's global norm (the ``C`` action): its stages' gradients,
    one allreduce over all ranks; then clipping (``--clip-grad-norm``) and, under fp16, the
    loss scale's overflow check (:mod:`~pipedream.runtime.loss_scale`)."""

    def __init__(
        self,
        parts: Sequence[ClipPart],
        *,
        device: torch.device,
        wait: Callable[[Any, str], None],
        group: Any = None,
        float64: bool = False,
        max_norm: float | None = None,
        scaler: LossScaler | None = None,
    ) -> None:
        assert max_norm is not None or scaler is not None, "a global norm for nothing"
        self.parts = list(parts)
        self.device = device
        self.wait = wait
        """``wait(work, what)`` waits for the allreduce: on gloo with a timeout naming the
        action, on NCCL as a stream wait."""
        self.group = group
        """The process group of all ranks (None: the default one)."""
        self.dtype = torch.float64 if float64 else torch.float32
        """What the norm is summed in (float64 where the model has float64 weights)."""
        self.max_norm = max_norm
        """The norm gradients are clipped to (None: no clipping)."""
        self.scaler = scaler
        """fp16's loss scale (None: the gradients are not scaled)."""
        self._last: tuple[int, Tensor, bool] | None = None
        """The latest update checked: the whole model's gradient norm (unscaled, before
        clipping) and whether the update is skipped (an overflow under fp16)."""

    def check(self, update: int, what: str) -> None:
        """Take the norm of this rank's gradients of ``update`` over all ranks, then unscale,
        clip or mark the update skipped (``what``: the action, for a timeout)."""
        parts = self.parts
        grads = [g for part in parts for g in part.worker.present_gradients()]
        found = self.scaler.unscale(grads) if self.scaler is not None else None
        counted = [g for part in parts if part.counted for g in part.worker.present_gradients()]
        # every rank sums in float64 where any does: the allreduce needs one dtype everywhere
        total = sum_of_squares(counted, self.device).to(self.dtype).reshape(1)
        if found is not None:  # one allreduce: the squared norm and the overflows found
            total = torch.cat([total, found.to(self.dtype).reshape(1)])
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            self.wait(dist.all_reduce(total, group=self.group, async_op=True), what)
        norm = total[0].sqrt()
        skip = False
        if self.scaler is not None:
            self.scaler.update(total[1])
            skip = bool(total[1] > 0)  # the host must know: a skipped update runs no step
            self.scaler.skipped += skip
        if self.max_norm is not None and not skip and grads:
            torch._foreach_mul_(grads, clip_factor(total[0], self.max_norm)[1])
        self._last = (update, norm, skip)

    def norm_of(self, update: int) -> Tensor | None:
        """The whole model's gradient norm of ``update`` before clipping (a device tensor; no
        host wait), while it is the latest checked (None otherwise)."""
        if self._last is None or self._last[0] != update:
            return None
        return self._last[1]

    def skips(self, update: int) -> bool:
        """Whether ``update`` is skipped: an overflow under fp16 (its latest check's)."""
        return self._last is not None and self._last[0] == update and self._last[2]
