"""Sleep workload: zb-h1 against its formula, 1f1b and torch.distributed.pipelining.

    python benchmarks/zero_bubble.py [--stages 4,8] [--microbatches 8,16]

One sleep layer per stage with F = I = W = 20 ms per microbatch (``backward_ms=40``,
``weight_ms=20``), 32 KiB activations, S = 4 and 8 stages, m = 8 and 16 microbatches. Each case
runs through ``./launch.sh PLAN --trace`` (``sleep_pipeline.run_ours``); its time per minibatch
is the mean gap between the last stage's updates after the first minibatch. Three references:

* the paper's formula for ZB-H1, ``3 m F + (S - 1)(F + I - W)``: ``(3 m + S - 1) 20 ms``;
* the schedule's own unit-time length (its tables run with F = I = W = 1 and free messages:
  ``pipedream.schedules.list_schedule``), the ideal of the tables actually run;
* 1F1B's ``(m + S - 1)(F + B)`` and its measured run, and PyTorch's ScheduleInterleavedZeroBubble
  (one stage per rank: ZB1P) and Schedule1F1B on the same model (``torch_pipelining.py``).

Refreshes the ``zero-bubble`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from common import machine_lines, write_section
from sleep_pipeline import MICROBATCH_SIZE, SIZES, Case, run_ours, run_torch

from pipedream.schedules import Op, PipelineSpec, build_tables
from pipedream.schedules.unit_time import unit_time_makespan

__all__ = ["ZeroBubbleCase", "main", "unit_time_ms"]

F_MS = 20.0
"""Forward, input-gradient and weight-gradient time per stage and microbatch (ms)."""


def unit_time_ms(schedule: str, stages: int, microbatches: int) -> float:
    """One minibatch of the schedule's tables with F = I = W = ``F_MS`` (B = 2 F) and free
    messages: the ideal of what the tables ask for."""
    spec = PipelineSpec(schedule, tuple((s,) for s in range(stages)), microbatches, 1)
    cost = {Op.FORWARD: 1, Op.BACKWARD: 2, Op.BACKWARD_INPUT: 1, Op.BACKWARD_WEIGHT: 1}
    return unit_time_makespan(build_tables(spec), cost.__getitem__) * F_MS


@dataclass(frozen=True)
class ZeroBubbleCase(Case):
    """A sleep case with the backward split evenly between I and W."""

    @property
    def ideal_ms(self) -> float:
        m, s = self.microbatches, self.stages
        if self.schedule == "zb-h1":  # the paper's (S - 1)(F + I - W) bubble
            return (3 * m + s - 1) * F_MS
        return (m + s - 1) * 3 * F_MS

    def workload_args(self) -> dict[str, Any]:
        return {
            "layers": self.stages,
            "forward_ms": F_MS,
            "backward_ms": 2 * F_MS,
            "weight_ms": F_MS,
            "activation_bytes": SIZES[self.size],
        }

    @property
    def name(self) -> str:
        return f"zb-{super().name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="4,8")
    parser.add_argument("--microbatches", default="8,16")
    args = parser.parse_args(argv)
    depths = [int(s) for s in args.stages.split(",")]
    counts = [int(m) for m in args.microbatches.split(",")]
    rows, commands = [], []
    for stages in depths:
        group = [
            ZeroBubbleCase("small", stages, schedule, m)
            for m in counts
            for schedule in ("zb-h1", "1f1b")
        ]
        ours = {case.name: run_ours(case) for case in group}
        torch_ms, torch_command = run_torch(stages, group)
        commands += [line for result in ours.values() for line in result["commands"]]
        commands.append(torch_command.shell())
        for case in group:
            result = ours[case.name]
            if "period_ms" not in result:
                rows.append(f"| {case.name} | failed: {result.get('error')} | | | | |")
                continue
            period, theirs = result["period_ms"], torch_ms.get(case.name)
            tables = unit_time_ms(case.schedule, stages, case.microbatches)
            versus = f"{theirs:.0f} ({theirs / period:.3f})" if theirs else "failed"
            rows.append(
                f"| S={stages} m={case.microbatches} {case.schedule} | {period:.0f} | "
                f"{case.ideal_ms:.0f} ({case.ideal_ms / period:.3f}) | "
                f"{tables:.0f} ({tables / period:.3f}) | {versus} |"
            )
    body = "\n".join(
        [
            "## Zero bubble on the sleep workload (benchmarks/zero_bubble.py)",
            "",
            *machine_lines(),
            "",
            f"One sleep layer per stage, F = I = W = {F_MS:g} ms per microbatch (B = I + W), "
            f"{SIZES['small'] // 1024} KiB activations, microbatches of {MICROBATCH_SIZE}. "
            "Milliseconds per minibatch; in brackets the reference over ours (1.000: as fast "
            "as the reference, above 1: faster than it).",
            "",
            "| case | ours | formula | the tables in unit time | torch.distributed.pipelining |",
            "| --- | --- | --- | --- | --- |",
            *rows,
            "",
            "Formula: zb-h1 (3m + S - 1) F, the paper's (S - 1)(F + I - W) bubble; 1f1b "
            "(m + S - 1)(F + B). PyTorch: ScheduleInterleavedZeroBubble with one stage per rank "
            "for zb-h1, Schedule1F1B for 1f1b.",
            "",
            "Commands run:",
            "",
            *(f"    {line}" for line in commands),
        ]
    )
    write_section("zero-bubble", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
