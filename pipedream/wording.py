"""Counts in what the commands print: "1 stage", "2 stages", never "1 stages" or "stage(s)"."""

from __future__ import annotations

__all__ = ["count"]


def count(n: int, noun: str) -> str:
    """``n`` and the noun in the number ``n`` takes (English plurals of the nouns used here).

    >>> count(1, "minibatch"), count(3, "stage"), count(0, "rank"), count(2, "process")
    ('1 minibatch', '3 stages', '0 ranks', '2 processes')
    >>> count(0, "copy"), count(4, "GPU"), count(2, "weight version")
    ('0 copies', '4 GPUs', '2 weight versions')
    """
    if n == 1:
        return f"{n} {noun}"
    if noun.endswith(("s", "x", "ch", "sh")):
        return f"{n} {noun}es"
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return f"{n} {noun[:-1]}ies"
    return f"{n} {noun}s"
