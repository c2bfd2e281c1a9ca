"""A pool of receive buffers on the CPU, so that large messages land in memory already mapped.

Why. A received activation or gradient is written into a new tensor. On the CPU a block of
32 MiB or more is mapped afresh by glibc whatever its settings (``pipedream/host_memory.py``),
and the kernel maps and zeroes its pages on first touch: here inside gloo's receive, on the
transport thread that carries all of the process's messages. That makes every large message
slower to arrive than one into memory already mapped, and holds up the messages queued behind
it on that thread; on a host whose cores the stages share, the faults also take CPU from the
compute. GPUs do not need this: PyTorch's CUDA caching allocator already reuses device memory.

How. The pool owns the *storage* of every buffer it hands out and gives out a tensor viewing
it. Whoever receives the tensor (the stage, autograd's saved tensors, views of it) holds
references to that storage; once they are all gone only the pool's is left, and the storage
goes out again with the next message of the same size in bytes. So, like the CUDA caching
allocator, the pool keeps the peak of receive memory in use, and it never hands out memory
anyone still holds. References are counted with ``torch._C._storage_Use_Count``; where that is
missing, or ``PIPEDREAM_KEEP_HOST_MEMORY=0`` is set, every buffer is allocated afresh.
"""

from __future__ import annotations

import math
import os
from collections import deque

import torch
from torch import Tensor

from pipedream.host_memory import ENV_VAR

__all__ = ["MIN_POOLED_BYTES", "MAX_TRACKED", "ReceiveBuffers"]

MIN_POOLED_BYTES = 128 * 1024
"""Smaller buffers come from the allocator's heap (glibc's default ``mmap`` threshold)."""
MAX_TRACKED = 64
"""Storages of one size the pool follows at most: beyond, it forgets the oldest in use (a
workload that keeps every received tensor then costs no more than without the pool)."""

_use_count = getattr(torch._C, "_storage_Use_Count", None)


class ReceiveBuffers:
    """Hands out CPU tensors for incoming messages, reusing storage nobody else holds."""

    def __init__(self, device: torch.device, *, pin: bool = False):
        self.device = device
        self.pin = pin and device.type == "cpu"
        """Host buffers in pinned memory (messages staged for a GPU: faster copies)."""
        self.enabled = (
            device.type == "cpu"
            and _use_count is not None
            and os.environ.get(ENV_VAR, "1").strip() != "0"
        )
        self._storages: dict[int, deque[torch.UntypedStorage]] = {}
        self.allocated = 0
        """Storages allocated so far (for tests and diagnostics)."""

    def empty(self, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        """An uninitialised tensor of ``dtype`` and ``shape``, in reused storage where free."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.enabled or nbytes < MIN_POOLED_BYTES:
            return torch.empty(shape, dtype=dtype, device=self.device, pin_memory=self.pin)
        storages = self._storages.setdefault(nbytes, deque())
        storage = self._free(storages)
        if storage is None:
            if self.pin:
                storage = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
            else:
                storage = torch.UntypedStorage(nbytes, device=self.device)
            self.allocated += 1
            if len(storages) >= MAX_TRACKED:
                storages.popleft()
            storages.append(storage)
        return torch.empty(0, dtype=dtype, device=self.device).set_(storage, 0, shape)

    def empty_like(self, tensor: Tensor) -> Tensor:
        """:meth:`empty` of ``tensor``'s dtype and shape."""
        return self.empty(tensor.dtype, tuple(tensor.shape))

    @staticmethod
    def _free(storages: deque[torch.UntypedStorage]) -> torch.UntypedStorage | None:
        """A storage only the pool references, if any."""
        assert _use_count is not None
        for storage in storages:
            if _use_count(storage._cdata) == 1:
                return storage
        return None
