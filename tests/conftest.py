"""Session-wide test hooks."""

from __future__ import annotations

import pytest

from fuzz_cases import CASES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if CASES:
        counts = ", ".join(f"{n} {kind} files" for kind, n in sorted(CASES.items()))
        terminalreporter.write_line(
            f"fuzzing: {counts} tried; each loaded or gave a clean one-line error"
        )
