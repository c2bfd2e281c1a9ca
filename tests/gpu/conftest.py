"""The GPU tier: every test here is marked ``gpu``, and runs only where PyTorch sees a CUDA GPU.

Without one the tier is deselected (the summary counts it, the header says why), so a plain
``pytest`` on a CPU machine runs every test it collects; ``scripts/gpu_check.sh`` runs the tier
(``pytest -m gpu tests/gpu``) on a machine with a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _in_tier(item: pytest.Item) -> bool:
    return HERE in Path(str(item.fspath)).resolve().parents


def pytest_report_header(config: pytest.Config) -> str:
    if torch.cuda.is_available():
        return f"GPU tier (tests/gpu): runs on {torch.cuda.get_device_name()}"
    return "GPU tier (tests/gpu): deselected, no CUDA GPU (scripts/gpu_check.sh runs it on one)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _in_tier(item):
            item.add_marker(pytest.mark.gpu)
    if torch.cuda.is_available():
        return
    deselected = [item for item in items if _in_tier(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not _in_tier(item)]
