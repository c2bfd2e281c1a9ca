"""The stretches of a run between checkpoints, as arithmetic rather than a list.

A run of ``--steps`` minibatches with ``--checkpoint-every N`` drains its pipeline and writes a
checkpoint at every multiple of ``N`` (counted from step 0, so a resumed run stops at the same
minibatches as an uninterrupted one) and at the end. Each stretch in between runs as one action
table. :class:`Segments` answers for any number of them without listing them: ``--steps
100000000 --checkpoint-every 1`` used to build a set and a list of 10^8 entries (gigabytes)
before the first step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

__all__ = ["Segments"]


@dataclass(frozen=True)
class Segments(Sequence[tuple[int, int]]):
    """``(first minibatch, count)`` of each stretch from ``start`` to ``steps``.

    >>> list(Segments(start=3, steps=11, every=4))
    [(3, 1), (4, 4), (8, 3)]
    >>> Segments(start=0, steps=10**12, every=1).counts, len(Segments(0, 10**12, 1))
    ({1}, 1000000000000)
    >>> list(Segments(start=5, steps=9, every=0)), list(Segments(start=9, steps=9, every=2))
    ([(5, 4)], [])
    """

    start: int
    """The minibatch the run begins at (0, or where a resumed run continues)."""
    steps: int
    """The minibatch the run ends before."""
    every: int
    """Checkpoint interval; 0: only at the end."""

    def __post_init__(self) -> None:
        assert self.start >= 0 and self.steps >= 0 and self.every >= 0, self

    def _inner(self) -> int:
        """Checkpoint boundaries strictly between ``start`` and ``steps``."""
        if self.every == 0 or self.start >= self.steps:
            return 0
        return (self.steps - 1) // self.every - self.start // self.every

    def _bound(self, index: int) -> int:
        """Where segment ``index`` begins (``len(self)``: the end)."""
        if index == 0:
            return self.start
        if index > self._inner():
            return self.steps
        return (self.start // self.every + index) * self.every

    def __len__(self) -> int:
        return 0 if self.start >= self.steps else self._inner() + 1

    @overload
    def __getitem__(self, index: int) -> tuple[int, int]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[int, int]]: ...

    def __getitem__(self, index: int | slice) -> tuple[int, int] | Sequence[tuple[int, int]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(f"segment {index} of {size}")
        first = self._bound(index)
        return first, self._bound(index + 1) - first

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return (self[i] for i in range(len(self)))

    def representatives(self) -> list[tuple[int, int]]:
        """The first segment of each distinct length, in order (at most three: a partial one
        at a resumed start, the full ones, a partial one at the end)."""
        seen: dict[int, tuple[int, int]] = {}
        size = len(self)
        for index in sorted({i for i in (0, 1, size - 1) if 0 <= i < size}):
            first, count = self[index]
            seen.setdefault(count, (first, count))
        return list(seen.values())

    @property
    def counts(self) -> set[int]:
        """The distinct segment lengths."""
        return {count for _, count in self.representatives()}
