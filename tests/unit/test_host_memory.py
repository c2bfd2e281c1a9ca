"""keep_freed_host_memory: freed blocks stay in the process, so the next step does not fault."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from pipedream.host_memory import ENV_VAR

_GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")

# Three 8 MiB blocks written and freed, three times; prints the page faults of the last round.
# glibc's defaults give the free top of the heap back to the kernel every round (the blocks
# are below its mmap threshold once it has adapted, above its trim threshold together).
_SCRIPT = """
import ctypes, resource
from pipedream.host_memory import keep_freed_host_memory
print(keep_freed_host_memory())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 8 * 2**20
def one_round():
    blocks = [libc.malloc(SIZE) for _ in range(3)]
    for block in blocks:
        ctypes.memset(block, 1, SIZE)
    for block in blocks:
        libc.free(block)
one_round(); one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(setting: str) -> tuple[str, int]:
    env = dict(os.environ, **{ENV_VAR: setting})
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    configured, faults = done.stdout.split()
    return configured, int(faults)


@pytest.mark.skipif(not _GLIBC, reason="glibc malloc only")
def test_freed_memory_is_reused_without_page_faults() -> None:
    pages = 3 * 8 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    configured, faults = _faults("1")
    assert configured == "True"
    assert faults < pages // 20  # the blocks come back from the heap, already mapped
    configured, faults = _faults("0")  # the switch leaves glibc's defaults: every page again
    assert configured == "False"
    assert faults >= pages * 9 // 10
