"""Training metrics: a JSON-lines file, a progress bar and the end-of-run summary numbers."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsLogger"]


class MetricsLogger:
    """Records one line per optimizer update on the rank that computes the loss."""

    def __init__(
        self,
        path: Path,
        *,
        total_steps: int,
        samples_per_step: int,
        progress: bool,
        stream: TextIO | None = None,
        first_step: int = 0,
        minibatches_per_update: int = 1,
    ) -> None:
        """``total_steps``: the run's minibatches by its end (``--steps``); ``first_step``:
        those a resumed run had trained before (its progress counts on from there);
        ``minibatches_per_update``: the minibatches each logged update applies (the last
        stage's replicas); ``stream``: where progress goes (default: ``sys.stderr`` as it is
        when the logger is made, so that a redirected or captured stderr gets it)."""
        stream = sys.stderr if stream is None else stream
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self.total_steps = total_steps
        self.first_step = first_step
        self.per_update = minibatches_per_update
        self.samples_per_step = samples_per_step
        self.stream = stream
        self.start = time.perf_counter()
        self.start_cpu = time.thread_time()
        self.step_times: list[float] = []
        self.step_cpu: list[float] = []
        """The CPU time of the thread that issues the updates, at each update (``thread_time``)."""
        self.losses: list[float] = []
        self._bar: Any = None
        self._every = max(1, (total_steps - first_step) // minibatches_per_update // 10)
        if progress and stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=first_step,
                unit="step",
                file=stream,
                dynamic_ncols=True,
            )

    def log(
        self,
        step: int,
        loss: float,
        extra: dict[str, Any] | None = None,
        *,
        at: float | None = None,
        cpu_at: float | None = None,
    ) -> None:
        """One update's line; ``at``: when the update was issued (``time.perf_counter()``;
        default: now), ``cpu_at``: the issuing thread's CPU time then (``time.thread_time()``;
        default: now, on the calling thread)."""
        now = time.perf_counter() if at is None else at
        cpu = time.thread_time() if cpu_at is None else cpu_at
        self.step_times.append(now)
        self.step_cpu.append(cpu)
        self.losses.append(loss)
        elapsed = now - self.start
        rate = len(self.step_times) * self.samples_per_step / max(elapsed, 1e-9)
        record = {
            "step": step,
            "loss": loss,
            "time_s": round(elapsed, 4),
            "cpu_s": round(cpu - self.start_cpu, 4),
            "samples_per_s": round(rate, 2),
            **(extra or {}),
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}")
            self._bar.update(self.per_update)
        elif len(self.losses) % self._every == 0 or self._trained >= self.total_steps:
            recent = self.losses[-self._every :]
            since = (
                self.step_times[-len(recent) - 1]
                if len(self.step_times) > len(recent)
                else (self.start)
            )
            rate = len(recent) * self.samples_per_step / max(now - since, 1e-9)
            print(
                f"step {self._trained:>6}/{self.total_steps}  "
                f"loss {sum(recent) / len(recent):.4f} (mean of last {len(recent)})  "
                f"{rate:,.0f} samples/s",
                file=self.stream,
                flush=True,
            )

    def say(self, line: str) -> None:
        """Print ``line`` where the progress goes, above the bar if there is one."""
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    @property
    def _trained(self) -> int:
        """Minibatches trained by the latest logged update."""
        return self.first_step + len(self.losses) * self.per_update

    def time_per_step_ms(self) -> float | None:
        """Steady-state time per minibatch: the median gap between updates in the second half,
        over the minibatches an update applies (the last stage's replicas: with 2, the gap
        between its updates is the time of 2 minibatches)."""
        gap = _steady_gap_ms(self.step_times)
        return None if gap is None else gap / self.per_update

    def host_cpu_per_step_ms(self) -> float | None:
        """Steady-state CPU time of the issuing thread per minibatch (the median gap between
        updates in the second half, over the minibatches an update applies). On a GPU, where
        the host only queues work, it nearing :meth:`time_per_step_ms` says the host's
        launches set the pace, not the GPU."""
        gap = _steady_gap_ms(self.step_cpu)
        return None if gap is None else gap / self.per_update

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._file.close()


def _steady_gap_ms(values: list[float]) -> float | None:
    """The median gap between consecutive values of the second half, in milliseconds."""
    later = values[len(values) // 2 :]
    gaps = [b - a for a, b in zip(later, later[1:])]
    return statistics.median(gaps) * 1000 if gaps else None
