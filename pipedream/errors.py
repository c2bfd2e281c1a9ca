"""User-facing error types.

Every mistake a user can make (a bad file, a bad option, a plan that does not match the launch)
raises a subclass of :class:`PipedreamError`, which is a ``ValueError``. The CLI prints the
message as one line and exits with status 2. ``assert`` is reserved for internal invariants.
"""

from __future__ import annotations

__all__ = [
    "AlreadyReported",
    "CheckpointError",
    "FormatError",
    "LaunchError",
    "PipedreamError",
    "PlanningError",
    "RunFailure",
    "ScheduleError",
    "TraceError",
    "WorkloadError",
]


class PipedreamError(ValueError):
    """A user error: the message names the bad value and how to fix it."""


class FormatError(PipedreamError):
    """A profile, topology or plan file (or an option value) is malformed.

    The message has the form ``FILE: FIELD: PROBLEM; FIX``.
    """

    def __init__(self, source: str, field: str, problem: str, fix: str = "") -> None:
        self.source = source
        self.field = field
        self.problem = problem
        self.fix = fix
        where = f"{source}: {field}" if field else source
        message = f"{where}: {problem}"
        if fix:
            message += f"; {fix}"
        super().__init__(_one_line(message))


def _one_line(text: str) -> str:
    """Escape control characters (a YAML key can hold a newline) so a message stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class WorkloadError(PipedreamError):
    """A workload name, factory or workload argument is unusable."""


class PlanningError(PipedreamError):
    """The optimizer cannot produce a plan for the given inputs (e.g. nothing fits in memory)."""


class ScheduleError(PipedreamError):
    """A schedule name or its parameters are invalid, or an action table fails validation."""


class LaunchError(PipedreamError):
    """The plan does not match how the job was launched (world size, environment)."""


class CheckpointError(PipedreamError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""


class TraceError(PipedreamError):
    """A run directory has no usable timeline traces (``pipedream trace``)."""


class AlreadyReported(PipedreamError):
    """A user error every rank ran into, already printed once for this node (by its first
    rank, ``runtime/agreement.py``): the CLI exits with status 2 without printing it again."""


class RunFailure(RuntimeError):
    """A run stopped for a reason outside the user's input: a dead or silent peer, a non-finite
    loss. Not a ``ValueError``: the CLI prints the one-line message and exits with status 1."""
