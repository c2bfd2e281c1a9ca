"""Co-runners: the other ranks of a CPU host, training while the profiler measures.

On a GPU every pipeline rank has its own device, so one process measuring the layers sees what
each rank will see. On CPUs several ranks share a host: while one stage computes, the others
compute beside it, and they share the memory bandwidth and caches (and, on hosts with SMT, the
cores themselves). The layers then run slower than in a lone profiling process, and a
simulation from a lone profile predicts a CPU pipeline too fast; a profile taken beside
co-runners comes closer to what the pipeline's actions take. The contention it sees still
varies with whatever else the host runs at the time.

``pipedream profile --concurrent K`` therefore starts ``K - 1`` co-runner processes before it
measures and stops them after: each trains the same workload (forward, backward and optimizer
step over the whole model, one microbatch after another, with the profiling process's number of
threads and the runtime's host memory settings), so that the measured process shares the host
as one of ``K`` ranks would.

What the co-runners do is an approximation of the other ranks: they train the whole model and
step after every microbatch, always busy, where a rank trains its stage, waits in bubbles and
copies messages.

A co-runner is ``python -m pipedream.profiler.corunners SPEC_JSON``. It prints ``ready`` once
it has trained a few microbatches, and from then on sends whatever the workload prints, on
stdout or stderr, to ``/dev/null`` (nobody reads a pipe that would fill, and a file that grows
for as long as the profile runs would hold nothing but that), except the one line saying why it
failed, if it does. It stops when its standard input closes: when
:class:`Corunners` leaves its ``with`` block, and also when the profiling process dies, however
it dies (after its current microbatch), so no co-runner outlives it. One that stops on its own
while the measurement runs fails the profile, which would otherwise claim ``K`` processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import IO

from pipedream.errors import RunFailure

__all__ = ["ERROR_MARK", "READY", "WARMUP_STEPS", "CorunnerSpec", "Corunners", "main"]

READY = "ready"
"""The line a co-runner prints once it trains at full speed."""
WARMUP_STEPS = 3
"""Microbatches a co-runner trains before it says it is ready (first-call costs)."""
ERROR_MARK = "pipedream-corunner-error:"
"""Starts the one line a failing co-runner writes to stderr (after any traceback noise)."""
STDERR_READY = "pipedream-corunner-ready"
"""The line a co-runner writes to stderr when it is ready: later lines are error lines only."""
STOP_TIMEOUT = 10.0
"""Seconds all co-runners together get to finish their microbatch once told to stop."""


@dataclass(frozen=True)
class CorunnerSpec:
    """What every co-runner trains: the profiled workload, built the same way."""

    workload: str
    """Built-in name or ``package.module:function``."""
    workload_args: dict[str, str]
    """``--workload-arg`` options."""
    microbatch_size: int | None
    """``--microbatch-size`` (None: the workload's default)."""
    num_threads: int
    """``torch.set_num_threads`` of the profiling process."""
    sys_path: tuple[str, ...] = ()
    """The profiling process's import path, so a workload it can import imports here too."""
    precision: str = "fp32"
    """What the forwards run in (``--precision``, :mod:`pipedream.precision`)."""

    def to_json(self) -> str:
        """The spec as the co-runner's command-line argument."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CorunnerSpec:
        """The spec back from :meth:`to_json`."""
        data = json.loads(text)
        data["sys_path"] = tuple(data.get("sys_path", ()))
        return cls(**data)


class Corunners:
    """``num_corunners`` co-runner processes, training from ``__enter__`` until ``__exit__``.

    ``__enter__`` returns once every co-runner is ready. A co-runner that fails to start, or
    one that is no longer training when the block ends (it crashed, or was killed for memory),
    raises :class:`~pipedream.errors.RunFailure` with its last error line and exit status:
    what was measured beside it would not be what the profile says.
    """

    def __init__(
        self, spec: CorunnerSpec, *, num_corunners: int, start_timeout: float = 300.0
    ) -> None:
        assert num_corunners >= 0
        self.spec = spec
        self.num_corunners = num_corunners
        self.start_timeout = start_timeout
        self.processes: list[subprocess.Popen[bytes]] = []
        self._errors: list[IO[bytes]] = []
        self._ready: set[int] = set()
        """The pids of the co-runners that said they are ready (training)."""

    def __enter__(self) -> Corunners:
        try:
            for _ in range(self.num_corunners):
                self._start_one()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        died = self.stop()
        if died and kind is None:  # never hide the exception already on its way
            raise RunFailure(
                f"--concurrent: a co-runner training {self.spec.workload!r} stopped during "
                f"the measurement, so the profile was not measured beside "
                f"{self.num_corunners} of them: {died}"
            )

    def _start_one(self) -> None:
        errors = tempfile.TemporaryFile()
        self._errors.append(errors)
        argv = [sys.executable, "-m", "pipedream.profiler.corunners", self.spec.to_json()]
        try:
            process = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors
            )
        except OSError as exc:
            raise RunFailure(f"--concurrent: cannot start a co-runner process ({exc})") from None
        self.processes.append(process)

    def _wait_ready(self) -> None:
        """Read every co-runner's stdout until its ready line (other lines are skipped)."""
        deadline = time.monotonic() + self.start_timeout
        pending: dict[int, tuple[subprocess.Popen[bytes], bytearray]] = {}
        with selectors.DefaultSelector() as selector:
            for proc in self.processes:
                assert proc.stdout is not None
                selector.register(proc.stdout.fileno(), selectors.EVENT_READ)
                pending[proc.stdout.fileno()] = (proc, bytearray())
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RunFailure(
                        f"--concurrent: {len(pending)} co-runner(s) not ready after "
                        f"{self.start_timeout:.0f} s; is the machine overloaded? try a smaller "
                        "--concurrent"
                    )
                for key, _ in selector.select(timeout=min(left, 1.0)):
                    proc, buffer = pending[key.fd]
                    chunk = os.read(key.fd, 4096)
                    if not chunk:  # end of file before the ready line: it failed
                        raise RunFailure(
                            f"--concurrent: a co-runner training {self.spec.workload!r} "
                            f"failed: {self._failure(proc)}"
                        )
                    buffer += chunk
                    if READY.encode() in buffer.splitlines():
                        selector.unregister(key.fd)
                        del pending[key.fd]
                        self._ready.add(proc.pid)

    def _failure(self, proc: subprocess.Popen[bytes]) -> str:
        """The co-runner's error line and exit status (it is waited for, killed after 10 s)."""
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        errors = self._errors[self.processes.index(proc)]
        errors.seek(0)
        lines = [line.strip() for line in errors.read().decode(errors="replace").splitlines()]
        if STDERR_READY in lines:  # what it printed while starting says nothing about its end
            lines = lines[len(lines) - lines[::-1].index(STDERR_READY) :]
        marked = [line.removeprefix(ERROR_MARK).strip() for line in lines if ERROR_MARK in line]
        status = proc.returncode
        how = (
            f"killed by signal {-status}" + (" (out of memory?)" if status == -9 else "")
            if status < 0
            else f"exit status {status}"
        )
        last = marked[-1] if marked else next((line for line in reversed(lines) if line), "")
        return f"{last} ({how})" if last else how

    def stop(self) -> str:
        """Close every co-runner's input and wait for them to finish their microbatch (all
        together at most :data:`STOP_TIMEOUT` s, then killed); one that never said it was ready
        is still starting, with no microbatch to finish, and is killed at once. Release their
        files.

        Returns what became of the first co-runner that had stopped on its own before (its
        error line and exit status), or an empty string when all were still training.
        """
        died = ""
        for proc in self.processes:
            if proc.poll() is not None and not died:
                died = self._failure(proc)
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:  # it died already
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in self.processes:
            if proc.pid not in self._ready and proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for errors in self._errors:
            errors.close()
        self.processes, self._errors, self._ready = [], [], set()
        return died


def _train(spec: CorunnerSpec, stop: threading.Event, ready: Callable[[], None]) -> None:
    """Train the workload one microbatch after another until ``stop`` is set; call ``ready``
    after the first :data:`WARMUP_STEPS`."""
    import torch

    from pipedream.data import MicrobatchStream
    from pipedream.host_memory import configure_host_memory
    from pipedream.model_io import batch_size, call_model, map_tensors
    from pipedream.precision import autocast, loss_input
    from pipedream.runtime.gc_freeze import frozen_heap
    from pipedream.workload import load_workload

    configure_host_memory()  # as the profiling process and every rank of `pipedream train`
    torch.set_num_threads(spec.num_threads)
    workload = load_workload(
        spec.workload, spec.workload_args, microbatch_size=spec.microbatch_size
    )
    model = workload.model
    optimizer = workload.optimizer(model.parameters())
    stream = MicrobatchStream(workload.dataset, batch_size(workload.example_input), seed=0)
    step = 0
    with frozen_heap():
        while not stop.is_set():
            inputs, targets = stream.microbatch(step)
            with autocast(spec.precision, torch.device("cpu")):
                output = call_model(model, inputs)
            output = map_tensors(lambda t: loss_input(spec.precision, t), output)
            workload.loss_fn(output, targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == WARMUP_STEPS:
                ready()


_error_fd = 2
"""Where the error line goes: stderr, or a copy of it once the rest goes to /dev/null."""


def _to_devnull(fd: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _announce_ready(signal_fd: int) -> None:
    """Mark stderr, then tell the profiler on ``signal_fd`` (a copy of stdout) and close it;
    from then on stderr too goes to /dev/null (a line per step would fill the profiler's file
    for as long as it measures), but for the error line, which goes to a copy.

    The mark comes first: once the profiler reads the ready line it may find this process
    gone (killed), and explains that by the stderr lines after the mark, never by what the
    workload printed while it started.
    """
    global _error_fd
    sys.stderr.flush()
    os.write(2, f"{STDERR_READY}\n".encode())
    os.write(signal_fd, f"{READY}\n".encode())
    os.close(signal_fd)
    _error_fd = os.dup(2)
    _to_devnull(2)


def main(argv: list[str] | None = None) -> int:
    """Co-runner entry point: train until standard input closes."""
    argv = sys.argv[1:] if argv is None else argv
    spec = CorunnerSpec.from_json(argv[0])
    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    # the ready line goes to the profiler on a copy of stdout; whatever the workload prints
    # goes nowhere (nobody reads the pipe after that line: a full pipe would block training)
    signal_fd = os.dup(1)
    _to_devnull(1)
    stop = threading.Event()

    def watch_input() -> None:
        sys.stdin.read()  # returns at end of file: the profiler closed it, or died
        stop.set()

    threading.Thread(target=watch_input, daemon=True).start()
    _train(spec, stop, lambda: _announce_ready(signal_fd))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # one line for the profiler to show, whatever the message holds
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        os.write(_error_fd, f"{ERROR_MARK} {message[:500]}\n".encode())
        sys.exit(1)
