"""launch.sh's torchrun (``runtime/torchrun.py``) ends quietly with status 2 where the ranks
stopped on a user error they have said, and keeps torchrun's report for every other failure."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("exits", "quiet"),
    [
        ([2, -15, -15], True),  # a user error the ranks said; torchrun stopped the others
        ([2, 2], True),
        ([1, -15], False),  # a failed rank: torchrun's report says which and how
        ([2, 1], False),
        ([-11], False),  # a crash
    ],
)
def test_the_launcher_stays_quiet_only_after_a_user_error(exits: list[int], quiet: bool) -> None:
    """launch.sh's torchrun printed a traceback and a table of the ranks also where every rank
    had said its mistake in one line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from pipedream.runtime.torchrun import _user_error

    failures = {}
    for rank, code in enumerate(exits):
        failures[rank] = ProcessFailure(rank, 1000 + rank, code, "<N/A>")
        failures[rank].timestamp = rank  # the first listed failed first
    assert _user_error(ChildFailedError("pipedream.cli", failures)) is quiet
