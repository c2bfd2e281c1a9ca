"""The README's workflow end to end: profile -> plan -> launch.sh -> checkpoint -> export."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipedream.formats import load_plan, load_profile
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.workload import load_workload

from launching import REPO, launch, run_cli

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")


def test_profile_plan_train_export(tmp_path: Path) -> None:
    args = ["--workload-arg", "layers=3", "--workload-arg", "width=16"]
    profile = tmp_path / "profile.yaml"
    result = run_cli(
        "profile", "mlp", *args, "--microbatch-size", "8", "--repeats", "2", "-o", str(profile)
    )
    assert result.returncode == 0, result.stderr
    assert load_profile(profile).layer_names == ["0", "1", "2", "3"]

    plan_path = tmp_path / "plan.yaml"
    result = run_cli("plan", str(profile), "--workers", "2", "--straight", "-o", str(plan_path))
    assert result.returncode == 0, result.stderr
    plan = load_plan(plan_path)
    assert plan.world_size == 2 and plan.num_stages == 2 and plan.prediction is not None

    run_dir = tmp_path / "run"
    result = launch(plan_path, "--steps", "6", "--run-dir", str(run_dir), "--timeout", "60")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "time per minibatch:" in result.stderr and "predicted by the plan" in result.stderr

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(6))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["minibatches"] == 6
    assert summary["time_per_minibatch_ms_predicted"] == plan.prediction.time_per_minibatch_ms

    checkpoint = run_dir / "checkpoints" / "step-000006"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "manifest.yaml",
        "stage-00.pt",
        "stage-01.pt",
    ]
    exported = tmp_path / "model.pt"
    result = run_cli("export", str(checkpoint), "-o", str(exported))
    assert result.returncode == 0, result.stderr
    state = torch.load(exported, weights_only=True)
    model = load_workload("mlp", {"layers": "3", "width": "16"}).model
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state)  # the export loads into the unsplit model
    assert all(torch.equal(state[k], v) for k, v in load_full_state_dict(checkpoint).items())


def test_readme_demo_reaches_90_percent_on_digits(tmp_path: Path) -> None:
    """./demo.sh as the README runs it (digits, 4 processes, 300 minibatches)."""
    env = dict(os.environ, PYTHON=sys.executable, DEMO_DIR=str(tmp_path))
    result = subprocess.run(
        ["bash", str(REPO / "demo.sh")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, _before_torchruns_report(result.stderr)[-4000:]
    (run_dir,) = tmp_path.glob("run-*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["evaluation"]["test_accuracy"] >= 0.90
    assert summary["final_loss"] < summary["first_loss"]
    assert "test_accuracy" in result.stderr


def _before_torchruns_report(stderr: str) -> str:
    """What the ranks printed, up to torchrun's log of a failed rank (``E1128 18:57:02 ...``)
    and its report, which fill the end of the output and name no cause."""
    ending = r"^[WEI]\d{4} .*(closing signal|failed \(exitcode)"
    found = re.search(ending, stderr, flags=re.MULTILINE)
    return stderr if found is None else stderr[: found.start()]
