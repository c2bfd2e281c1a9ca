"""The buffers a stage's forward updates, left as the forward left them by a recomputed forward.

A forward in training mode may update module buffers in place: batch norm's running mean and
variance and its count of batches. With ``--recompute`` the backward runs each forward again,
and the buffers would take a second update per microbatch, so a model trained with
recomputation would end with other statistics (and evaluate differently) than one trained
without. Which buffers a forward updates is learnt from the first forward: those whose value
or version counter it changes (batch norm's kernels update the running statistics without
moving their version counters). A recomputed forward then runs on copies of them: it updates
the copies, which its backward may read (batch norm's backward takes the running statistics
as inputs, so they must not change before it), and the module's own buffers keep their values.
The output of the recomputed forward is unchanged: batch norm in training mode normalises with
the microbatch's own statistics, not the running ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["ForwardBuffers"]


class ForwardBuffers:
    """The buffers of ``module`` its forward updates."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self.updated: tuple[str, ...] | None = None
        """Names of the buffers a forward updates (None until a forward has been watched)."""
        self._owners: list[tuple[nn.Module, str]] = []
        """Each updated buffer's module and its name there."""

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Around the first forward: learn which buffers it updates."""
        if self.updated is not None:
            yield
            return
        buffers = dict(self._module.named_buffers())
        before = {name: (b._version, b.clone()) for name, b in buffers.items()}
        yield
        self.updated = tuple(
            name
            for name, buffer in buffers.items()
            if buffer._version != before[name][0] or not torch.equal(buffer, before[name][1])
        )
        for name in self.updated:
            path, _, attribute = name.rpartition(".")
            self._owners.append((self._module.get_submodule(path), attribute))

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Around a recomputed forward: it updates fresh copies of the buffers a forward
        updates, and the module's own keep the values the forward left."""
        assert self.updated is not None, "a forward is watched before it is recomputed"
        originals = [owner._buffers[attribute] for owner, attribute in self._owners]
        for (owner, attribute), buffer in zip(self._owners, originals):
            assert buffer is not None
            owner._buffers[attribute] = buffer.clone()
        try:
            yield
        finally:
            for (owner, attribute), buffer in zip(self._owners, originals):
                owner._buffers[attribute] = buffer
