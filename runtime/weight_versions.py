"""Weight versions for weight stashing, without in-place swaps under autograd.

The live parameters of a stage belong to its optimizer (and its state). A forward never runs
on them directly when an update could happen before its backward: it runs (through
:class:`~pipedream.runtime.parameter_swap.ParameterSwap`) on a *version*: a set of tensors that
nothing modifies in place.
The gradient with respect to those tensors is then added to the live parameters' ``.grad``.
A forward whose version *is* the live weights (see below) may run on the live parameters
themselves (:meth:`~pipedream.runtime.stage_worker.StageWorker._runs_live`), as a plain loop does.

Which versions need a copy is known in advance from the action table: version ``v`` (the
weights after ``v`` updates) can simply alias the live tensors if its last use comes before the
next update; otherwise it is cloned when it is created. So synchronous schedules hold no copy at
all, PipeDream's last stage holds none, and earlier stages hold as many as they have
minibatches in flight. The tensors of a copy whose last use has passed are reused for the next
copy (``copy_`` into them rather than a fresh clone: a fresh allocation page-faults on the CPU,
which makes the copy of a large stage several times slower than one into memory already mapped).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor, nn

from pipedream.schedules import Action, version_use

__all__ = ["WeightVersions", "accumulate_grads"]


class WeightVersions:
    """The versions of one stage replica's parameters that its action table still needs."""

    def __init__(
        self,
        module: nn.Module,
        table: Sequence[Action],
        *,
        initial_version: int,
        exclude: Collection[str] = (),
        stage: int | None = None,
    ):
        self.params: dict[str, nn.Parameter] = {
            name: param for name, param in module.named_parameters() if name not in exclude
        }
        """The live parameters (``exclude``: copies of tied parameters other stages own)."""
        self.table = table
        """The action table these versions serve."""
        self.live_version = initial_version
        self._use = version_use(table, initial_version=initial_version, stage=stage)
        self._last_use = self._use.last_use
        self._versions: dict[int, dict[str, Tensor] | None] = {}  # None: an alias, made on use
        self._copied: set[int] = set()
        self._spare: list[dict[str, Tensor]] = []  # tensors of released copies, to reuse
        self.max_versions = 0
        self.max_copies = 0
        self._create(initial_version)

    def _create(self, version: int) -> None:
        if version not in self._last_use:
            return  # never used (e.g. the weights after the final update)
        if self._use.needs_copy(version):
            if self._spare:
                spare = self._spare.pop()
                with torch.no_grad():
                    for name, param in self.params.items():
                        spare[name].copy_(param)
                self._versions[version] = spare
            else:
                self._versions[version] = {n: p.detach().clone() for n, p in self.params.items()}
            self._copied.add(version)
        else:
            self._versions[version] = None  # aliases the live tensors (see get)
        self.max_versions = max(self.max_versions, len(self._versions))
        self.max_copies = max(self.max_copies, len(self._copied))

    def aliases_live(self, version: int) -> bool:
        """Whether ``version`` is the live weights themselves (no copy), held until its last
        use: nothing modifies them before then, so a forward may run on them directly."""
        return (
            version == self.live_version
            and version in self._versions
            and version not in self._copied
        )

    def get(self, version: int) -> dict[str, Tensor]:
        """The tensors of ``version`` (read-only: never modify them in place)."""
        try:
            tensors = self._versions[version]
        except KeyError:
            raise AssertionError(
                f"weight version {version} is not held (live {self.live_version}, held "
                f"{sorted(self._versions)})"
            ) from None
        if tensors is None:  # an alias: detached views of the live tensors, made once
            tensors = self._versions[version] = {n: p.detach() for n, p in self.params.items()}
        return tensors

    def release_before(self, position: int) -> None:
        """Drop versions whose last use is before ``position`` in the table."""
        for version in [v for v in self._versions if self._last_use[v] < position]:
            tensors = self._versions.pop(version)
            if version in self._copied:  # nothing refers to it any more: reuse its memory
                assert tensors is not None
                self._copied.discard(version)
                self._spare.append(tensors)

    def updated(self) -> None:
        """Call right after the optimizer step: the live weights are the next version."""
        old = self.live_version
        if old in self._versions and old not in self._copied:
            raise AssertionError(f"version {old} aliased the live weights but is still needed")
        self.live_version += 1
        self._create(self.live_version)

    @property
    def copy_bytes(self) -> int:
        """Bytes of one copy of the parameters."""
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def accumulate(self, grads: Mapping[str, Tensor | None]) -> None:
        """Add gradients (keyed by parameter name) into the live parameters' ``.grad``."""
        accumulate_grads(self.params, grads)


@torch.no_grad()
def accumulate_grads(params: Mapping[str, Tensor], grads: Mapping[str, Tensor | None]) -> None:
    """Add gradients (keyed by parameter name) into the parameters' ``.grad``."""
    for name, grad in grads.items():
        if grad is None:
            continue
        param = params[name]
        if param.grad is None:
            param.grad = grad.detach()  # a fresh tensor from autograd.grad: no copy needed
        else:
            param.grad.add_(grad)
