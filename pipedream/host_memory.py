"""Host memory settings for training on CPUs: keep freed memory, use transparent huge pages.

A training step frees and allocates the same tensors every time: gradients set to None before
the backward, activations, received messages. By default glibc returns the free top of its
heap to the kernel (trimming) and serves blocks from 128 KiB up by ``mmap``, unmapped again on
free, so the next step page-faults all that memory back in, zeroed by the kernel: time spent
in the kernel on every step, mostly in the backward, which allocates the gradients afresh.

:func:`keep_freed_host_memory` sets glibc's trim threshold to 2 GiB and pins its ``mmap``
threshold at 32 MiB, the most glibc accepts (setting either turns off glibc's own adjustment
of both). Blocks of 32 MiB and more are still mapped and unmapped by glibc, and every 4 KiB
page of them faults in again: :func:`use_huge_pages` turns on PyTorch's transparent-huge-page
allocations (``THP_MEM_ALLOC_ENABLE=1``: blocks of 2 MiB and more are page-aligned and advised
``MADV_HUGEPAGE``), one fault per 2 MiB instead of 512. That matters for large activations and
messages; smaller tensors come from glibc's heap, kept and reused, and huge pages change little
for them.

:func:`configure_host_memory` does both. ``pipedream train`` calls it in every rank and
``pipedream profile`` before it measures, so a profile sees the memory behaviour of the runtime.
The runtime's transport also receives messages into reused storage on the CPU
(``runtime/receive_buffers.py``). ``PIPEDREAM_KEEP_HOST_MEMORY=0`` leaves both settings alone and
turns that pool off; ``THP_MEM_ALLOC_ENABLE=0`` in the environment turns off the huge pages only.
Malloc settings need glibc (on musl or macOS they do nothing), huge pages Linux with THP not
``never``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

__all__ = [
    "ENV_VAR",
    "HUGE_PAGES_ENV_VAR",
    "MMAP_THRESHOLD",
    "TRIM_THRESHOLD",
    "configure_host_memory",
    "keep_freed_host_memory",
    "use_huge_pages",
]

ENV_VAR = "PIPEDREAM_KEEP_HOST_MEMORY"
"""Set to ``0`` to leave malloc's settings and the huge pages alone."""
HUGE_PAGES_ENV_VAR = "THP_MEM_ALLOC_ENABLE"
"""PyTorch's switch for transparent huge pages in its CPU allocator (read at its first
allocation)."""
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TRIM_THRESHOLD = 2**31 - 1
"""Free bytes at the top of the heap kept before any is returned (``mallopt`` takes an int)."""
MMAP_THRESHOLD = 32 * 1024 * 1024
"""Blocks at least this large are mapped on their own (glibc's maximum, HEAP_MAX_SIZE / 2)."""

_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def configure_host_memory() -> None:
    """Both settings (module docstring); call before the process allocates any tensor."""
    keep_freed_host_memory()
    use_huge_pages()


def _disabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip() == "0" or not sys.platform.startswith("linux")


def use_huge_pages() -> bool:
    """Turn on PyTorch's huge-page allocations unless the environment says otherwise.

    Returns whether they are in effect: the variable is ``1`` (set here when absent) and the
    kernel's THP mode is ``always`` or ``madvise``. PyTorch reads the variable once, at its
    first CPU allocation, so this must run before any tensor exists.
    """
    if _disabled():
        return False
    os.environ.setdefault(HUGE_PAGES_ENV_VAR, "1")
    if os.environ[HUGE_PAGES_ENV_VAR].strip() != "1":
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:  # no THP in this kernel
        return False


def keep_freed_host_memory() -> bool:
    """Configure glibc malloc to keep freed memory; returns whether it was configured."""
    if _disabled():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its mallopt differs or is absent
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success and 0 on error
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
