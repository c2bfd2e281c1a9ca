"""A small strict reader that turns a YAML mapping into validated values.

It collects the keys a format knows, so unknown keys are reported (typos such as
``microbatch_szie`` must not be silently ignored), and every type or range problem names the
file and the dotted field path.
"""

from __future__ import annotations

import builtins
import difflib
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pipedream.errors import FormatError

__all__ = ["MISSING", "MappingReader"]

T = TypeVar("T")


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
_FIX = {
    int: "write a whole number such as 4",
    float: "write a number such as 1.5",
    str: "write a non-empty string (quote it if it looks like a number or boolean)",
    bool: "write true or false",
}


class MappingReader:
    """Reads fields of one YAML mapping; call :meth:`finish` to reject unknown keys.

    Its methods ``str``, ``int``, ``bool``, ``list`` shadow the builtins inside the class body,
    so annotations after them spell ``builtins.str`` (mypy reads them as the methods otherwise).
    """

    def __init__(self, data: Any, *, source: str, path: str = "") -> None:
        self.source = source
        self.path = path
        if not isinstance(data, dict):
            raise FormatError(
                source,
                path or "(top level)",
                f"expected a mapping, got {_describe(data)}",
                "write it as 'key: value' lines (or {key: value, ...})",
            )
        self.data: dict[str, Any] = data
        self._seen: set[str] = set()

    def field(self, key: str) -> str:
        """The dotted path of ``key`` for error messages."""
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, problem: str, fix: str = "") -> FormatError:
        return FormatError(self.source, self.field(key), problem, fix)

    def raw(self, key: str, default: Any = MISSING) -> Any:
        self._seen.add(key)
        if key not in self.data or self.data[key] is None and default is not MISSING:
            if default is MISSING:
                raise self.error(key, "required field is missing", f"add '{key}: ...'")
            return default
        return self.data[key]

    def str(self, key: str, default: Any = MISSING) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # YAML reads layer name 3 as an int; names are strings
        if not isinstance(value, str) or not value:
            raise self.error(key, f"expected a non-empty string, got {_describe(value)}", _FIX[str])
        return value

    def int(
        self, key: builtins.str, default: Any = MISSING, *, minimum: builtins.int | None = 0
    ) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected {_TYPE_NAMES[int]}, got {_describe(value)}", _FIX[int])
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}", f"use {minimum} or more")
        return value

    def number(
        self,
        key: builtins.str,
        default: Any = MISSING,
        *,
        minimum: float | None = 0.0,
        parse: Callable[[builtins.str], float] | None = None,
        positive: builtins.bool = False,
    ) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        if isinstance(value, str) and parse is not None:
            try:
                value = parse(value)
            except ValueError as exc:
                problem, _, fix = str(exc).partition("; ")
                raise self.error(key, problem, fix) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(
                key, f"expected {_TYPE_NAMES[float]}, got {_describe(value)}", _FIX[float]
            )
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            power = int(value.bit_length() * math.log10(2))
            sign = "-" if value < 0 else ""
            raise self.error(
                key,
                f"must be a finite number, got an integer of about {sign}10^{power}",
                "write a finite number such as 1.5",
            ) from None
        if not math.isfinite(value):
            raise self.error(
                key, f"must be a finite number, got {value}", "write a finite number such as 1.5"
            )
        if positive and value <= 0:
            raise self.error(key, f"must be > 0, got {value:g}", "use a positive value")
        if minimum is not None and value < minimum:
            raise self.error(
                key, f"must be >= {minimum:g}, got {value:g}", f"use {minimum:g} or more"
            )
        return value

    def bool(self, key: builtins.str, default: Any = MISSING) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        if not isinstance(value, bool):
            raise self.error(
                key, f"expected {_TYPE_NAMES[bool]}, got {_describe(value)}", _FIX[bool]
            )
        return value

    def choice(self, key: builtins.str, choices: Sequence[builtins.str], default: Any) -> Any:
        """A string that must be one of ``choices`` (``default`` where the key is absent)."""
        value = self.str(key, default)
        if value not in choices:
            raise self.error(
                key,
                f"unknown {key} {value!r}",
                f"use one of {', '.join(choices)}, or leave it out for {default}",
            )
        return value

    def list(
        self, key: builtins.str, default: Any = MISSING, *, nonempty: builtins.bool = True
    ) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        if not isinstance(value, list):
            raise self.error(
                key,
                f"expected a list, got {_describe(value)}",
                "write it as '- item' lines (or [item, ...])",
            )
        if nonempty and not value:
            raise self.error(key, "must not be empty", "give at least one entry")
        return value

    def mapping(self, key: builtins.str, default: Any = MISSING) -> Any:
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return value
        if not isinstance(value, dict):
            raise self.error(
                key,
                f"expected a mapping, got {_describe(value)}",
                "write it as 'key: value' lines (or {key: value, ...})",
            )
        return value

    def options(self, key: builtins.str) -> dict[builtins.str, builtins.str]:
        """An optional mapping of option names to scalar values, as strings (workload_args)."""
        raw = self.mapping(key, {})
        out: dict[builtins.str, builtins.str] = {}
        for name, value in raw.items():
            if isinstance(value, (str, int, float)):  # bool is an int: true -> "True"
                out[str(name)] = str(value)
                continue
            raise FormatError(
                self.source,
                f"{self.field(key)}.{name}",
                f"expected a string or number, got {_describe(value)}",
                "write one value per option, e.g. 'layers: 8'",
            )
        return out

    def child(self, value: Any, key: builtins.str) -> MappingReader:
        return MappingReader(value, source=self.source, path=self.field(key))

    def finish(self) -> None:
        unknown = [key for key in self.data if key not in self._seen]
        if unknown:
            key = str(unknown[0])
            known = sorted(self._seen)
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise self.error(
                key, "unknown key", f"{hint}remove it or use one of: {', '.join(known)}"
            )


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"
