"""The GPU tier's synchronisation counter (``tests/support/counting_syncs.py``) on the CPU: it
trains through the real CLI under torchrun and records the counts at every update of every rank.
On a CPU nothing synchronises with a GPU, so every count is 0; what this checks is the harness
a lent GPU runs once (its launch, its hook on the updates, the files it writes and reads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from counting_syncs import NONE, count_syncs
from launching import straight_plan, write_plan

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

ARGS = {"layers": "2", "dim": "32", "heads": "2", "seq": "16", "samples": "128"}


def test_every_update_of_every_rank_is_counted(tmp_path: Path) -> None:
    steps = 4
    plan = straight_plan(
        "gpt",
        [["embed", "h0"], ["h1", "norm", "head"]],
        schedule="1f1b",
        microbatches=2,
        microbatch_size=4,
        workload_args=ARGS,
    )
    result, ranks = count_syncs(
        tmp_path,
        write_plan(plan, tmp_path / "plan.yaml"),
        *("--steps", str(steps), "--run-dir", str(tmp_path / "run"), "--device", "cpu"),
        *("--no-progress", "--timeout", "60"),
        nproc=2,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(ranks) == 2
    for rank in ranks:
        assert rank.between_updates == [NONE] * (steps - 1)
        assert rank.after_last_update == NONE
