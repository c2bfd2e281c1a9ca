"""``torchrun`` as ``launch.sh`` runs it: ``torch.distributed.run``'s own entry point, where a
signal that ends the launcher (Ctrl-C, SIGTERM) ends it with the signal's exit status,
``128 + signal``, instead of a traceback of torchrun's agent loop: the ranks have said by then
where the run can continue. Likewise, where every failed rank exited with status 2 (a user
error, which the ranks have said in one line), the launcher exits with 2 without torchrun's
report of the failure (a traceback of its own and a table of the ranks). Everything else
(arguments, other failures and their reports) is torchrun's.

    python -m pipedream.runtime.torchrun [torchrun options] -m pipedream.cli train PLAN ...
"""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["main"]


USER_ERROR = 2
"""The exit status of a rank stopped by a user error it has printed (``pipedream/cli.py``)."""


def main() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun()  # reads sys.argv[1:], as the torchrun command does
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        if _user_error(exc):
            return USER_ERROR  # said by the ranks, once per node
        raise
    return 0


def _user_error(exc: ChildFailedError) -> bool:
    """Whether the job stopped on a user error: the first rank to fail exited with
    :data:`USER_ERROR`, and the others with it too or on torchrun's signal to stop."""
    _, first = exc.get_first_failure()
    stopped = (USER_ERROR, -signal.SIGTERM, -signal.SIGKILL)
    return first.exitcode == USER_ERROR and all(
        failure.exitcode in stopped for failure in exc.failures.values()
    )


if __name__ == "__main__":
    sys.exit(main())
