"""``pipedream profile --concurrent K``: co-runners train while the layers are measured, and
none of them outlives the profiler, whatever happens to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pipedream.cli import main
from pipedream.formats.profile import load_profile
from pipedream.profiler.command import profile_workload
from pipedream.profiler.corunners import Corunners, CorunnerSpec
from pipedream.profiler.measure import ProfilerError

TINY = {"layers": "1", "width": "32", "in_features": "16", "samples": "256"}
"""An mlp whose training step takes well under a millisecond."""


def _spec(workload: str = "mlp") -> CorunnerSpec:
    return CorunnerSpec(workload, TINY, 8, 1, tuple(sys.path))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _corunner_children() -> list[int]:
    """Pids of this process's children that are co-runners."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"pipedream.profiler.corunners" in cmdline:
                pids.append(int(pid))
    return pids


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def test_corunners_train_until_the_block_ends() -> None:
    with Corunners(_spec(), 2) as corunners:
        pids = [proc.pid for proc in corunners.processes]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        before = [_cpu_seconds(pid) for pid in pids]
        start = time.monotonic()
        time.sleep(1.0)
        spent = [_cpu_seconds(pid) - b for pid, b in zip(pids, before)]
        elapsed = time.monotonic() - start
    # each computes flat out (two of them on this test machine's two cores, beside pytest)
    assert all(s > 0.25 * elapsed for s in spent), (spent, elapsed)
    assert not any(_alive(pid) for pid in pids)
    assert corunners.processes == []


def test_a_corunner_whose_workload_prints_keeps_training(tmp_path: Path) -> None:
    """Nobody reads a co-runner's stdout after its ready line: a full pipe must not stop it."""
    (tmp_path / "chatty_workload.py").write_text(
        textwrap.dedent(
            """
            from pipedream.workloads.mlp import build

            def chatty(
                layers: int, width: int, in_features: int, samples: int, microbatch_size: int
            ):
                workload = build(layers, width, in_features, 4, samples, microbatch_size=8)
                loss = workload.loss_fn

                def noisy_loss(output, target):
                    print("x" * 4096, flush=True)  # 64 KiB fill a pipe in 16 steps
                    return loss(output, target)

                workload.loss_fn = noisy_loss
                return workload
            """
        )
    )
    spec = CorunnerSpec("chatty_workload:chatty", TINY, 8, 1, (str(tmp_path), *sys.path))
    with Corunners(spec, 1) as corunners:
        pid = corunners.processes[0].pid
        time.sleep(1.0)  # thousands of steps: far more than a pipe holds
        before, start = _cpu_seconds(pid), time.monotonic()
        time.sleep(1.0)
        spent, elapsed = _cpu_seconds(pid) - before, time.monotonic() - start
    assert spent > 0.25 * elapsed, (spent, elapsed)


def test_zero_corunners_start_nothing() -> None:
    with Corunners(_spec(), 0) as corunners:
        assert corunners.processes == []


def test_a_failing_corunner_is_one_clear_error_and_leaves_nothing() -> None:
    with pytest.raises(ProfilerError) as info:
        with Corunners(_spec("no_such_module_here:factory"), 2):
            pass
    message = str(info.value)
    assert "a co-runner training 'no_such_module_here:factory' failed" in message
    assert "cannot import module 'no_such_module_here'" in message
    assert _corunner_children() == []


def test_corunners_stop_when_the_profiler_is_killed(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    parent = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path[:0] = {sys.path!r}
        from pipedream.profiler.corunners import CorunnerSpec, Corunners
        spec = CorunnerSpec("mlp", {TINY!r}, 8, 1, tuple(sys.path))
        with Corunners(spec, 2) as corunners:
            with open({str(pids_file)!r}, "w") as out:
                out.write(" ".join(str(p.pid) for p in corunners.processes))
            os.kill(os.getpid(), signal.SIGKILL)  # no __exit__, no cleanup of any kind
        """
    )
    done = subprocess.run([sys.executable, "-c", parent], timeout=240, check=False)
    assert done.returncode == -signal.SIGKILL
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftover = [pid for pid in pids if _alive(pid)]
    for pid in leftover:  # leave nothing behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert leftover == []


def test_profile_cli_records_concurrent_and_stops_its_corunners(tmp_path: Path, capsys) -> None:
    out = tmp_path / "profile.yaml"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = ["profile", "mlp", "--concurrent", "2", "--warmup", "0", "--repeats", "1"]
        for key, value in TINY.items():
            argv += ["--workload-arg", f"{key}={value}"]
        assert main([*argv, "-o", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert load_profile(out).concurrent == 2
    assert "concurrent: 2\n" in out.read_text()
    first = capsys.readouterr().out.splitlines()[0]
    assert "1 CPU threads, 1 more process training beside it (--concurrent 2)" in first
    assert _corunner_children() == []


def test_concurrent_is_refused_on_a_gpu_before_anything_starts() -> None:
    with pytest.raises(ProfilerError, match="every rank has a device of its own"):
        profile_workload("mlp", TINY, device=torch.device("cuda:0"), concurrent=2)
    assert _corunner_children() == []
