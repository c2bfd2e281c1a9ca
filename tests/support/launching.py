"""Helpers for tests that launch real multi-process jobs (gloo on loopback)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "REPO",
    "launch",
    "run_cli",
    "run_main",
    "start",
    "start_launch",
    "stop",
    "straight_plan",
    "torchrun",
    "write_plan",
]

REPO = Path(__file__).resolve().parents[2]


def straight_plan(
    workload: str,
    stages: list[list[str]],
    *,
    schedule: str = "pipedream",
    microbatch_size: int = 8,
    microbatches: int = 1,
    workload_args: dict[str, str] | None = None,
    replicas: list[int] | None = None,
) -> dict[str, Any]:
    """A plan dict with the given layer groups (one replica each unless ``replicas``)."""
    replicas = replicas or [1] * len(stages)
    out_stages = []
    rank = 0
    for layers, count in zip(stages, replicas):
        out_stages.append(
            {
                "first_layer": layers[0],
                "last_layer": layers[-1],
                "replicas": count,
                "ranks": list(range(rank, rank + count)),
            }
        )
        rank += count
    return {
        "format": "pipedream/plan@1",
        "workload": workload,
        "workload_args": dict(workload_args or {}),
        "schedule": schedule,
        "microbatch_size": microbatch_size,
        "microbatches": microbatches,
        "world_size": rank,
        "stages": out_stages,
    }


def write_plan(plan: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, **(extra or {}))
    env["PYTHON"] = sys.executable
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``cmd`` in its own session (so that :func:`stop` can kill all its processes)."""
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc``'s whole process group, whatever state it is in (no orphans)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_launch(
    plan_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``./launch.sh PLAN ARGS...`` in the background; pair with :func:`stop`."""
    return start(["bash", str(REPO / "launch.sh"), str(plan_path), *args], env)


def _run(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session; on timeout kill the whole process group."""
    proc = start(cmd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout}s\n{out}\n{err}") from None
    finally:
        stop(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(
    plan_path: Path, *args: str, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``./launch.sh PLAN ARGS...`` with a hard timeout (``env`` adds variables)."""
    return _run(["bash", str(REPO / "launch.sh"), str(plan_path), *args], timeout, env)


def torchrun(
    script: Path, *args: str, nproc: int, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node NPROC SCRIPT ARGS...`` with a hard timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return _run([*cmd, "--nproc-per-node", str(nproc), str(script), *args], timeout)


def run_cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``pipedream ARGS...`` in a subprocess (exit code and stderr as a user sees them)."""
    return _run([sys.executable, "-m", "pipedream.cli", *args], timeout, env)


def run_main(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``pipedream ARGS...`` in this process (``pipedream.cli.main``): its exit code and what it
    prints, as a user sees them, without starting Python (for the paths that end before any
    process group or launch; ``timeout`` is accepted for symmetry with :func:`run_cli`)."""
    from pipedream.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help (0), usage errors (2)
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    return subprocess.CompletedProcess(["pipedream", *args], code, out.getvalue(), err.getvalue())
