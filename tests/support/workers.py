"""Run a plan's ranks as the tests' own processes, without launch.sh and torchrun.

``launch.sh`` starts torchrun, which starts one Python per rank, each importing torch anew: on
2 cores that is most of a small test run's time. Here the ranks are forked from a server
process that has imported torch and pipedream once (``multiprocessing``'s forkserver, which
runs no threads when it forks), given torchrun's environment variables (rank, world size,
local rank, a free loopback port), and run ``pipedream train`` in-process. What they print
goes to a file per rank, joined in rank order into the result, so tests read it as they read
a launch's. Launching itself (``launch.sh``, torchrun's options, restarts, several nodes) is
tested through ``launching.launch``.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

__all__ = ["run_plan"]

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",  # what a torch optimizer imports when it is built: 2.8 s of every rank
    "pipedream.cli",
    "pipedream.runtime.train",
    "pipedream.workloads.mlp",
    "pipedream.workloads.gpt",
    "pipedream.workloads.hf_lm",
    "transformers_if_importable",  # transformers, where it imports
]
"""What the server imports once, so that every rank forked from it starts with it."""
_context: Any = None


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank(argv: list[str], env: dict[str, str], out: str, err: str) -> None:  # pragma: no cover
    """One rank: torchrun's variables, its output to files, ``pipedream train``."""
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.update(env)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    import torch

    torch.set_num_threads(1)  # as torchrun gives each of several ranks
    from pipedream.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_plan(
    plan_path: Path, *args: str, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``pipedream train PLAN ARGS...`` on every rank of the plan (one node, loopback), as
    ``./launch.sh PLAN ARGS...`` runs it; returns the exit code (the first rank's that failed,
    else 0) and every rank's output, rank by rank."""
    world = int(yaml.safe_load(Path(plan_path).read_text())["world_size"])
    port = _free_port()
    context = _forkserver()
    folder = Path(tempfile.mkdtemp(prefix="ranks-"))
    procs, files = [], []
    for rank in range(world):
        rank_env = {  # env may set torchrun's variables too (a restart's count)
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            **(env or {}),
        }
        out, err = folder / f"{rank}.out", folder / f"{rank}.err"
        files.append((out, err))
        argv = ["train", str(plan_path), *args]
        proc = context.Process(target=_rank, args=(argv, rank_env, str(out), str(err)))
        proc.start()
        procs.append(proc)
    timed_out = False
    for proc in procs:
        proc.join(timeout=timeout)
        if proc.is_alive():
            timed_out = True
            break
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    stdout = "".join(out.read_text(errors="replace") for out, _ in files)
    stderr = "".join(err.read_text(errors="replace") for _, err in files)
    if timed_out:
        raise AssertionError(f"{plan_path} timed out after {timeout}s\n{stdout}\n{stderr}")
    codes = [proc.exitcode or 0 for proc in procs]
    code = next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(
        ["pipedream", "train", str(plan_path), *args], code, stdout, stderr
    )
