"""PipeDream's dynamic program on one level of the cluster, for one start or for all starts.

For layers ``i..j`` on ``m`` units of this level (``M`` in one unit of the level above)::

    cut[i][j][m] = min(  lead(i..j, m) [+ out(j, m)]                      one stage
                         min over k, r < m of
                             max(cut[i][k][m - r], later(k+1..j, r)) + out(j, r) )
    with use_fewer_workers:  cut[i][j][m] = min(cut[i][j][m], cut[i][j][m - 1])

``cut`` is a pipeline whose last stage also sends across a cut after ``j`` (what a prefix of
a longer pipeline is); ``open`` is the same without that output transfer (a whole range: the
enclosing level charges its ends). ``lead`` is a stage that starts its pipeline (no input
transfer), ``later`` one that follows a cut (its input transfer included); ``+`` is ``max``.
The stage times come from a :class:`StageSource` (the innermost level: layer costs; an outer
level: the best pipelines of the level below). With ``max_count`` the tables get one more
index, the number of flattened stages, for schedules whose cost grows with it.

:func:`solve_level` fills the tables either for one start (the outermost level, and the
reconstruction of a chosen range) with the choices recorded, or for all starts (an inner
level: the next level needs every range). The split points are found by
:func:`~pipedream.optimizer.minmax.minmax_product`. Ties go to the single stage, then the
smallest last-stage replica count, then the earliest split, then (with use_fewer_workers) to
fewer units.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from pipedream.optimizer.minmax import minmax_product, suffix_envelope
from pipedream.optimizer.stage_times import StageTimes

__all__ = ["Choices", "LevelProblem", "LevelResult", "StageSource", "solve_level"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


StageSource = Callable[[int, int], Sequence[StageTimes]]
"""``(replicas, units_before) -> stage times`` (one per possible count of flattened stages)."""


@dataclass(frozen=True)
class LevelProblem:
    """One level's dynamic program."""

    num_layers: int
    """Layers of the model (``n``)."""
    units: int
    """Units of this level available (``M``)."""
    replica_choices: tuple[int, ...]
    """Allowed replica counts of a stage, ascending."""
    source: StageSource
    """The stage times."""
    range_uses_cut: bool = False
    """A whole range keeps its last output transfer (PipeDream's original)."""
    max_count: int = 0
    """Largest number of flattened stages tracked (0: not tracked)."""
    use_fewer: bool = False
    """Allow fewer units than ``M``."""


@dataclass(frozen=True)
class Choices:
    """What the best pipeline of each ``(j, m)`` chose for its last stage (one start)."""

    split: IntArray
    """Last stage is ``split + 1 .. j`` (``split = start - 1``: a single stage)."""
    replicas: IntArray
    """Its replicas; 0: the best uses ``m - 1`` units (use_fewer_workers)."""
    count: IntArray
    """Flattened stages of the last stage."""


@dataclass(frozen=True)
class LevelResult:
    """The tables of :func:`solve_level`."""

    range_table: dict[int, FloatArray]
    """``count -> rows x n``: best whole range ``i..j`` on the level's units."""
    cut_choices: dict[tuple[int, int], Choices] = field(default_factory=dict)
    """``(count, m) -> choices`` of ``cut`` (one-start runs with ``want_choices``)."""
    range_choices: dict[tuple[int, int], Choices] = field(default_factory=dict)
    """The same for the whole-range table."""


def solve_level(
    problem: LevelProblem, *, start: int | None, want_choices: bool = False
) -> LevelResult:
    """Fill the tables for ``start`` (or all starts when None); see the module docstring."""
    assert start is not None or not want_choices, "choices are recorded for one start only"
    n, units = problem.num_layers, problem.units
    rows_slice = slice(None) if start is None else slice(start, start + 1)
    if start is None:
        rows = n
        first, ends = np.triu_indices(n, 1)
        entry_rows = first
    else:
        rows = 1
        ends = np.arange(start + 1, n, dtype=np.int64)
        first = np.full(len(ends), start, dtype=np.int64)
        entry_rows = np.zeros(len(ends), dtype=np.int64)
    first, ends = first.astype(np.int64), ends.astype(np.int64)
    entries = _Entries(first, ends, entry_rows, entry_rows * n + ends)
    state = _State(problem, rows, want_choices)
    for m in range(1, units + 1):
        if m in problem.replica_choices:
            for times in problem.source(m, 0):
                lead = times.lead_rows(rows_slice)
                cut = np.maximum(lead, times.out[None, :]) if times.lead_out else lead
                state.improve(times.count, m, None, cut, lead, start=start, replicas=m)
        for r in problem.replica_choices:
            if r >= m:
                break
            prefixes = state.prefixes(m - r)
            if prefixes is None:
                continue
            stage_times = problem.source(r, m - r)
            found = {
                (c, t): candidate
                for t, times in enumerate(stage_times)
                for c, candidate in _last_stages(state, prefixes, times, m, entries)
            }
            # applied in one order (prefix count, then stage times): ties go to the first
            for c, prefix_count in enumerate(prefixes.counts):
                for t, times in enumerate(stage_times):
                    if (c, t) not in found:
                        continue
                    at, value, split = found[(c, t)]
                    cut = np.maximum(value, times.out[at % n])
                    count = prefix_count + times.count
                    state.improve(
                        count, m, at, cut, value, split=split, replicas=r, child=times.count
                    )
        if problem.use_fewer and m > 1:
            state.fewer(m)
    return state.result()


_BATCH = 1 << 21
"""Most entries (prefix counts x ranges) in one call of the (min, max) product."""


@dataclass(frozen=True)
class _Entries:
    """The ranges ``first[e]..ends[e]`` whose pipelines a level's tables hold."""

    first: IntArray
    ends: IntArray
    rows: IntArray
    """Each entry's row in the tables (its start; 0 when solved for one start)."""
    flat: IntArray
    """Each entry's index in a raveled table."""


def _last_stages(
    state: _State, prefixes: _Prefixes, times: StageTimes, m: int, entries: _Entries
) -> list[tuple[int, tuple[IntArray, FloatArray, IntArray | None]]]:
    """``(prefix index, (flat entries, value, split))``: the pipelines on ``m`` units that end
    with a stage of ``times`` after a prefix of each count, for the entries that may improve.

    The prefixes of every count go through :func:`minmax_product` together, their tables
    stacked as rows, so that the product's fixed cost is paid once per batch, not per count.
    """
    problem, rows, flat = state.problem, state.rows, entries.flat
    size = len(flat)
    out = times.out[entries.ends]
    q_flat = None if times.matrix is None else times.matrix.ravel()
    allowed = len(prefixes.counts)  # the counts are ascending: the allowed ones come first
    if problem.max_count:
        allowed = bisect_right(prefixes.counts, problem.max_count - times.count)
    per_call = max(1, _BATCH // max(1, size))
    found = []
    for lo in range(0, allowed, per_call):
        hi = min(lo + per_call, allowed)
        counts = prefixes.counts[lo:hi]
        cutoffs = [state.cutoff(count + times.count, m, flat, out) for count in counts]
        batch = np.arange(len(counts), dtype=np.int64)
        value, split, computed = minmax_product(
            _stacked(prefixes.tables[lo:hi]),
            times.later_at,
            envelope=_stacked(prefixes.envelopes[lo:hi]),
            rows=(batch[:, None] * rows + entries.rows[None, :]).ravel(),
            I=np.tile(entries.first, len(counts)),
            J=np.tile(entries.ends, len(counts)),
            q_key=times.q_key,
            q_flat=q_flat,
            cutoff=np.concatenate(cutoffs),
            want_argmin=state.want,
        )
        done = np.arange(len(counts) * size) if computed is None else computed
        bounds = np.searchsorted(done, batch * size).tolist() + [len(done)]
        for index in range(len(counts)):
            part = slice(bounds[index], bounds[index + 1])
            if part.start == part.stop:
                continue
            at = flat[done[part] - index * size]
            found.append((lo + index, (at, value[part], None if split is None else split[part])))
    return found


def _stacked(tables: list[FloatArray]) -> FloatArray:
    """The tables' rows, one table after the other (a single table as it is)."""
    return tables[0] if len(tables) == 1 else np.concatenate(tables)


@dataclass(frozen=True)
class _Prefixes:
    """The final ``cut`` tables on some number of units that hold a finite prefix."""

    counts: list[int]
    """Their counts of flattened stages, ascending."""
    tables: list[FloatArray]
    """The tables, in that order."""
    envelopes: list[FloatArray]
    """Their :func:`suffix_envelope`."""


class _State:
    """The ``cut`` and whole-range tables being filled, with their recorded choices."""

    def __init__(self, problem: LevelProblem, rows: int, want_choices: bool) -> None:
        self.problem, self.rows, self.want = problem, rows, want_choices
        n = problem.num_layers
        self.shape = (rows, n)
        self.cut: dict[tuple[int, int], FloatArray] = {}
        self.whole: dict[tuple[int, int], FloatArray] = {}  # only if the range is `open`
        self.cut_choices: dict[tuple[int, int], Choices] = {}
        self.whole_choices: dict[tuple[int, int], Choices] = {}
        self.final_prefixes: dict[int, _Prefixes | None] = {}
        self.keep_all_whole = want_choices

    def _table(
        self,
        tables: dict[tuple[int, int], FloatArray],
        choices: dict[tuple[int, int], Choices],
        key: tuple[int, int],
    ) -> FloatArray:
        if key not in tables:
            tables[key] = np.full(self.shape, np.inf)
            if self.want:
                size = self.shape[1]
                choices[key] = Choices(
                    np.full(size, -2, dtype=np.int64),
                    np.zeros(size, dtype=np.int64),
                    np.zeros(size, dtype=np.int64),
                )
        return tables[key]

    def _whole_key(self, count: int, m: int) -> tuple[int, int]:
        # without recorded choices only the total over m matters: fold every m into m = units
        keep = self.keep_all_whole or not self.problem.use_fewer
        return (count, m) if keep else (count, self.problem.units)

    def improve(
        self,
        count: int,
        m: int,
        flat: IntArray | None,
        cut: FloatArray,
        whole: FloatArray,
        *,
        start: int | None = None,
        split: IntArray | None = None,
        replicas: int,
        child: int | None = None,
    ) -> None:
        """Lower the tables at ``flat`` (None: everywhere) where the candidates are better."""
        child = count if child is None else child
        targets = [(self.cut, self.cut_choices, (count, m), cut)]
        if not self.problem.range_uses_cut and (
            m == self.problem.units or self.problem.use_fewer or self.want
        ):
            targets.append((self.whole, self.whole_choices, self._whole_key(count, m), whole))
        for tables, choices, key, candidate in targets:
            table = self._table(tables, choices, key).reshape(-1)
            if flat is None:
                better = np.flatnonzero(candidate.reshape(-1) < table)
                table[better] = candidate.reshape(-1)[better]
                chosen_split: IntArray | int = -1 if start is None else start - 1
            else:
                mask = candidate < table[flat]
                better = flat[mask]
                table[better] = candidate[mask]
                assert split is not None or not self.want
                chosen_split = split[mask] if split is not None else -1
            if self.want:
                record = choices[key]
                record.split[better] = chosen_split
                record.replicas[better] = replicas
                record.count[better] = child

    def cutoff(self, count: int, m: int, flat: IntArray, out: FloatArray) -> FloatArray:
        """Per entry, a lower bound on a new candidate's whole-pipeline value at or above which
        it improves neither table (so :func:`minmax_product` may skip the entry)."""
        cut = self.cut.get((count, m))
        current = np.full(len(flat), np.inf) if cut is None else cut.reshape(-1)[flat]
        # the cut candidate is max(value, out): if out alone loses, only `whole` could gain
        threshold = np.where(out >= current, -np.inf, current)
        tracks_whole = not self.problem.range_uses_cut and (
            m == self.problem.units or self.problem.use_fewer or self.want
        )
        if tracks_whole:
            whole = self.whole.get(self._whole_key(count, m))
            if whole is None:
                return np.full(len(flat), np.inf)
            threshold = np.maximum(threshold, whole.reshape(-1)[flat])
        return threshold

    def prefixes(self, m: int) -> _Prefixes | None:
        """The final ``cut`` tables on ``m`` units that hold some finite prefix, with their
        suffix envelopes (None: none). Computed once: every larger ``m`` reuses them."""
        if m not in self.final_prefixes:
            found = [
                (count, table)
                for (count, units), table in sorted(self.cut.items())
                if units == m and np.isfinite(table).any()
            ]
            self.final_prefixes[m] = (
                _Prefixes(
                    [count for count, _ in found],
                    [table for _, table in found],
                    [suffix_envelope(table) for _, table in found],
                )
                if found
                else None
            )
        return self.final_prefixes[m]

    def fewer(self, m: int) -> None:
        """use_fewer_workers: the best on ``m - 1`` units is also a plan for ``m``."""
        pairs = [(self.cut, self.cut_choices)]
        if self.keep_all_whole and not self.problem.range_uses_cut:
            pairs.append((self.whole, self.whole_choices))
        for tables, choices in pairs:
            for count, _ in [key for key in tables if key[1] == m - 1]:
                below = tables[(count, m - 1)].reshape(-1)
                table = self._table(tables, choices, (count, m)).reshape(-1)
                better = np.flatnonzero(below <= table)
                table[better] = below[better]
                if self.want:
                    choices[(count, m)].replicas[better] = 0

    def result(self) -> LevelResult:
        units = self.problem.units
        source = self.cut if self.problem.range_uses_cut else self.whole
        source_choices = self.cut_choices if self.problem.range_uses_cut else self.whole_choices
        table = {count: t for (count, m), t in source.items() if m == units}
        return LevelResult(
            range_table=table,
            cut_choices=self.cut_choices,
            range_choices={key: c for key, c in source_choices.items()},
        )
