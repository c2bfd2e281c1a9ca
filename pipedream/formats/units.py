"""Parsing sizes and bandwidths written with units ("16 GiB", "10 GB/s", "100 Gbit/s")."""

from __future__ import annotations

import math
import re

__all__ = ["MIN_BANDWIDTH", "format_bytes", "parse_bandwidth", "parse_bytes"]

MIN_BANDWIDTH = 1.0
"""The slowest link a cluster may describe, in bytes/s: slower ones made transfer times overflow
(1e-300 B/s planned into an assertion and simulated forever)."""

_PREFIX = {
    "": 1.0,
    "k": 1e3,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}
# Binary prefixes are Ki, Mi, Gi, Ti (IEC); "ki" is not one and is rejected, not a KeyError.
_SIZE = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(Ki|Mi|Gi|Ti|[kKMGT])?(B|bit|b)?\s*$"
)


def _parse(text: str, *, per_second: bool) -> float:
    original = text
    body = text.strip()
    if per_second:
        if body.endswith("/s"):
            body = body[:-2]
        elif body.endswith("ps"):
            body = body[:-2]
    match = _SIZE.match(body)
    if not match:
        kind = (
            "bandwidth such as '10 GB/s', '100 Gbit/s' or 1e9"
            if per_second
            else ("size such as '16 GiB', '512 MB' or 1e9")
        )
        raise ValueError(f"cannot parse {original!r}; write a {kind}")
    number = float(match.group(1))
    prefix = match.group(2) or ""
    unit = match.group(3) or "B"
    value = number * _PREFIX[prefix]
    if unit in ("bit", "b"):
        value /= 8.0
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{original!r} is not a finite, non-negative amount; write a smaller value"
        )
    return value


def parse_bytes(text: str | float | int) -> float:
    """Bytes from a number or a string with a unit (decimal kB/MB/GB or binary KiB/MiB/GiB)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    return _parse(str(text), per_second=False)


def parse_bandwidth(text: str | float | int) -> float:
    """Bytes per second from a number or a string such as ``"10 GB/s"`` or ``"100 Gbit/s"``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    return _parse(str(text), per_second=True)


_BINARY_UNITS = (
    ("EiB", 2.0**60),
    ("PiB", 2.0**50),
    ("TiB", 2.0**40),
    ("GiB", 2.0**30),
    ("MiB", 2.0**20),
    ("KiB", 2.0**10),
)
"""The units :func:`format_bytes` writes, from the largest."""


def format_bytes(value: float) -> str:
    """A short human-readable size: ``1.5 MiB``."""
    for unit, scale in _BINARY_UNITS:
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"
