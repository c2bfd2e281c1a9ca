"""Session-wide test hooks: the count of fuzzed inputs, summed over pytest-xdist's workers."""

from __future__ import annotations

from typing import Any

import pytest

from fuzz_cases import CASES

_KEY = "fuzz_cases"


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)
    if output is not None:  # an xdist worker: hand the counts to the controller
        output[_KEY] = dict(CASES)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: a machine without xdist never calls it
def pytest_testnodedown(node: Any, error: object) -> None:
    """(xdist controller) A worker finished: add up its counts."""
    CASES.update(getattr(node, "workeroutput", {}).get(_KEY, {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if CASES:
        counts = ", ".join(f"{n} {kind} files" for kind, n in sorted(CASES.items()))
        terminalreporter.write_line(
            f"fuzzing: {counts} tried; each loaded or gave a clean one-line error"
        )
