"""``torchrun`` as ``launch.sh`` runs it: ``torch.distributed.run``'s own entry point, where a
signal that ends the launcher (Ctrl-C, SIGTERM) ends it with the signal's exit status,
``128 + signal``, instead of a traceback of torchrun's agent loop: the ranks have said by then
where the run can continue. Everything else (arguments, failures and their reports) is
torchrun's.

    python -m pipedream.runtime.torchrun [torchrun options] -m pipedream.cli train PLAN ...
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun()  # reads sys.argv[1:], as the torchrun command does
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
