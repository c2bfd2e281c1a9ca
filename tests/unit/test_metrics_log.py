"""``metrics.jsonl``'s times: when each update was issued and the CPU time of the thread that
issued it, taken at the update even where its loss is read later (on a GPU, in batches)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipedream.runtime import loss_log, metrics
from pipedream.runtime.loss_log import LossLog
from pipedream.runtime.metrics import MetricsLogger


def test_each_line_has_the_times_of_its_update_not_of_its_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = {"wall": 100.0, "cpu": 50.0}
    for module in (loss_log, metrics):
        monkeypatch.setattr(module.time, "perf_counter", lambda: clock["wall"])
        monkeypatch.setattr(module.time, "thread_time", lambda: clock["cpu"])
    logger = MetricsLogger(tmp_path / "m.jsonl", total_steps=6, samples_per_step=4, progress=False)
    log = LossLog(logger, microbatches=1, device=torch.device("cuda"))  # read in batches
    for step, (wall, cpu) in enumerate([(10, 4), (10, 6), (20, 6), (10, 6), (10, 6), (10, 6)]):
        clock["wall"] += wall / 1000
        clock["cpu"] += cpu / 1000
        log.add(step, [(step, torch.tensor(float(step)))])
    clock["wall"] += 5.0  # the read happens much later
    clock["cpu"] += 1.0
    log.read()
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["time_s"] for line in lines] == [0.01, 0.02, 0.04, 0.05, 0.06, 0.07]
    assert [line["cpu_s"] for line in lines] == [0.004, 0.01, 0.016, 0.022, 0.028, 0.034]
    # the steady state: the gaps between the last three updates
    assert logger.time_per_step_ms() == pytest.approx(10.0)
    assert logger.host_cpu_per_step_ms() == pytest.approx(6.0)


def test_a_replicated_last_stages_time_is_per_minibatch_not_per_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 2 replicas of the last stage an update applies 2 minibatches: the summary said 31 ms
    per minibatch for a data-parallel run that trained 200 minibatches in 3.4 s."""
    clock = {"wall": 100.0, "cpu": 50.0}
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(metrics.time, "thread_time", lambda: clock["cpu"])
    logger = MetricsLogger(
        tmp_path / "m.jsonl",
        total_steps=8,
        samples_per_step=8,
        progress=False,
        minibatches_per_update=2,
    )
    for step in range(4):
        clock["wall"] += 0.030
        clock["cpu"] += 0.026
        logger.log(step, 1.0)
    logger.close()
    assert logger.time_per_step_ms() == pytest.approx(15.0)
    assert logger.host_cpu_per_step_ms() == pytest.approx(13.0)


def test_a_resumed_runs_progress_counts_on_from_its_checkpoint(tmp_path: Path) -> None:
    """It counted from 1 again: "step 1/6" for the first update after a checkpoint at 4."""
    import io

    stream = io.StringIO()
    logger = MetricsLogger(
        tmp_path / "m.jsonl",
        total_steps=6,
        samples_per_step=4,
        progress=False,
        stream=stream,
        first_step=4,
    )
    for step in (4, 5):
        logger.log(step, 1.0)
    logger.close()
    assert [line.split()[1] for line in stream.getvalue().splitlines()] == ["5/6", "6/6"]


def test_progress_goes_to_stderr_as_it_is_when_the_logger_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default stream was bound when the module was imported: a stderr redirected later
    (pytest's capture, a caller's contextlib.redirect_stderr) never got the progress."""
    logger = MetricsLogger(tmp_path / "m.jsonl", total_steps=1, samples_per_step=4, progress=False)
    logger.log(0, 1.0)
    logger.close()
    assert capsys.readouterr().err.split()[:2] == ["step", "1/1"]


def test_progress_counts_minibatches_where_an_update_applies_several(tmp_path: Path) -> None:
    """A last stage of 2 replicas logs one update per 2 minibatches: resumed at minibatch 3 of
    7, its updates end at 5 and 7 (it said "2/3" and "3/3", in updates)."""
    import io

    stream = io.StringIO()
    logger = MetricsLogger(
        tmp_path / "m.jsonl",
        total_steps=7,
        samples_per_step=8,
        progress=False,
        stream=stream,
        first_step=3,
        minibatches_per_update=2,
    )
    for step in (1, 2):
        logger.log(step, 1.0)
    logger.close()
    assert [line.split()[1] for line in stream.getvalue().splitlines()] == ["5/7", "7/7"]
