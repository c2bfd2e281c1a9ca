"""Counts of fuzzed inputs per kind, reported at the end of the test session (conftest.py)."""

from __future__ import annotations

from collections import Counter

__all__ = ["CASES"]

CASES: Counter[str] = Counter()
