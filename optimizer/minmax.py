"""The inner loop of the dynamic program: a (min, max) product over split points, windowed.

For entries ``e`` (a pipeline over layers ``I[e]..J[e]``) it computes::

    value[e] = min over k in [I[e], J[e] - 1] of max(P[row[e], k], Q(k + 1, J[e]))

``P[., k]``: the best prefix pipeline ending at layer ``k``; ``Q(x, y)``: the time of a last
stage ``x..y``. Scanning every ``k`` costs ``O(n)`` per entry, ``O(n^3)`` for the all-starts
tables of an inner level. Two monotone *lower bounds* cut that down, exactly:

* ``P[i, k] >= env[i, k] = min over k' >= k of P[i, k']`` (the row's suffix minimum, the
  tightest nondecreasing lower bound);
* ``Q(k + 1, j) >= q_key[j + 1] - q_key[k + 1]``: a stage is no faster than its compute and
  allreduce over its replicas, nonincreasing in ``k``.

The true value where the two bounds cross (``env[i, k] + q_key[k + 1] = q_key[j + 1]``, one
``searchsorted`` per row) is an upper bound ``B``; only split points whose two bounds are both
``<= B`` can reach the minimum, and they form one window ``[kl, kr]``. The windows are scanned
all at once, flattened, with ``np.minimum.reduceat``. The answer is exact (ties: the earliest
``k``); the work is ``O(entries x log n + total window length)``: a few split points per entry
in practice, ``O(n)`` per entry in the worst case.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

__all__ = ["Gather", "minmax_product", "suffix_envelope"]

_BLOCK = 1 << 16
"""Entries per block (whole rows): small enough for the temporaries to stay in cache."""
_CHUNK = 1 << 13
"""Largest number of (entry, split point) pairs scanned in one vectorised pass: its
temporaries (64 KiB each) stay in the processor's cache and below the size at which the
allocator maps fresh pages for every array (scanning in passes of a million pairs took as much
system time, in page faults, as computing)."""
_PROBES = (0, 1, 3, 7)
"""Split points ``k0 + step`` probed for the upper bound."""
_RELATIVE_SLACK = 1e-9
"""Windows are widened by this much so that rounding never drops the true minimum."""

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]
Gather = Callable[[IntArray, IntArray], FloatArray]
"""``(x, y) -> Q[x, y]`` elementwise: stage times are gathered, never all materialised."""


def suffix_envelope(P: FloatArray) -> FloatArray:
    """``env[i, k] = min(P[i, k:])``: nondecreasing along each row and ``<= P`` (contiguous:
    it is gathered from at random)."""
    envelope = np.empty_like(P)
    np.minimum.accumulate(P[:, ::-1], axis=1, out=envelope[:, ::-1])
    return envelope


def minmax_product(
    P: FloatArray,
    Q: Gather,
    *,
    envelope: FloatArray,
    rows: IntArray,
    I: IntArray,  # noqa: E741 -- the standard name of the start index
    J: IntArray,
    q_key: FloatArray,
    q_flat: FloatArray | None = None,
    cutoff: FloatArray | None = None,
    want_argmin: bool = False,
) -> tuple[FloatArray, IntArray | None, IntArray | None]:
    """``(value, argmin k, computed entries)``: see the module docstring; ``J > I`` everywhere.

    ``P`` and its :func:`suffix_envelope` have one row per distinct start and ``n`` columns;
    entries are grouped by row (``rows`` nondecreasing). ``q_key`` has ``n + 1``
    nondecreasing entries. Infinite values mean "not allowed" and propagate. ``q_flat``, when
    given, is ``Q`` materialised and raveled (``q_flat[x * n + y]``): the hot loops then index
    it directly. With ``cutoff``, entries whose lower bound is already
    ``>= cutoff`` are skipped: the result then holds only the computed entries, whose indices
    are the third element (None: all were computed). Entries are processed in blocks of
    whole rows, so that every temporary stays in the processor's cache.
    """
    width = P.shape[1]
    kernel = _Kernel(
        P.ravel(),
        _Lazy(Q, width) if q_flat is None else q_flat,
        envelope,
        q_key,
        width,
        want_argmin,
    )
    groups = _row_groups(rows)
    values, args, kept = [], [], []
    block: list[tuple[int, int, int]] = []
    for group in groups:
        block.append(group)
        if group[2] - block[0][1] >= _BLOCK or group is groups[-1]:
            lo, hi = block[0][1], block[-1][2]
            entries = slice(lo, hi)
            part = kernel.run(
                block,
                rows[entries],
                I[entries],
                J[entries],
                None if cutoff is None else cutoff[entries],
            )
            values.append(part[0])
            args.append(part[1])
            kept.append(part[2] + lo)
            block = []
    if not values:
        empty = np.empty(0, dtype=np.int64)
        return np.empty(0), empty if want_argmin else None, empty
    value = np.concatenate(values)
    arg = np.concatenate(args) if want_argmin else None  # type: ignore[arg-type]
    keep = np.concatenate(kept)
    return value, arg, None if len(keep) == len(I) else keep


class _Kernel:
    """One block of entries: crossing, lower bound, probes, windows, scan."""

    def __init__(
        self,
        flat_p: FloatArray,
        q_flat: FloatArray | _Lazy,
        envelope: FloatArray,
        q_key: FloatArray,
        width: int,
        want_argmin: bool,
    ) -> None:
        self.flat_p, self.q_flat, self.envelope = flat_p, q_flat, envelope
        self.flat_env = envelope.ravel()
        self.q_key, self.q_tail, self.width, self.want = q_key, q_key[1:], width, want_argmin

    def run(
        self,
        groups: list[tuple[int, int, int]],
        rows: IntArray,
        I: IntArray,  # noqa: E741
        J: IntArray,
        cutoff: FloatArray | None,
    ) -> tuple[FloatArray, IntArray, IntArray]:
        q_key, width, envelope = self.q_key, self.width, self.envelope
        base = groups[0][1]
        targets = q_key[J + 1]
        crossing = np.empty(len(I), dtype=np.int64)
        for row, lo, hi in groups:
            line = envelope[row] + self.q_tail
            crossing[lo - base : hi - base] = (
                np.searchsorted(line, targets[lo - base : hi - base], side="right") - 1
            )
        keep = np.arange(len(I))
        if cutoff is not None:
            # max(envelope, stage bound) over k <= c is >= the stage bound at c, over k > c it
            # is >= the envelope at c + 1: a lower bound for any c, exact at the crossing
            c = np.clip(crossing, I - 1, J - 1)
            stage_side = np.where(c >= I, targets - q_key[c + 1], np.inf)
            after = self.flat_env[rows * width + np.minimum(c + 1, J - 1)]
            lower = np.minimum(stage_side, np.where(c < J - 1, after, np.inf))
            keep = np.flatnonzero(lower * (1 - _RELATIVE_SLACK) < cutoff)
            rows, I, J = rows[keep], I[keep], J[keep]  # noqa: E741
            targets, crossing = targets[keep], crossing[keep]
        if not len(keep):
            return np.empty(0), np.empty(0, dtype=np.int64), keep
        flat_p, q_flat = self.flat_p, self.q_flat
        p_base = rows * width
        q_base = J + width  # q_flat index of Q(k + 1, J) is k * width + q_base
        # the stage-side bound is low by a roughly constant margin, so the stage's true time
        # crosses the prefix's at or right of the crossing: probes there make B tight
        start = np.maximum(crossing, I)
        last = J - 1
        upper = np.full(len(I), np.inf)
        for step in _PROBES:
            k = np.minimum(start + step, last)
            np.minimum(upper, np.maximum(flat_p[p_base + k], q_flat[k * width + q_base]), out=upper)
        missing = np.flatnonzero(~np.isfinite(upper))
        if missing.size:  # e.g. the crossing is over the memory limit: try the shortest stages
            for k in (last[missing], I[missing]):
                probe = np.maximum(flat_p[p_base[missing] + k], q_flat[k * width + q_base[missing]])
                upper[missing] = np.minimum(upper[missing], probe)
        limit = upper + _RELATIVE_SLACK * (upper + abs(q_key[-1]))
        kl = np.maximum(np.searchsorted(self.q_tail, targets - limit, side="left"), I)
        kr = np.empty(len(I), dtype=np.int64)
        for row, lo, hi in _row_groups(rows):
            kr[lo:hi] = np.searchsorted(envelope[row], limit[lo:hi], side="right") - 1
        np.minimum(kr, last, out=kr)
        lengths = np.maximum(kr - kl + 1, 1)  # never empty: a probe with value B is inside
        np.minimum(kl, last, out=kl)
        found = np.empty(len(I))
        found_arg = np.empty(len(I), dtype=np.int64)
        ends = np.cumsum(lengths)
        first = 0
        while first < len(I):
            stop = int(np.searchsorted(ends, ends[first] - lengths[first] + _CHUNK, "right"))
            stop = max(stop, first + 1)
            chosen = found_arg if self.want else None
            _scan(flat_p, q_flat, width, p_base, q_base, kl, lengths, first, stop, found, chosen)
            first = stop
        return found, found_arg, keep


def _row_groups(rows: IntArray) -> list[tuple[int, int, int]]:
    """``(row, first entry, end entry)`` for each run of equal rows."""
    if not len(rows):
        return []
    cuts = np.flatnonzero(rows[1:] != rows[:-1]) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(rows)]))
    return [(int(rows[a]), int(a), int(b)) for a, b in zip(starts, ends)]


def _scan(
    flat_p: FloatArray,
    q_flat: FloatArray | _Lazy,
    width: int,
    p_base: IntArray,
    q_base: IntArray,
    kl: IntArray,
    lengths: IntArray,
    start: int,
    stop: int,
    best: FloatArray,
    arg: IntArray | None,
) -> None:
    """Scan the windows of entries ``start..stop-1`` in one flattened pass."""
    sizes = lengths[start:stop]
    offsets = np.cumsum(sizes) - sizes
    total = int(offsets[-1] + sizes[-1])
    shift = kl[start:stop] - offsets  # k = step + shift of the step's entry
    k = np.arange(total, dtype=np.int64) + np.repeat(shift, sizes)
    p_index = k + np.repeat(p_base[start:stop], sizes)
    k *= width
    k += np.repeat(q_base[start:stop], sizes)
    values = np.maximum(flat_p[p_index], q_flat[k])
    mins = np.minimum.reduceat(values, offsets)
    best[start:stop] = mins
    if arg is None:
        return
    hits = np.flatnonzero(values == np.repeat(mins, sizes))
    segment = np.repeat(np.arange(stop - start), sizes)[hits]
    first = np.ones(len(hits), dtype=bool)
    first[1:] = segment[1:] != segment[:-1]
    chosen = hits[first] + shift[segment[first]]
    assert len(chosen) == stop - start  # inf == inf, so an all-infinite window has a hit too
    arg[start:stop] = chosen


class _Lazy:
    """``q_flat`` without the matrix: ``[x * n + y]`` computed through the gather."""

    def __init__(self, gather: Gather, width: int) -> None:
        self.gather, self.width = gather, width

    def __getitem__(self, index: IntArray) -> FloatArray:
        x, y = np.divmod(index, self.width)
        return self.gather(x, y)
