"""Keep freed host memory in the process instead of giving it back to the OS (glibc malloc).

A training step frees and allocates the same tensors every time: gradients set to None before
the backward, activations, received messages. By default glibc returns the free top of its
heap to the kernel (trimming) and serves blocks from 128 KiB up by ``mmap``, unmapped again on
free, so the next step page-faults all that memory back in, zeroed by the kernel. For the
8.4 M-parameter ``mlp`` benchmark on one CPU core that was 5-8 ms of a 46 ms step: 28.9 ms of
backward with the defaults, 20.8-21.9 ms with freed memory kept (``pipedream train`` of one
stage, 30 steps).

:func:`keep_freed_host_memory` sets glibc's trim threshold to 2 GiB and pins its ``mmap``
threshold at 32 MiB, the most glibc accepts (setting either turns off glibc's own adjustment
of both). ``pipedream train`` calls it in every rank and ``pipedream profile`` before it
measures, so a profile sees the memory behaviour of the runtime. Blocks above 32 MiB are still
mapped and unmapped by glibc. ``PIPEDREAM_KEEP_HOST_MEMORY=0`` leaves the allocator alone; on
other C libraries (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["ENV_VAR", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_host_memory"]

ENV_VAR = "PIPEDREAM_KEEP_HOST_MEMORY"
"""Set to ``0`` to leave malloc's settings alone."""
TRIM_THRESHOLD = 2**31 - 1
"""Free bytes at the top of the heap kept before any is returned (``mallopt`` takes an int)."""
MMAP_THRESHOLD = 32 * 1024 * 1024
"""Blocks at least this large are mapped on their own (glibc's maximum, HEAP_MAX_SIZE / 2)."""

_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def keep_freed_host_memory() -> bool:
    """Configure glibc malloc to keep freed memory; returns whether it was configured."""
    if os.environ.get(ENV_VAR, "1").strip() == "0" or not sys.platform.startswith("linux"):
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
