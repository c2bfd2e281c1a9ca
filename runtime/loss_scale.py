"""fp16's dynamic loss scale, the same on every rank (``--precision fp16``).

Half precision overflows where bfloat16 does not (its largest value is 65504), and small
gradients underflow to zero. As ``torch.amp.GradScaler`` does in a plain loop, the last stage
multiplies every microbatch's loss by a scale before its backward, so that every gradient of
the pipeline is scaled; at the update's global norm (the ``C`` action,
:mod:`pipedream.runtime.global_norm`) every rank divides its gradients by the scale and finds
whether any is not finite. One allreduce tells every rank whether any rank found one: then
every stage skips the update (its weights and optimizer state stay as they were) and the scale
halves; otherwise the update runs, and after 2000 updates in a row without an overflow the
scale doubles. The settings are ``GradScaler``'s defaults, and so are the kernels that unscale
and update the scale, so a pipeline skips the same updates as a plain loop.

The scale lives on the device and changes there; only whether to skip an update is read on
the host (once per update, as ``GradScaler.step`` reads it for an optimizer that is not
fused). Checkpoints keep the scale and its count of good updates, so a resumed run goes on as
an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipedream.errors import LaunchError

__all__ = ["LossScaleSettings", "LossScaler", "check_scalable"]


@dataclass(frozen=True)
class LossScaleSettings:
    """``torch.amp.GradScaler``'s defaults."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


class LossScaler:
    """The scale, its count of updates since the last overflow, and the updates skipped."""

    def __init__(self, device: torch.device, settings: LossScaleSettings | None = None) -> None:
        self.settings = settings or LossScaleSettings()
        self.scale = torch.full((), self.settings.init_scale, dtype=torch.float32, device=device)
        """The current scale (a device tensor, changed in place: the last stage's worker
        holds it)."""
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.skipped = 0
        """Updates this run skipped for an overflow."""

    def unscale(self, grads: Sequence[Tensor]) -> Tensor:
        """Divide ``grads`` by the scale in place; returns 1.0 where any was not finite, else
        0.0 (a 0-dim float32 device tensor)."""
        found = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        inverse = self.scale.double().reciprocal().float()  # as GradScaler computes it
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inverse)
        return found

    def update(self, found: Tensor) -> None:
        """After an update's check: halve the scale where ``found`` (any rank's count of
        overflows) is not 0, else count a good update and double it every
        ``growth_interval`` of them."""
        s = self.settings
        torch._amp_update_scale_(
            self.scale,
            self.growth_tracker,
            found.to(torch.float32).reshape(()),
            s.growth_factor,
            s.backoff_factor,
            s.growth_interval,
        )

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (read on the host: the checkpoint waits for the GPU)."""
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))


def check_scalable(model: nn.Module, *, where: str = "--precision fp16") -> None:
    """Refuse a model with float16 weights under ``--precision fp16``, as ``GradScaler``
    refuses to unscale float16 gradients: the scale exists to carry float16's narrow range
    through the backward into weights of a wider dtype, and an unscaled float16 gradient can
    itself overflow or underflow. ``where``: what asked for fp16, for the message."""
    half = next(
        (
            name
            for name, p in model.named_parameters()
            if p.requires_grad and p.dtype == torch.float16
        ),
        None,
    )
    if half is not None:
        raise LaunchError(
            f"{where} needs weights wider than float16 (autocast computes in float16, "
            f"the loss scale carries the gradients into the weights' dtype), but the model's "
            f"{half} is float16; build the model in float32, or train it in its own dtype with "
            "--precision fp32"
        )
