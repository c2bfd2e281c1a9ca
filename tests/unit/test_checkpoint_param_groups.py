"""Optimizer state of a workload whose optimizer puts parameters in groups of their own (weights
apart from biases, each with its own weight decay and learning rate) survives a checkpoint:
saved and restored, under the same split and under another, it is the state that was saved."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedream.runtime.checkpoint import (
    restore_stage,
    save_stage_file,
    stage_payload,
    write_manifest,
)
from pipedream.runtime.stage_worker import StageWorker, WorkerConfig
from pipedream.schedules import PipelineSpec, build_tables


def _grouped(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Biases first (no decay, a larger step), then the weights: the module's order changed."""
    params = list(params)
    groups = [
        {"params": [p for p in params if p.ndim == 1], "lr": 0.5, "weight_decay": 0.0},
        {"params": [p for p in params if p.ndim > 1], "lr": 0.1, "weight_decay": 0.3},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]])


def _worker(module: nn.Module, optimizer: Any = _grouped) -> StageWorker:
    table = build_tables(PipelineSpec("1f1b", ((0,),), 1, 1))[0]
    return StageWorker(
        WorkerConfig(0, 1, 1),
        module,
        table,
        optimizer_factory=optimizer,
        loss_fn=nn.functional.mse_loss,
        data=None,
    )


def _trained(module: nn.Module) -> StageWorker:
    """A worker whose optimizer has taken two steps (its state differs per parameter)."""
    worker = _worker(module)
    assert worker.optimizer is not None
    for _ in range(2):
        for p in worker.module.parameters():
            p.grad = torch.randn_like(p)
        worker.optimizer.step()
    return worker


def _state(worker: StageWorker) -> dict[str, tuple]:
    """Each parameter's hyperparameters and Adam moments, by name."""
    assert worker.optimizer is not None
    named = {id(p): n for n, p in worker.module.named_parameters()}
    out = {}
    for group in worker.optimizer.param_groups:
        for p in group["params"]:
            state = worker.optimizer.state[p]
            out[named[id(p)]] = (group["lr"], group["weight_decay"], state["exp_avg"].tolist())
    return out


def _save(directory: Path, workers: list[StageWorker]) -> None:
    files = []
    for stage, worker in enumerate(workers):
        payload = stage_payload(
            worker.module,
            worker.optimizer,
            stage=stage,
            step=2,
            data_position=2,
            param_names=worker.param_names,
        )
        files.append(save_stage_file(directory, stage, payload))
    write_manifest(directory, step=2, files=files, extra={})


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_grouped_optimizer_state_is_restored_as_saved(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = _trained(_model())
    _save(tmp_path, [saved])
    resumed = _worker(_model())
    restore_stage(tmp_path, resumed.module, resumed.optimizer, param_names=resumed.param_names)
    # every group took the first group's hyperparameters, and the moments went to the
    # parameters of the module's order (a weight's to a bias: another shape)
    assert _state(resumed) == _state(saved)


def test_grouped_optimizer_state_is_restored_under_another_split(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _model()  # two stages that keep the model's names, restored as one
    cuts = [["0"], ["1", "2"]]
    stages = [_trained(nn.Sequential(OrderedDict((n, model[int(n)]) for n in c))) for c in cuts]
    _save(tmp_path, stages)
    whole = _worker(_model())
    restore_stage(tmp_path, whole.module, whole.optimizer, param_names=whole.param_names)
    assert _state(whole) == {**_state(stages[0]), **_state(stages[1])}


def test_a_resume_trains_with_the_settings_the_workload_gives_now(tmp_path: Path) -> None:
    """A run resumed with another learning rate in its workload_args kept the checkpoint's (as
    ``Optimizer.load_state_dict`` does), silently: the new one is used and the change said."""
    torch.manual_seed(0)
    saved = _trained(_model())
    _save(tmp_path, [saved])

    def slower(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = _grouped(params)
        optimizer.param_groups[1]["lr"] = 0.05  # the weights' group: 0.1 in the checkpoint
        return optimizer

    resumed = _worker(_model(), slower)
    restored = restore_stage(
        tmp_path, resumed.module, resumed.optimizer, param_names=resumed.param_names
    )
    assert restored.changed_settings == ("lr 0.1 -> 0.05 for 0.weight, 2.weight",)
    expected = {
        name: (0.05 if lr == 0.1 else lr, decay, moments)
        for name, (lr, decay, moments) in _state(saved).items()
    }
    assert _state(resumed) == expected  # the moments saved, the learning rate given now


def test_an_unchanged_resume_says_nothing_changed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _save(tmp_path, [_trained(_model())])
    resumed = _worker(_model())
    restored = restore_stage(
        tmp_path, resumed.module, resumed.optimizer, param_names=resumed.param_names
    )
    assert restored.changed_settings == ()


def test_a_checkpoint_that_decayed_every_parameter_resumes_saying_the_biases_no_longer_are(
    tmp_path: Path,
) -> None:
    """The built-in workloads' AdamW decayed biases and norms too; resumed under today's, which
    leaves them out (a group of their own without decay), the run says so and keeps the
    moments saved."""
    from pipedream.workloads.common import optimizer_factory

    torch.manual_seed(0)
    old = _worker(_model(), lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.01))
    assert old.optimizer is not None
    for p in old.module.parameters():
        p.grad = torch.randn_like(p)
    old.optimizer.step()
    _save(tmp_path, [old])
    resumed = _worker(_model(), optimizer_factory("adamw", lr=0.1))
    restored = restore_stage(
        tmp_path, resumed.module, resumed.optimizer, param_names=resumed.param_names
    )
    assert restored.changed_settings == ("weight_decay 0.01 -> 0.0 for 0.bias, 2.bias",)
    moments = {name: moments for name, (_, _, moments) in _state(old).items()}
    assert {name: m for name, (_, _, m) in _state(resumed).items()} == moments
    assert {name: decay for name, (_, decay, _) in _state(resumed).items()} == {
        "0.weight": 0.01, "0.bias": 0.0, "2.weight": 0.01, "2.bias": 0.0,
    }  # fmt: skip


def test_a_changed_group_is_named_by_its_first_parameters() -> None:
    from pipedream.runtime.checkpoint import _some

    assert [_some(["a"]), _some(["a", "b"]), _some(["a", "b", "c", "d"])] == [
        "a", "a, b", "a, b and 2 more",
    ]  # fmt: skip


def test_the_stages_changes_are_said_once_each_apart() -> None:
    """Two stages' changes named their parameters with commas, and were joined with commas."""
    from pipedream.runtime.train import settings_note

    changed = ["lr 0.1 -> 0.05", "weight_decay 0.01 -> 0.0 for 0.bias, 2.bias", "lr 0.1 -> 0.05"]
    assert settings_note(Path("ck"), changed) == (
        "pipedream: the workload's optimizer settings differ from those of ck and are used: "
        "lr 0.1 -> 0.05; weight_decay 0.01 -> 0.0 for 0.bias, 2.bias (the optimizer's state is "
        "the checkpoint's)"
    )
