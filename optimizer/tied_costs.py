"""What tied parameters cost a stage: the memory of a copy and the traffic with its owner.

A parameter that several layers use (a language model's embedding and output head, a profile's
``tied`` entry) belongs to the stage holding the first of those layers, which the profile
already charges for it (its bytes count in that layer). A stage that uses it without holding
its first layer keeps a *copy*: its weights, gradient and stashed versions (its memory, like the
stage's own parameters, without optimizer state: the owner updates it). Every stage that uses
it while another stage does too trades it with the owner once per update: the copy's gradient
goes to the owner and the new version comes back, ``2 x bytes`` on the link, like a cut's
activations and gradients but once per minibatch, not per microbatch::

    layers  0 1 2 3 4 5      tied: layers 0 and 5 (12 MB)
    stages  [0 1][2 3][4 5]  stage 0 owns it (and trades it), stage 2 holds a copy (and trades
                             it), stage 1 neither

The functions take layer indices as numbers or as numpy arrays (elementwise, broadcast), so
the dynamic program evaluates them on whole ranges of stages at once. Pure numpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pipedream.formats.profile import Profile

__all__ = ["TiedLayers"]


@dataclass(frozen=True)
class TiedLayers:
    """The parameters several layers use: their layers (indices) and sizes."""

    members: tuple[tuple[int, ...], ...] = ()
    """For each tied parameter, the indices of the layers that use it, ascending."""
    nbytes: tuple[float, ...] = ()
    """The bytes of each."""

    def __post_init__(self) -> None:
        assert len(self.members) == len(self.nbytes)
        assert all(len(m) >= 2 and list(m) == sorted(set(m)) for m in self.members), self.members

    def __bool__(self) -> bool:
        return bool(self.members)

    @classmethod
    def from_profile(cls, profile: Profile) -> TiedLayers:
        index = {name: i for i, name in enumerate(profile.layer_names)}
        members = tuple(tuple(sorted(index[layer] for layer in t.layers)) for t in profile.tied)
        return cls(members, tuple(float(t.bytes) for t in profile.tied))

    def copy_bytes(self, first: Any, last: Any) -> Any:
        """Bytes of the copies a stage of layers ``first..last`` holds."""
        return self._sum(first, last, copies=True)

    def exchanged_bytes(self, first: Any, last: Any) -> Any:
        """Bytes of the tied parameters a stage of layers ``first..last`` trades with other
        stages each update (as the owner or as a copy; an owner trading with several copies is
        counted once)."""
        return self._sum(first, last, copies=False)

    def _sum(self, first: Any, last: Any, *, copies: bool) -> Any:
        x, y = np.asarray(first), np.asarray(last)
        total = np.zeros(np.broadcast(x, y).shape)
        for members, size in zip(self.members, self.nbytes):
            layers = np.asarray(members)
            # the first member at or after `first`, if any, is within the stage
            position = np.searchsorted(layers, x)
            uses = (position < len(layers)) & (layers[np.minimum(position, len(layers) - 1)] <= y)
            if copies:
                mask = uses & (x > layers[0])
            else:
                mask = uses & ~((x <= layers[0]) & (y >= layers[-1]))
            total += np.where(mask, size, 0.0)
        if total.ndim == 0:
            return float(total)
        return total
