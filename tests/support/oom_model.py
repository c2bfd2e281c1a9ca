"""A workload whose model runs out of device memory (``oom_model:build``) in its
``fail_at``-th forward call, or (``placing=true``) where the runtime moves it to its device, as
a stage too big for its GPU does: PyTorch raises ``torch.OutOfMemoryError`` with the
allocator's message."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from pipedream.workload import Workload
from pipedream.workloads.common import optimizer_factory

__all__ = ["MESSAGE", "build"]

MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB "
    "of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.07 GiB memory "
    "in use. Of the allocated memory 77.50 GiB is allocated by PyTorch. See documentation for "
    "Memory Management"
)


class Exhausting(nn.Module):
    """A Linear that raises PyTorch's out-of-memory error on its ``fail_at``-th call."""

    def __init__(self, fail_at: int, placing: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.calls = 0
        self.fail_at = fail_at
        self.placing = placing

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        if self.placing:  # .to(device), as every stage is placed
            raise torch.OutOfMemoryError(MESSAGE)
        return super()._apply(fn, recurse)

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError(MESSAGE)
        return self.linear(x)


def build(fail_at: int = 3, placing: bool = False, microbatch_size: int = 4) -> Workload:
    torch.manual_seed(0)
    inputs = torch.randn(32, 4)
    return Workload(
        model=nn.Sequential(nn.Linear(4, 4), Exhausting(fail_at, placing)),
        example_input=inputs[:microbatch_size],
        loss_fn=nn.functional.mse_loss,
        dataset=TensorDataset(inputs, inputs.sum(1, keepdim=True)),
        optimizer=optimizer_factory("sgd", lr=0.01),
    )
