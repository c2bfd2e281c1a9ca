"""``--deterministic`` (``make_deterministic``): on a GPU, attention runs only the math kernel.

The flash, memory-efficient and cuDNN attention kernels have backwards that are not
deterministic; with only the first two off, PyTorch runs a bf16 attention on a Hopper GPU with
cuDNN's, and two runs of the same plan differ. The switches are global flags that PyTorch's CPU
build also keeps, so the test pretends a GPU is present and restores every flag afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from pipedream.runtime.train import make_deterministic

SDP = ("flash", "mem_efficient", "cudnn", "math")


@pytest.fixture
def restored_flags() -> Iterator[None]:
    """Every global switch ``make_deterministic`` turns, as it was before the test."""
    sdp = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in SDP}
    algorithms = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    for name, enabled in sdp.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(enabled)
    torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark
    if workspace is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


def test_on_a_gpu_attention_runs_only_the_math_kernel(
    restored_flags: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    make_deterministic()
    enabled = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in SDP}
    assert enabled == {"flash": False, "mem_efficient": False, "cudnn": False, "math": True}
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.benchmark is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
