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
from pipedream.errors import RunFailure
from pipedream.formats.profile import load_profile
from pipedream.profiler import command, corunners
from pipedream.profiler.command import profile_workload
from pipedream.profiler.corunners import Corunners, CorunnerSpec
from pipedream.profiler.measure import ProfilerError

TINY = {"layers": "1", "width": "32", "in_features": "16", "samples": "256"}
"""An mlp whose training step takes well under a millisecond."""

pytestmark = [
    pytest.mark.slow,  # starts co-runner processes: not in the fast lane (-m "not slow")
    pytest.mark.skipif(
        not Path(f"/proc/self/task/{os.getpid()}/children").exists(),
        reason="needs /proc/PID/task/TID/children",
    ),
]


def _spec(workload: str = "mlp", *extra_path: str) -> CorunnerSpec:
    return CorunnerSpec(workload, TINY, 8, 1, (*extra_path, *sys.path))


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


def _is_corunner(pid: int) -> bool:
    try:
        return b"pipedream.profiler.corunners" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False


def _corunner_children() -> list[int]:
    """Pids of this process's children that are co-runners."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:  # a thread that just ended
            continue
        pids += [int(pid) for pid in children if _is_corunner(int(pid))]
    return pids


def _trains(pid: int, *, seconds: float = 10.0) -> bool:
    """Whether the process uses CPU time (keeps computing) within ``seconds``."""
    before = _cpu_seconds(pid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if _cpu_seconds(pid) - before >= 0.1:  # 10 clock ticks: not a stray wake-up
            return True
    return False


def _workload_module(tmp_path: Path, body: str) -> None:
    """A workload module ``tiny_workload`` in ``tmp_path``: the mlp, its loss wrapped."""
    (tmp_path / "tiny_workload.py").write_text(
        textwrap.dedent(
            """
            import time

            from pipedream.workloads.mlp import build

            STEPS = [0]

            def factory(
                layers: int, width: int, in_features: int, samples: int, microbatch_size: int
            ):
                workload = build(layers, width, in_features, 4, samples, microbatch_size=8)
                loss = workload.loss_fn

                def wrapped(output, target):
                    STEPS[0] += 1
            """
        )
        + textwrap.indent(textwrap.dedent(body), " " * 8)
        + textwrap.indent("return loss(output, target)\n", " " * 8)
        + textwrap.indent("workload.loss_fn = wrapped\nreturn workload\n", " " * 4)
    )


def test_corunners_train_until_the_block_ends() -> None:
    with Corunners(_spec(), num_corunners=2) as corunners:
        pids = [proc.pid for proc in corunners.processes]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        assert all(_trains(pid) for pid in pids)
    assert not any(_alive(pid) for pid in pids)
    assert corunners.processes == []


def test_zero_corunners_start_nothing() -> None:
    with Corunners(_spec(), num_corunners=0) as corunners:
        assert corunners.processes == []


def test_a_corunner_whose_workload_prints_keeps_training(tmp_path: Path) -> None:
    """Nobody reads a co-runner's stdout after its ready line: a full pipe must not stop it."""
    _workload_module(tmp_path, 'print("x" * 4096, flush=True)  # 16 steps fill a pipe\n')
    spec = _spec("tiny_workload:factory", str(tmp_path))
    with Corunners(spec, num_corunners=1) as corunners:
        pid = corunners.processes[0].pid
        time.sleep(1.0)  # thousands of steps: far more than a pipe holds
        assert os.readlink(f"/proc/{pid}/fd/1") == os.devnull
        assert _trains(pid)


def test_what_a_ready_corunner_writes_to_stderr_goes_nowhere(tmp_path: Path) -> None:
    """The profiler keeps a co-runner's stderr in a file: a line per step must not grow it for
    as long as the profile runs."""
    _workload_module(tmp_path, 'import sys\nsys.stderr.write("y" * 4096 + "\\n")\n')
    spec = _spec("tiny_workload:factory", str(tmp_path))
    with Corunners(spec, num_corunners=1) as corunners:
        pid = corunners.processes[0].pid
        time.sleep(1.0)  # thousands of steps, 4 KiB each
        assert os.readlink(f"/proc/{pid}/fd/2") == os.devnull
        assert _trains(pid)
        kept = os.fstat(corunners._errors[0].fileno()).st_size
    assert 3 * 4096 < kept < 64 * 1024  # the warm-up steps' lines and the ready line only


def test_a_corunner_killed_once_ready_is_not_explained_by_its_startup_output(
    tmp_path: Path,
) -> None:
    _workload_module(tmp_path, 'import sys\nprint("startup noise", file=sys.stderr)\n')
    spec = _spec("tiny_workload:factory", str(tmp_path))
    with pytest.raises(RunFailure) as info:
        with Corunners(spec, num_corunners=1) as corunners:
            proc = corunners.processes[0]
            proc.kill()
            proc.wait(timeout=30)
    assert str(info.value).endswith(
        "stopped during the measurement, so the profile was not measured beside 1 of them: "
        "killed by signal 9 (out of memory?)"
    )
    assert _corunner_children() == []


def test_a_corunner_marks_stderr_before_it_says_it_is_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the profiler may kill (or see killed) a co-runner as soon as it reads the ready line; the
    # mark must already be on stderr, or the startup output explains the death (a CI run read
    # "startup noise (killed by signal 9 ...)" this way)
    writes: list[tuple[int, bytes]] = []
    monkeypatch.setattr(corunners.os, "write", lambda fd, data: writes.append((fd, data)))
    monkeypatch.setattr(corunners.os, "close", lambda fd: None)
    monkeypatch.setattr(corunners.os, "dup", lambda fd: 99)
    monkeypatch.setattr(corunners, "_to_devnull", lambda fd: None)
    monkeypatch.setattr(corunners, "_error_fd", 2)
    corunners._announce_ready(7)
    assert writes == [(2, b"pipedream-corunner-ready\n"), (7, b"ready\n")]
    assert corunners._error_fd == 99


def test_a_corunner_that_fails_to_start_is_one_clear_error_and_leaves_nothing() -> None:
    with pytest.raises(RunFailure) as info:
        with Corunners(_spec("no_such_module_here:factory"), num_corunners=2):
            pass
    message = str(info.value)
    assert "a co-runner training 'no_such_module_here:factory' failed:" in message
    assert "cannot import module 'no_such_module_here'" in message
    assert message.endswith("(exit status 1)")
    assert "\n" not in message
    assert _corunner_children() == []


def test_a_corunner_that_dies_during_the_measurement_fails_the_profile(tmp_path: Path) -> None:
    _workload_module(
        tmp_path,
        """
        if STEPS[0] == 50:
            raise RuntimeError("deliberately\\nbroken at step 50")
        """,
    )
    spec = _spec("tiny_workload:factory", str(tmp_path))
    with pytest.raises(RunFailure) as info:
        with Corunners(spec, num_corunners=1) as corunners:
            proc = corunners.processes[0]
            proc.wait(timeout=60)  # it dies at step 50, long after it was ready
    message = str(info.value)
    assert "stopped during the measurement" in message
    assert "RuntimeError: deliberately broken at step 50 (exit status 1)" in message
    assert _corunner_children() == []


def test_a_corunner_that_is_not_ready_in_time_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A co-runner still starting has no microbatch to finish: it is killed at once, not
    given the grace a training one gets to stop (here a minute)."""
    monkeypatch.setattr(corunners, "STOP_TIMEOUT", 60.0)
    _workload_module(tmp_path, "time.sleep(120)\n")
    spec = _spec("tiny_workload:factory", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(RunFailure, match=r"1 co-runner\(s\) not ready after 2 s"):
        with Corunners(spec, num_corunners=1, start_timeout=2.0):
            pass
    assert time.monotonic() - start < 30  # killed, not waited for
    assert _corunner_children() == []


def test_an_interrupt_inside_the_block_stops_the_corunners() -> None:
    with pytest.raises(KeyboardInterrupt):
        with Corunners(_spec(), num_corunners=1) as corunners:
            pid = corunners.processes[0].pid
            raise KeyboardInterrupt
    assert not _alive(pid)


def test_corunners_stop_when_the_profiler_is_killed(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    parent = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path[:0] = {sys.path!r}
        from pipedream.profiler.corunners import CorunnerSpec, Corunners
        spec = CorunnerSpec("mlp", {TINY!r}, 8, 1, tuple(sys.path))
        with Corunners(spec, num_corunners=2) as corunners:
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
    while any(_alive(pid) and _is_corunner(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftover = [pid for pid in pids if _alive(pid) and _is_corunner(pid)]
    for pid in leftover:  # leave nothing behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert leftover == []


def test_profile_cli_records_concurrent_and_stops_its_corunners(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    out = tmp_path / "profile.yaml"
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    try:
        argv = ["profile", "mlp", "--concurrent", "2", "--warmup", "0", "--repeats", "1"]
        for key, value in TINY.items():
            argv += ["--workload-arg", f"{key}={value}"]
        assert main([*argv, "-o", str(out)]) == 0
        # as torchrun gives each of several ranks one thread without OMP_NUM_THREADS
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert load_profile(out).concurrent == 2
    assert "concurrent: 2\n" in out.read_text()
    printed = capsys.readouterr().out
    assert "1 CPU thread, 1 more process training beside it (--concurrent 2)" in printed
    assert _corunner_children() == []


def test_more_busy_threads_than_cores_is_said(capsys, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cores = len(os.sched_getaffinity(0))
        command._share_the_host_like_ranks(cores + 1, sys.stdout)
        assert capsys.readouterr().out == (
            f"note: --concurrent {cores + 1} x 1 thread = {cores + 1} busy threads on "
            f"{cores} CPU cores: the layers' times include waiting for a core\n"
        )
        command._share_the_host_like_ranks(cores, sys.stdout)
        assert capsys.readouterr().out == ""
    finally:
        torch.set_num_threads(threads)


def test_concurrent_is_refused_on_a_gpu_before_anything_starts(monkeypatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing may be built or started before the device is checked")

    monkeypatch.setattr(command, "load_workload", never)
    monkeypatch.setattr(Corunners, "__enter__", never)
    with pytest.raises(ProfilerError, match="every rank has a device of its own") as info:
        profile_workload("mlp", TINY, device=torch.device("cuda:0"), concurrent=2)
    assert "CUDA_VISIBLE_DEVICES=" in str(info.value)
