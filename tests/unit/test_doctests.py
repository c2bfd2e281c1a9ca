"""The examples in the package's docstrings run and print what they show."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import pipedream

ROOT = Path(pipedream.__file__).resolve().parent.parent
PACKAGES = ("pipedream", "optimizer", "profiler", "runtime")


def _modules_with_examples() -> list[str]:
    """Dotted names of the package's modules whose source holds a ``>>>`` example."""
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if ">>> " in path.read_text(encoding="utf-8"):
                parts = path.relative_to(ROOT).with_suffix("").parts
                top = "pipedream" if parts[0] == "pipedream" else f"pipedream.{parts[0]}"
                names.append(".".join((top, *parts[1:])).removesuffix(".__init__"))
    return names


MODULES = _modules_with_examples()


def test_examples_are_found() -> None:
    assert "pipedream.optimizer.stage_messages" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    failed, attempted = doctest.testmod(importlib.import_module(name))
    assert attempted > 0 and failed == 0
