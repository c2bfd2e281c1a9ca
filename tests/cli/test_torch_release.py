"""A torch older than pipedream supports is refused in one line before any work, by the verbs that
run torch and by ``launch.sh``'s check (``pipedream/torch_support.py``); the floor pip enforces
(``pyproject.toml``) is the same."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import yaml

from pipedream import torch_support
from pipedream.runtime import launch_check
from pipedream.torch_support import MIN_TORCH, UnsupportedTorch, check_torch_release

from launching import REPO, run_main, straight_plan, write_plan


@pytest.mark.parametrize(
    "version", ["2.8.0", "2.11.0+cu130", "2.13.0+cpu", "2.10.0a0+git9f3e", "3.0.0"]
)
def test_supported_releases_pass(version: str) -> None:
    check_torch_release(version)


def test_a_version_string_of_a_custom_build_passes() -> None:
    check_torch_release("local-build")


@pytest.mark.parametrize("version", ["2.7.1", "2.6.0+cu124", "2.4.1", "1.13.1"])
def test_older_releases_are_refused_naming_the_release_and_the_fix(version: str) -> None:
    with pytest.raises(UnsupportedTorch) as caught:
        check_torch_release(version)
    assert str(caught.value) == (
        f"pipedream needs torch >= 2.8, and this Python has torch {version}: older releases can "
        "hang a run's ranks at its end (gloo); install a newer one, e.g. pip install 'torch>=2.8'"
    )


def test_pyprojects_floor_is_the_checked_one() -> None:
    text = (REPO / "pyproject.toml").read_text()
    floors = re.findall(r'"torch>=(\d+)\.(\d+)', text)
    assert floors == [tuple(str(part) for part in MIN_TORCH)]


@pytest.fixture()
def old_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed metadata says torch 2.6.0 (an install made with --no-deps)."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        return "2.6.0" if name == "torch" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.usefixtures("old_torch")
@pytest.mark.parametrize("verb", ["train", "export", "profile"])
def test_the_torch_verbs_refuse_an_old_torch_in_one_line(verb: str, tmp_path: Path) -> None:
    plan = write_plan(straight_plan("mlp", [["0", "1", "2"]]), tmp_path / "plan.yaml")
    args = {
        "train": ["train", str(plan), "--steps", "1", "--run-dir", str(tmp_path / "run")],
        "export": [
            "export",
            str(tmp_path / "run" / "checkpoints" / "step-000001"),
            "-o",
            str(tmp_path / "model.pt"),
        ],
        "profile": ["profile", "mlp", "-o", str(tmp_path / "profile.yaml")],
    }[verb]
    result = run_main(*args)
    assert result.returncode == 2
    assert result.stderr.startswith(f"pipedream {verb}: error: pipedream needs torch >= 2.8, ")
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists() and not (tmp_path / "profile.yaml").exists()


@pytest.mark.usefixtures("old_torch")
def test_the_planner_needs_no_torch_and_is_not_refused(tmp_path: Path) -> None:
    layers = [
        {"name": str(i), "type": "Linear", "forward_ms": 1.0, "backward_ms": 2.0,
         "output_bytes": 1024, "parameter_bytes": 4096}
        for i in range(3)
    ]  # fmt: skip
    profile = {"format": "pipedream/profile@1", "workload": "mlp", "microbatch_size": 4,
               "device": "cpu", "dtype": "float32", "layers": layers}  # fmt: skip
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    out = tmp_path / "plan.yaml"
    result = run_main("plan", str(tmp_path / "profile.yaml"), "--workers", "2", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.exists()


@pytest.mark.usefixtures("old_torch")
def test_launch_sh_check_refuses_an_old_torch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = write_plan(straight_plan("mlp", [["0", "1", "2"]]), tmp_path / "plan.yaml")
    assert launch_check.main([str(plan), "--", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("launch.sh: error: pipedream needs torch >= 2.8, and this Python has ")


@pytest.mark.usefixtures("old_torch")
def test_the_gpu_checks_first_step_refuses_an_old_torch(capsys: pytest.CaptureFixture[str]) -> None:
    assert torch_support.main() == 2  # python -m pipedream.torch_support, in scripts/gpu_check.sh
    assert capsys.readouterr().err == (
        "error: pipedream needs torch >= 2.8, and this Python has torch 2.6.0: older releases can "
        "hang a run's ranks at its end (gloo); install a newer one, e.g. pip install 'torch>=2.8'\n"
    )
    assert "-m pipedream.torch_support" in (REPO / "scripts" / "gpu_check.sh").read_text()


def test_the_gpu_checks_first_step_passes_this_torch() -> None:
    assert torch_support.main() == 0
