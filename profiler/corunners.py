"""Co-runners: the other ranks of a CPU host, training while the profiler measures.

On a GPU every pipeline rank has its own device, so one process measuring the layers sees what
each rank will see. On CPUs several ranks share a host: while one stage computes, the others
compute beside it, and they share the memory bandwidth and caches (and, on hosts with SMT, the
cores themselves). The layers then run slower than in a lone profiling process: on this
project's 2-core test machine the 2-stage ``mlp`` pipeline's forwards and backwards took
1.17-1.36x the times profiled alone a minute earlier, and 0.97-1.26x the times profiled with
one co-runner (three rounds of both profiles and a run).

``pipedream profile --concurrent K`` therefore starts ``K - 1`` co-runner processes before it
measures and stops them after: each trains the same workload (forward, backward and optimizer
step over the whole model, one microbatch after another, with the profiling process's number of
threads and the runtime's host memory settings), so that the measured process shares the host
as one of ``K`` ranks would.

A co-runner is ``python -m pipedream.profiler.corunners SPEC_JSON``. It prints ``ready`` once
it has trained a few microbatches, and stops when its standard input closes: when
:class:`Corunners` leaves its ``with`` block, and also when the profiling process dies, however
it dies, so no co-runner outlives it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import IO

from pipedream.profiler.measure import ProfilerError

__all__ = ["READY", "WARMUP_STEPS", "CorunnerSpec", "Corunners", "main"]

READY = "ready"
"""The line a co-runner prints once it trains at full speed."""
WARMUP_STEPS = 3
"""Microbatches a co-runner trains before it says it is ready (first-call costs)."""


@dataclass(frozen=True)
class CorunnerSpec:
    """What every co-runner trains: the profiled workload, built the same way."""

    workload: str
    """Built-in name or ``package.module:function``."""
    workload_args: dict[str, str]
    """``--workload-arg`` options."""
    microbatch_size: int | None
    """``--microbatch-size`` (None: the workload's default)."""
    threads: int
    """``torch.set_num_threads`` of the profiling process."""
    sys_path: tuple[str, ...] = ()
    """The profiling process's import path, so a workload it can import imports here too."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CorunnerSpec:
        data = json.loads(text)
        data["sys_path"] = tuple(data.get("sys_path", ()))
        return cls(**data)


class Corunners:
    """``count`` co-runner processes, training from ``__enter__`` until ``__exit__``.

    ``__enter__`` returns once every co-runner is ready (or raises :class:`ProfilerError` with
    the failing co-runner's last error line, after stopping the others).
    """

    def __init__(self, spec: CorunnerSpec, count: int, *, start_timeout: float = 300.0) -> None:
        assert count >= 0
        self.spec = spec
        self.count = count
        self.start_timeout = start_timeout
        self.processes: list[subprocess.Popen[str]] = []
        self._errors: list[IO[str]] = []

    def __enter__(self) -> Corunners:
        try:
            for _ in range(self.count):
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
        self.stop()

    def _start_one(self) -> None:
        errors = tempfile.TemporaryFile("w+", encoding="utf-8")
        self._errors.append(errors)
        argv = [sys.executable, "-m", "pipedream.profiler.corunners", self.spec.to_json()]
        self.processes.append(
            subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True
            )
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        waiting = {proc.stdout.fileno(): proc for proc in self.processes if proc.stdout}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProfilerError(
                    f"--concurrent: {len(waiting)} co-runner(s) not ready after "
                    f"{self.start_timeout:.0f} s; is the machine overloaded? try a smaller "
                    "--concurrent"
                )
            readable, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
            for fd in readable:
                proc = waiting.pop(fd)
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != READY:
                    raise ProfilerError(
                        f"--concurrent: a co-runner training {self.spec.workload!r} failed: "
                        f"{self._last_error(proc)}"
                    )

    def _last_error(self, proc: subprocess.Popen[str]) -> str:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        errors = self._errors[self.processes.index(proc)]
        errors.seek(0)
        lines = [line.strip() for line in errors.read().splitlines() if line.strip()]
        return lines[-1] if lines else f"it exited with status {proc.returncode}"

    def stop(self) -> None:
        """Close every co-runner's input, wait for it to finish its microbatch (kill it after
        10 s), and release its files."""
        for proc in self.processes:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:  # it died already
                    pass
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for errors in self._errors:
            errors.close()
        self.processes, self._errors = [], []


def _train(spec: CorunnerSpec, stop: threading.Event, ready: Callable[[], None]) -> None:
    import torch

    from pipedream.data import MicrobatchStream
    from pipedream.host_memory import configure_host_memory
    from pipedream.runtime.collector import frozen_heap
    from pipedream.workload import load_workload

    configure_host_memory()  # as the profiling process and every rank of `pipedream train`
    torch.set_num_threads(spec.threads)
    workload = load_workload(
        spec.workload, spec.workload_args, microbatch_size=spec.microbatch_size
    )
    model = workload.model
    optimizer = workload.optimizer(model.parameters())
    stream = MicrobatchStream(workload.dataset, int(workload.example_input.shape[0]), seed=0)
    step = 0
    with frozen_heap():
        while not stop.is_set():
            inputs, targets = stream.microbatch(step)
            workload.loss_fn(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == WARMUP_STEPS:
                ready()


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
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)

    def ready() -> None:
        os.write(signal_fd, f"{READY}\n".encode())
        os.close(signal_fd)

    stop = threading.Event()

    def watch_input() -> None:
        sys.stdin.read()  # returns at end of file: the profiler closed it, or died
        stop.set()

    threading.Thread(target=watch_input, daemon=True).start()
    _train(spec, stop, ready)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # one line for the profiler to show
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
