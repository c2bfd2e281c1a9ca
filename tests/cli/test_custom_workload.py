"""A user's own workload, named ``package.module:function``, through the whole workflow."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pipedream.formats import load_plan, load_profile
from pipedream.runtime.checkpoint import load_full_state_dict

from launching import launch, run_cli, straight_plan, write_plan

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

USER_MODULE = """
from collections import OrderedDict

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipedream.workload import Workload


def make(hidden: int = 8, classes: int = 3, microbatch_size: int = 4) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        stem=nn.Linear(5, hidden), act=nn.Tanh(), body=nn.Linear(hidden, hidden),
        head=nn.Linear(hidden, classes),
    ))
    inputs = torch.randn(64, 5)
    targets = (inputs.sum(1) > 0).long() % classes
    return Workload(
        model=model,
        example_input=torch.randn(microbatch_size, 5),
        loss_fn=nn.functional.cross_entropy,
        dataset=TensorDataset(inputs, targets),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
"""


def test_user_workload_profile_plan_train(tmp_path: Path) -> None:
    (tmp_path / "user_models.py").write_text(textwrap.dedent(USER_MODULE))
    env = {"PYTHONPATH": str(tmp_path)}
    profile, plan_path = tmp_path / "profile.yaml", tmp_path / "plan.yaml"
    result = run_cli(
        "profile",
        "user_models:make",
        "--workload-arg",
        "hidden=6",
        "--repeats",
        "1",
        "-o",
        str(profile),
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert load_profile(profile).layer_names == ["stem", "act", "body", "head"]
    assert load_profile(profile).workload_args == {"hidden": "6"}

    result = run_cli("plan", str(profile), "--workers", "2", "--straight", "-o", str(plan_path))
    assert result.returncode == 0, result.stderr
    assert load_plan(plan_path).workload == "user_models:make"

    run_dir = tmp_path / "run"
    result = launch(
        plan_path, "--steps", "4", "--run-dir", str(run_dir), "--timeout", "60", env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = load_full_state_dict(run_dir / "checkpoints" / "step-000004")
    assert sorted(state) == sorted(
        f"{layer}.{kind}" for layer in ("stem", "body", "head") for kind in ("weight", "bias")
    )
    assert state["body.weight"].shape == (6, 6)


def test_unimportable_workload_is_one_line(tmp_path: Path) -> None:
    result = run_cli("profile", "no_such_module:make", "-o", str(tmp_path / "p.yaml"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "no_such_module" in result.stderr


FREEZE_MODULE = """
import gc
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipedream.workload import Workload


class Recorder(nn.Linear):
    # notes how many objects the collector has frozen each time it runs

    def forward(self, x):
        with open(os.environ["FREEZE_LOG"], "a") as log:
            log.write(f"{gc.get_freeze_count()}\\n")
        return super().forward(x)


def make(microbatch_size: int = 4) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(Recorder(5, 8), nn.Tanh(), nn.Linear(8, 3))
    inputs = torch.randn(64, 5)
    return Workload(
        model=model,
        example_input=torch.randn(microbatch_size, 5),
        loss_fn=nn.functional.cross_entropy,
        dataset=TensorDataset(inputs, (inputs.sum(1) > 0).long()),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
"""


def test_the_training_loop_runs_on_a_frozen_heap(tmp_path: Path) -> None:
    # a full collection scanned ~170,000 objects (80 ms) at random moments of the loop: what
    # lives for the whole run is frozen first (runtime/gc_freeze.py)
    (tmp_path / "freeze_models.py").write_text(FREEZE_MODULE)
    log = tmp_path / "freeze.log"
    env = {"PYTHONPATH": str(tmp_path), "FREEZE_LOG": str(log)}
    plan = write_plan(
        straight_plan("freeze_models:make", [["0", "1"], ["2"]], microbatch_size=4),
        tmp_path / "plan.yaml",
    )
    result = launch(plan, "--steps", "3", "--run-dir", str(tmp_path / "run"), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = [int(line) for line in log.read_text().split()]
    assert len(counts) == 3  # stage 0's forwards
    assert min(counts) > 10_000  # torch, the model, the runtime: frozen before the first one
