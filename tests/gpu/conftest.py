"""The GPU tier: every test here is marked ``gpu`` and skipped where PyTorch sees no CUDA GPU.

``scripts/gpu_check.sh`` runs it (``pytest -m gpu tests/gpu``) on a machine with a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh where one is)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
