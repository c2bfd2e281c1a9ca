"""The end-of-run summary: each rank's peak memory beside the plan's estimate for its stages,
on a GPU (whose peak allocated memory holds the tensors the estimate counts), and a
``summary.json`` that strict JSON readers take."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from pipedream.formats.plan import Plan, Prediction, StagePlan
from pipedream.runtime.metrics import MetricsLogger
from pipedream.runtime.summary import RankStats, report
from pipedream.workload import load_workload

GiB = 2**30
PLAN = Plan(
    "mlp",
    "1f1b",
    4,
    2,
    2,
    (StagePlan("0", "4", 1, (0,)), StagePlan("5", "8", 1, (1,))),
    prediction=Prediction(10.0, 800.0, 0, (10.0, 9.0), (3 * GiB, 1.5 * GiB), 12.0),
)


def _rank(rank: int, peak: int) -> RankStats:
    return RankStats(rank, rank, 2, 1, 0, 1024, 1.0, 2.0, peak, 0)


@pytest.mark.parametrize(("device", "said"), [("cuda", True), ("cpu", False)])  # RSS: libraries
def test_the_peak_memory_is_set_beside_the_plans_estimate_on_a_gpu(
    tmp_path: Path, device: str, said: bool
) -> None:
    workload = load_workload("mlp", {}, microbatch_size=4)
    workload.evaluate = None  # nothing to move to a device this machine may lack
    logger = MetricsLogger(tmp_path / "metrics.jsonl", total_steps=2, samples_per_step=8,
                           progress=False, stream=io.StringIO())  # fmt: skip
    logger.log(1, 2.0)
    logger.log(2, 1.0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        report(
            plan=PLAN, steps=2, workload=workload, logger=logger, elapsed=1.0,
            ranks=[_rank(0, int(3.5 * GiB)), _rank(1, GiB)], checkpoint=tmp_path / "ckpt",
            run_dir=tmp_path, device=torch.device(device),
        )  # fmt: skip
    lines = err.getvalue().splitlines()
    rank0 = next(line for line in lines if line.startswith("  rank 0"))
    want = "peak memory 3.5 GiB (planned 3.0 GiB), " if said else "peak memory 3.5 GiB, "
    assert want in rank0, rank0
    ranks = json.loads((tmp_path / "summary.json").read_text())["ranks"]
    assert [r["planned_memory_bytes"] for r in ranks] == [3 * GiB, int(1.5 * GiB)]


def test_the_summary_is_strict_json_without_a_loss(tmp_path: Path) -> None:
    """A run that logged no loss wrote ``NaN`` (first and final loss), which JSON has not:
    ``jq`` and JavaScript refused the file. Non-finite numbers are now ``null``."""
    workload = load_workload("mlp", {}, microbatch_size=4)
    workload.evaluate = lambda model: {"test_loss": float("inf")}  # a diverged model
    logger = MetricsLogger(tmp_path / "metrics.jsonl", total_steps=2, samples_per_step=8,
                           progress=False, stream=io.StringIO())  # fmt: skip
    with contextlib.redirect_stderr(io.StringIO()):
        with pytest.MonkeyPatch.context() as patch:  # no checkpoint to evaluate: the model as is
            own = workload.model.state_dict()
            patch.setattr("pipedream.runtime.summary.load_full_state_dict", lambda path: own)
            report(
                plan=PLAN, steps=0, workload=workload, logger=logger, elapsed=1.0,
                ranks=[_rank(0, GiB), _rank(1, GiB)], checkpoint=tmp_path / "ckpt",
                run_dir=tmp_path,
            )  # fmt: skip

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    assert (summary["first_loss"], summary["final_loss"]) == (None, None)
    assert summary["evaluation"] == {"test_loss": None}


def test_files_written_atomically_get_the_umasks_permissions(tmp_path: Path) -> None:
    """A temporary file of ``mkstemp`` is private (0600), and a rename kept that: plans,
    profiles, summaries and checkpoints only their writer could read."""
    import os
    import stat

    from pipedream.formats.yamlio import atomic_write_text
    from pipedream.runtime.checkpoint import save_stage_file

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "plan.yaml", "a: 1\n")
        name, _ = save_stage_file(tmp_path / "ckpt", 0, {"model": {}})
    finally:
        os.umask(old)
    for path in (tmp_path / "plan.yaml", tmp_path / "ckpt" / name):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_a_rank_running_several_stages_is_planned_once_not_per_stage() -> None:
    """Under zbv a stage's memory_bytes is its rank's, all of its stages: summed over the
    rank's two stages it was doubled."""
    from pipedream.runtime.summary import _planned_memory

    plan = Plan(
        "mlp", "zbv", 4, 2, 2,
        tuple(StagePlan(str(i), str(i), 1, (rank,)) for i, rank in enumerate((0, 1, 1, 0))),
        prediction=Prediction(1.0, 1.0, 0, (1.0,) * 4, (100.0, 300.0, 300.0, 100.0), 1.0),
    )  # fmt: skip
    assert [_planned_memory(plan, stages) for stages in ((0, 3), (1, 2))] == [100, 300]
