"""Errors every rank runs into, said once per node instead of once per rank.

The ranks of a job set up from the same plan, options and files, so a mistake in them (a
workload option its factory refuses, a layer name the model lacks, a checkpoint of another
model) stops every rank with the same message: printed by each, it fills the terminal with
copies before torchrun's report. Instead the ranks tell each other how their setup went, and
where any failed, the first rank of each node prints one line (the first failing rank's
message, naming the ranks unless all failed alike) and every rank raises
:class:`~pipedream.errors.AlreadyReported`, which exits with status 2 without printing again.

The message is printed before the rank raises: torchrun stops the other ranks as soon as one
exits, so a message printed while unwinding could be cut off.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

from pipedream.errors import AlreadyReported, PipedreamError

__all__ = ["agree_on_setup", "failure_line", "refuse_together"]

PREFIX = "pipedream train: error: "
"""What the CLI prints before a user error (``pipedream/cli.py``)."""


def failure_line(messages: Sequence[str | None]) -> str:
    """The line that says the ranks' failures (``messages[rank]``; None: the rank's setup went
    well): the first failing rank's message, naming the ranks unless every rank failed alike.

    >>> failure_line(["no such layer 'x'", "no such layer 'x'"])
    "pipedream train: error: no such layer 'x'"
    >>> failure_line([None, "bad file", "bad file"])
    'pipedream train: error: ranks 1, 2: bad file'
    >>> failure_line(["a: shape (4,)", None, "b: shape (8,)", "c: shape (2,)"])
    'pipedream train: error: rank 0: a: shape (4,) (ranks 2, 3 failed too, with other messages)'
    """
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    assert failed, "failure_line needs a failure"
    first = failed[0][1]
    alike = [rank for rank, message in failed if message == first]
    if len(alike) == len(messages):
        return PREFIX + first
    named = f"rank {alike[0]}" if len(alike) == 1 else f"ranks {', '.join(map(str, alike))}"
    others = [rank for rank, message in failed if message != first]
    line = f"{PREFIX}{named}: {first}"
    if others:
        which = f"rank {others[0]}" if len(others) == 1 else f"ranks {', '.join(map(str, others))}"
        line += f" ({which} failed too, with other messages)"
    return line


def refuse_together(messages: Sequence[str | None], *, local_rank: int) -> NoReturn:
    """Print the failures on the first rank of the node, then raise on every rank."""
    line = failure_line(messages)
    if local_rank == 0:
        print(line, file=sys.stderr, flush=True)
    raise AlreadyReported(line.removeprefix(PREFIX))


def agree_on_setup(
    store: Any,
    failure: PipedreamError | None,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    timeout: timedelta,
) -> None:
    """Tell the other ranks, through the rendezvous ``store``, whether this rank's setup
    failed (``failure``), and hear theirs; if any failed, :func:`refuse_together`. A rank that
    crashed instead ends the job through torchrun, as before.

    Rank 0 returns only once every rank has read the others' word: where rank 0 hosts the
    store (a launcher other than torchrun, whose agent hosts it), a rank 0 that exits at once
    (nothing to do, a refused setup) takes the store with it while the others still read."""
    store.set(f"setup/{rank}", "" if failure is None else f"!{failure}")
    keys = [f"setup/{other}" for other in range(world_size)]
    store.wait(keys, timeout)
    said = [store.get(key).decode("utf-8") for key in keys]
    store.set(f"setup-read/{rank}", "")
    if rank == 0:
        store.wait([f"setup-read/{other}" for other in range(world_size)], timeout)
    messages = [text[1:] if text else None for text in said]
    if any(message is not None for message in messages):
        refuse_together(messages, local_rank=local_rank)
