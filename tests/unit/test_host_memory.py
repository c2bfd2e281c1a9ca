"""Host memory settings: freed blocks stay in the process, large tensors use huge pages."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipedream.host_memory import ENV_VAR, HUGE_PAGES_ENV_VAR

_GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_THP = _THP_MODE.exists() and "[never]" not in _THP_MODE.read_text()

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


# A 32 MiB tensor: with huge pages on, PyTorch advises MADV_HUGEPAGE on its block (the kernel
# lists the advice as "hg" among the mapping's VmFlags in /proc/self/smaps); prints whether the
# settings are in effect and whether the tensor's mapping carries the advice.
_HUGE_SCRIPT = """
from pipedream.host_memory import use_huge_pages
print(use_huge_pages())
import torch
tensor = torch.ones(8 * 2**20)  # alive while its mapping is read
address = tensor.data_ptr()
inside = False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and all(c in "0123456789abcdef-" for c in head):
        start, end = (int(part, 16) for part in head.split("-"))
        inside = start <= address < end
    elif inside and line.startswith("VmFlags:"):
        print("hg" in line.split())
"""


def _huge(env: dict[str, str]) -> tuple[str, str]:
    environment = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, HUGE_PAGES_ENV_VAR)}
    done = subprocess.run(
        [sys.executable, "-c", _HUGE_SCRIPT],
        env=dict(environment, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    in_effect, advised = done.stdout.split()
    return in_effect, advised


@pytest.mark.skipif(not _THP, reason="Linux with transparent huge pages")
def test_large_tensors_use_huge_pages_by_default() -> None:
    assert _huge({}) == ("True", "True")
    assert _huge({HUGE_PAGES_ENV_VAR: "0"}) == ("False", "False")  # the user's choice stands
    assert _huge({ENV_VAR: "0"}) == ("False", "False")  # pipedream leaves memory alone
