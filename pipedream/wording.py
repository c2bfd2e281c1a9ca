"""Counts in what the commands print: "1 stage", "2 stages", never "1 stages" or "stage(s)"."""

from __future__ import annotations

__all__ = ["count"]


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun in the number ``n`` takes (``plural``: where adding "s" is wrong).

    >>> count(1, "minibatch", "minibatches"), count(3, "stage"), count(0, "rank")
    ('1 minibatch', '3 stages', '0 ranks')
    """
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
