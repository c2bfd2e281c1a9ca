"""Failures: a killed worker ends the job within bounded time (and --max-restarts resumes it to
the same weights), non-finite losses stop cleanly or are skipped, --keep prunes checkpoints."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.runtime.train import _how_to_continue

from launching import run_cli, start, start_launch, stop, straight_plan, write_plan
from workers import run_plan

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

ARGS = {"layers": "4", "width": "512", "samples": "512", "lr": "0.01"}
STAGES = [["0"], ["1"], ["2"], ["3", "4"]]
STEPS, EVERY = 120, 30
"""The kill comes after EVERY + 10 steps, about 80 steps (4 s here) before the end."""


def _plan(tmp: Path) -> Path:
    return write_plan(straight_plan("mlp", STAGES, workload_args=ARGS), tmp / "plan.yaml")


def _start(plan: Path, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return start_launch(
        plan,
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        str(EVERY),
        "--run-dir",
        str(run_dir),
        "--timeout",
        "30",
        "--no-progress",
        *extra,
    )


def _worker_with_rank(launcher: subprocess.Popen[str], rank: int) -> psutil.Process:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and "pipedream.cli" in " ".join(
                    child.cmdline()
                ):
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.1)
    raise AssertionError(f"no worker with RANK={rank} appeared")


def _wait_for_progress(run_dir: Path, lines: int, launcher: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= lines:
            return
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError("the run made no progress")


def _finish(launcher: subprocess.Popen[str], timeout: float) -> tuple[int, str, float]:
    start = time.monotonic()
    try:
        _, err = launcher.communicate(timeout=timeout)
    finally:
        stop(launcher)
    return launcher.returncode, err, time.monotonic() - start


def test_killed_worker_ends_the_job_and_a_restart_resumes_it(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    # 1. SIGKILL rank 2 mid-run: the job ends, non-zero, within 60 s, naming the dead rank
    launcher = _start(plan, tmp_path / "killed")
    _wait_for_progress(tmp_path / "killed", EVERY + 10, launcher)
    _worker_with_rank(launcher, 2).send_signal(signal.SIGKILL)
    code, err, took = _finish(launcher, timeout=60)
    assert code != 0 and took < 60
    assert "rank      : 2" in err or "rank 2" in err, err[-3000:]
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path / "killed") in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == []  # no orphans

    # 2. with --max-restarts 1 torchrun restarts the workers, which resume from the newest
    # checkpoint and finish with exactly the weights of an uninterrupted run
    launcher = _start(plan, tmp_path / "restarted", "--max-restarts", "1")
    _wait_for_progress(tmp_path / "restarted", EVERY + 10, launcher)
    _worker_with_rank(launcher, 2).send_signal(signal.SIGKILL)
    code, err, _ = _finish(launcher, timeout=240)
    assert code == 0, err[-3000:]
    assert "resuming from the newest checkpoint" in err

    uninterrupted = run_plan(
        plan,
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        str(EVERY),
        "--run-dir",
        str(tmp_path / "whole"),
        "--no-progress",
        timeout=240,
    )
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    final = f"checkpoints/step-{STEPS:06d}"
    want = load_full_state_dict(tmp_path / "whole" / final)
    got = load_full_state_dict(tmp_path / "restarted" / final)
    assert all(torch.equal(want[k], got[k]) for k in want)


NAN_WORKLOAD = """
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipedream.workload import Workload


def make(poison: int = 5, pause: float = 0.0, microbatch_size: int = 4) -> Workload:
    torch.manual_seed(0)
    inputs = torch.randn(40, 3)
    inputs[poison] = float("nan")

    def evaluate(model: nn.Module) -> dict[str, float]:
        time.sleep(pause)  # a held-out set that takes its time
        return {"test_loss": 0.25}

    return Workload(
        model=nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)),
        example_input=inputs[:microbatch_size],
        loss_fn=nn.functional.mse_loss,
        dataset=TensorDataset(inputs, inputs.sum(1, keepdim=True)),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
        evaluate=evaluate,
    )
"""


def test_non_finite_loss_stops_or_is_skipped(tmp_path: Path) -> None:
    """Also: the run that skips ends well although its evaluation of the whole model, on the
    reporting rank after training, takes longer than --timeout (the other rank used to wait
    for it in a barrier bound by the timeout, failing a finished run)."""
    (tmp_path / "nan_workload.py").write_text(textwrap.dedent(NAN_WORKLOAD))
    env = {"PYTHONPATH": str(tmp_path)}
    order = MicrobatchStream(list(range(40)), 4, 0)  # type: ignore[arg-type]
    poisoned = 3  # the minibatch whose first sample is NaN
    plan = straight_plan(
        "nan_workload:make",
        [["0", "1"], ["2"]],
        microbatch_size=4,
        workload_args={"poison": str(order.sample_indices(poisoned)[0]), "pause": "3"},
    )
    path = write_plan(plan, tmp_path / "plan.yaml")

    stop = run_plan(
        path,
        "--steps",
        "10",
        "--checkpoint-every",
        "1",
        "--run-dir",
        str(tmp_path / "stop"),
        "--timeout",
        "30",
        "--no-progress",
        env=env,
    )
    assert stop.returncode == 1
    message = f"non-finite loss (nan) at microbatch {poisoned} (minibatch {poisoned})"
    assert message in stop.stderr, stop.stderr[-3000:]
    last_good = tmp_path / "stop" / "checkpoints" / f"step-{poisoned:06d}"
    assert f"the last good checkpoint: {last_good}" in stop.stderr
    assert all(torch.isfinite(v).all() for v in load_full_state_dict(last_good).values())

    skip = run_plan(
        path,
        "--steps",
        "10",
        "--run-dir",
        str(tmp_path / "skip"),
        "--timeout",
        "2",
        "--no-progress",
        "--on-nonfinite",
        "skip",
        env=env,
    )
    assert skip.returncode == 0, skip.stderr[-3000:]
    assert "skipped 1 microbatches with a non-finite loss" in skip.stderr
    assert "evaluation: test_loss 0.2500" in skip.stdout + skip.stderr
    final = load_full_state_dict(tmp_path / "skip" / "checkpoints" / "step-000010")
    assert all(torch.isfinite(v).all() for v in final.values())


INTERRUPTED_WORKLOAD = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipedream.workload import Workload


def make(interrupt_at: int = 7, microbatch_size: int = 4) -> Workload:
    torch.manual_seed(0)
    inputs = torch.randn(64, 3)
    calls = []

    def loss_fn(output, target):
        calls.append(1)
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt  # the user's Ctrl-C, in the middle of minibatch 6
        return nn.functional.mse_loss(output, target)

    return Workload(
        model=nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)),
        example_input=inputs[:microbatch_size],
        loss_fn=loss_fn,
        dataset=TensorDataset(inputs, inputs.sum(1, keepdim=True)),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
    )
"""


def test_an_interrupted_run_says_where_it_can_continue(tmp_path: Path) -> None:
    (tmp_path / "interrupted_workload.py").write_text(textwrap.dedent(INTERRUPTED_WORKLOAD))
    plan = straight_plan("interrupted_workload:make", [["0", "2"]], microbatch_size=4)
    run = tmp_path / "run"
    result = run_cli(
        "train", str(write_plan(plan, tmp_path / "plan.yaml")), "--steps", "10",
        "--checkpoint-every", "2", "--run-dir", str(run), "--no-progress", "--trace",
        env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (
        f"pipedream train: interrupted; its newest checkpoint is {run}/checkpoints/step-000006 "
        f"(step 6): continue with --resume auto --run-dir {run}"
    )
    # the trace shows what ran (it wrote none): in 4 stretches, the last action that ended is
    # minibatch 5's update (the forward of 6 was interrupted)
    trace = json.loads((run / "traces" / "rank-000.json").read_text())
    assert (trace["complete"], trace["stretches"]) == (False, [[0, 2], [2, 2], [4, 2], [6, 2]])
    assert [e["action"] for e in trace["events"]][-2:] == ["0B5", "0U5"]
    drawn = run_cli("trace", str(run), "--png", str(tmp_path / "t.png"))
    assert drawn.returncode == 0 and "rank(s) [0] stopped before the end" in drawn.stderr
    refused = run_cli("trace", str(run), "--plan", str(tmp_path / "plan.yaml"))
    assert refused.returncode == 2 and "stopped before the end of the run" in refused.stderr
    # a resumed run without --trace leaves no traces of the interrupted one to be read as its own
    resumed = run_cli(
        "train", str(tmp_path / "plan.yaml"), "--steps", "10", "--resume", "auto",
        "--run-dir", str(run), "--no-progress", env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"deleted the traces of an earlier run in {run}/traces (1 file(s))" in resumed.stderr
    assert list((run / "traces").iterdir()) == []
    assert _how_to_continue(tmp_path / "new") == (
        "no checkpoint was written yet (--checkpoint-every N lets a run continue)"
    )


def test_ctrl_c_ends_the_launcher_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C in a terminal reaches torchrun too, which ended with its own SignalException
    traceback (about 25 lines) under the ranks' note; launch.sh's torchrun now exits 130."""
    ready = tmp_path / "ready"
    script = tmp_path / "rank.py"
    script.write_text(
        "import pathlib, sys, time\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "try:\n    time.sleep(60)\n"
        "except KeyboardInterrupt:\n    sys.exit(1)  # as pipedream train does, after its note\n"
    )
    cmd = [sys.executable, "-m", "pipedream.runtime.torchrun", "--standalone"]
    proc = start([*cmd, "--nproc-per-node", "1", str(script)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]


def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    plan = write_plan(
        straight_plan("mlp", [["0", "1", "2", "3", "4"], ["5", "6", "7", "8"]]),
        tmp_path / "plan.yaml",
    )
    result = run_plan(
        plan,
        "--steps",
        "8",
        "--checkpoint-every",
        "2",
        "--keep",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert kept == ["step-000006", "step-000008"]


@pytest.mark.parametrize(
    ("workload_args", "stages", "says"),
    [
        ({"in_features": "-1"}, [["0", "4"], ["5", "8"]], "mlp: in_features must be >= 1, got -1"),
        ({}, [["0", "4"], ["5", "9"]], "'9'"),  # a layer the model lacks
    ],
)
def test_a_mistake_every_rank_makes_is_said_once(
    tmp_path: Path, workload_args: dict[str, str], stages: list[list[str]], says: str
) -> None:
    """Every rank printed it (8 ranks: 8 copies of the line before torchrun's report). As
    torchrun's restart (--max-restarts) of such a job fails alike, it says no "resuming"."""
    plan = write_plan(
        straight_plan("mlp", stages, workload_args=workload_args), tmp_path / "plan.yaml"
    )
    result = run_plan(
        plan, "--steps", "2", "--run-dir", str(tmp_path / "run"), "--timeout", "60",
        env={"TORCHELASTIC_RESTART_COUNT": "1"},
    )  # fmt: skip
    assert "resuming" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("pipedream train: error: "), errors
    assert says in errors[0] and "rank" not in errors[0].split(": ")[1], errors
