"""The time of every layer range as one stage on ``r`` units, computed where it is needed.

The dynamic program asks for a stage's time at scattered ``(first, last)`` pairs (the split
points that :mod:`~pipedream.optimizer.minmax` scans) and, for single-stage pipelines, along
whole rows. Materialising ``n x n`` matrices for every replica count costs ``O(n^2)`` memory
and time each, which dominates once a level has many units, so :class:`StageTimes` computes
times from prefix sums on demand and materialises its matrix only when asked (the hierarchy
keeps one matrix per replica count, within a memory budget: a level solved for all starts, and
one solved for a single start at every unit count, gather from it often enough to pay).

A stage of layers ``x..y`` on ``r`` units (see :mod:`~pipedream.optimizer.cost_model`)::

    lead  = (base[x, y] + lead_coef  * params(x..y)) / r                 first stage
    later = max((base[x, y] + later_coef * params(x..y)) / r, in_ms[x])   after a cut

with ``base`` the layers' compute (innermost level) or the best pipeline of the range on one
unit of the level below, and ``inf`` where the memory estimate exceeds the limit. A stage that
shares tied parameters with other stages also takes at least ``tied_coef * tied(x..y)`` (their
traffic, :mod:`~pipedream.optimizer.tied_costs`), and the copies it holds count in its memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from pipedream.optimizer.tied_costs import TiedLayers

__all__ = ["MemoryMask", "StageTimes"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
_MEMORY_TOLERANCE = 1e-9
"""Relative slack of the memory check (rounding only)."""


@dataclass(frozen=True)
class MemoryMask:
    """``fits(x..y)``: param_factor x params + optimizer + act_factor x activations <= limit
    (with ``input_bytes``: act_factor x inputs + activations)."""

    param_factor: int
    """Multiplier of the parameter bytes (weight versions + gradients)."""
    act_factor: int
    """Multiplier of the activation bytes (microbatches in flight)."""
    limit: float
    """Bytes per worker."""
    optimizer_cum: FloatArray
    """``n + 1`` prefix sums of optimizer-state bytes."""
    activation_cum: FloatArray
    """``n + 1`` prefix sums of activation bytes."""
    input_bytes: FloatArray | None = None
    """With ``--recompute``: ``n``, the input bytes of a stage starting at ``x``; a stage then
    holds ``act_factor`` x its input and 1 x its activations (None: no recompute)."""


@dataclass(frozen=True)
class StageTimes:
    """A level's stage times on ``replicas`` units, for the layers of one (sub)chain."""

    base: FloatArray
    """``n x n`` compute of each range (``inf`` below the diagonal)."""
    param_cum: FloatArray
    """``n + 1`` prefix sums of parameter bytes."""
    replicas: int
    """Units running the stage."""
    lead_coef: float
    """Allreduce ms per parameter byte of a first stage, already / microbatches."""
    later_coef: float
    """The same for a stage after a cut."""
    in_ms: FloatArray
    """``n``: input transfer of a stage starting at ``x`` (already / replicas)."""
    out: FloatArray
    """``n``: output transfer of a stage ending at ``y`` that a cut follows."""
    lead_out: bool
    """Whether a first stage that a cut follows pays ``out`` (not in PipeDream's original)."""
    q_key: FloatArray
    """``n + 1`` nondecreasing: ``later[x, y] >= q_key[y + 1] - q_key[x]``."""
    count: int = 0
    """Flattened stages this stage stands for (0 when stages are not counted)."""
    memory: MemoryMask | None = None
    """The memory limit, if any."""
    matrix: FloatArray | None = None
    """``later`` for all ranges, once :meth:`materialised`."""
    tied: TiedLayers | None = None
    """Tied parameters of the whole chain (None: none)."""
    offset: int = 0
    """Index in the whole chain of this (sub)chain's first layer (``tied`` counts whole-chain
    layers: a stage's partners may lie outside the sub-chain)."""
    tied_coef: float = 0.0
    """Ms per microbatch per byte of tied parameters a stage trades (already / replicas)."""

    def _tied(self, x: IntArray, y: IntArray) -> tuple[FloatArray | float, FloatArray | float]:
        """(the traffic time, the bytes of copies held) of the stages ``x..y``."""
        if not self.tied:
            return 0.0, 0.0
        first, last = x + self.offset, y + self.offset
        traffic = self.tied_coef * self.tied.exchanged_bytes(first, last)
        return traffic, self.tied.copy_bytes(first, last)

    @property
    def split_in_ms(self) -> FloatArray:
        """``n``: the input transfer of this stage after a split at ``k`` (``in_ms[k + 1]``)."""
        return np.concatenate((self.in_ms[1:], [0.0]))

    def lead_rows(self, rows: slice) -> FloatArray:
        """``lead`` for the ranges starting at ``rows`` (all ends)."""
        starts = np.arange(len(self.base))[rows]
        params = self.param_cum[None, 1:] - self.param_cum[starts, None]
        times = (self.base[rows] + self.lead_coef * params) / self.replicas
        traffic, copies = self._tied(starts[:, None], np.arange(len(self.base))[None, :])
        times = np.maximum(times, traffic)
        if self.memory is not None:
            times = np.where(self._fits(starts[:, None], params + copies, None), times, np.inf)
        return times

    def later_at(self, x: IntArray, y: IntArray) -> FloatArray:
        """``later`` at the pairs ``(x[e], y[e])``, ``x <= y``."""
        if self.matrix is not None:
            return self.matrix[x, y]
        params = self.param_cum[y + 1] - self.param_cum[x]
        times = (self.base[x, y] + self.later_coef * params) / self.replicas
        traffic, copies = self._tied(x, y)
        times = np.maximum(times, traffic)
        if self.memory is not None:
            times = np.where(self._fits(x, params + copies, y), times, np.inf)
        return np.maximum(times, self.in_ms[x])

    def materialised(self) -> StageTimes:
        """A copy holding ``later`` for every range (gathers become lookups)."""
        if self.matrix is not None:
            return self
        starts = np.arange(len(self.base))
        params = self.param_cum[None, 1:] - self.param_cum[:-1, None]
        times = self.base + self.later_coef * params
        times /= self.replicas
        traffic, copies = self._tied(starts[:, None], starts[None, :])
        np.maximum(times, traffic, out=times)
        if self.memory is not None:
            times[~self._fits(starts[:, None], params + copies, None)] = np.inf
        np.maximum(times, self.in_ms[:, None], out=times)
        return replace(self, matrix=times)

    def _fits(self, x: IntArray, params: FloatArray, y: IntArray | None) -> NDArray[np.bool_]:
        mask = self.memory
        assert mask is not None
        if y is None:  # whole rows: every end
            opt = mask.optimizer_cum[None, 1:] - mask.optimizer_cum[x]
            acts = mask.activation_cum[None, 1:] - mask.activation_cum[x]
        else:
            opt = mask.optimizer_cum[y + 1] - mask.optimizer_cum[x]
            acts = mask.activation_cum[y + 1] - mask.activation_cum[x]
        if mask.input_bytes is None:
            held = mask.act_factor * acts
        else:  # recompute: inputs per microbatch in flight, one microbatch's activations
            held = mask.act_factor * mask.input_bytes[x] + acts
        need = mask.param_factor * params + opt + held
        # prefix sums round differently from the plan's own sums: do not lose a plan that fits
        fits: NDArray[np.bool_] = need <= mask.limit * (1 + _MEMORY_TOLERANCE)
        return fits
