"""Session-wide test hooks: pytest-xdist's scheduling, and the count of fuzzed inputs summed
over its workers."""

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
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """(xdist controller) ``-n N`` without ``--dist``: work stealing, where a worker that runs
    out of tests takes queued ones from another. With xdist's default (``load``) the long
    launched tests left one of two workers idle for about 30 s of a 5-minute suite. Another
    ``--dist`` given explicitly is kept (an explicit ``load`` cannot be told from the default:
    it steals too). Work stealing needs pytest-xdist >= 3.2, which ``pyproject.toml`` asks for."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """(xdist controller) A worker finished: add up its counts."""
    CASES.update(getattr(node, "workeroutput", {}).get(_KEY, {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if CASES:
        counts = ", ".join(f"{n} {kind} files" for kind, n in sorted(CASES.items()))
        terminalreporter.write_line(
            f"fuzzing: {counts} tried; each loaded or gave a clean one-line error"
        )
