"""Sleep workload: today's schedules against their formulas, 1f1b and torch.distributed.pipelining.

    python benchmarks/zero_bubble.py [--ranks 4,8] [--microbatches 8,16]

Sleep layers with F = I = W = 20 ms per microbatch (``backward_ms=40``, ``weight_ms=20``), 32 KiB
activations, on P = 4 and 8 ranks, m = 8 and 16 microbatches: ``1f1b`` and ``zb-h1`` with one
layer per rank (S = P), ``interleaved-1f1b`` and ``zbv`` with two layers per rank (2P stages,
looped and in a V). Each case runs through ``./launch.sh PLAN --trace``
(``sleep_pipeline.run_ours``); its time per minibatch is the mean gap between the last stage's
updates after the first minibatch. The references:

* the formula: 1f1b ``(m + P - 1)(F + B)``; zb-h1 ``3 m F + (P - 1)(F + I - W)``; interleaved
  (two stages per rank) ``(2 m + P - 1)(F + B)``; zbv ``6 m F`` (no bubble);
* the tables' own unit-time length (``pipedream.schedules.unit_time``): the ideal of what the
  tables actually ask for;
* PyTorch's schedule of the same name on the same layers (``torch_pipelining.py``):
  Schedule1F1B, ScheduleInterleavedZeroBubble (one stage per rank: ZB1P),
  ScheduleInterleaved1F1B, ScheduleZBVZeroBubble.

Refreshes the ``zero-bubble`` section of ``benchmarks/RESULTS.md`` and draws the timelines of
the first rank count and microbatch count (``benchmarks/timelines/zb-*.png``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from common import REPO, machine_lines, write_section
from sleep_pipeline import MICROBATCH_SIZE, SIZES, Case, run_ours, run_torch, save_timeline
from sleep_report import path_cells

from pipedream.schedules import Op, PipelineSpec, build_tables
from pipedream.schedules.interleaved_1f1b import looped_placement
from pipedream.schedules.unit_time import unit_time_makespan
from pipedream.schedules.zero_bubble import v_placement

__all__ = ["ZeroBubbleCase", "main", "unit_time_ms"]

F_MS = 20.0
"""Forward, input-gradient and weight-gradient time per stage and microbatch (ms)."""


def unit_time_ms(case: ZeroBubbleCase) -> float:
    """One minibatch of the case's tables with F = I = W = ``F_MS`` (B = 2 F) and free
    messages: the ideal of what the tables ask for."""
    placement = case.placement() or list(range(case.stages))
    spec = PipelineSpec(case.schedule, tuple((r,) for r in placement), case.microbatches, 1)
    cost = {Op.FORWARD: 1, Op.BACKWARD: 2, Op.BACKWARD_INPUT: 1, Op.BACKWARD_WEIGHT: 1}
    return unit_time_makespan(build_tables(spec), cost.__getitem__) * F_MS


@dataclass(frozen=True)
class ZeroBubbleCase(Case):
    """A sleep case with the backward split evenly between I and W; ``stages`` counts the
    stages (two per rank under interleaved-1f1b and zbv)."""

    def placement(self) -> list[int] | None:
        ranks = self.stages // 2
        if self.schedule == "interleaved-1f1b":
            return looped_placement(self.stages, ranks)
        if self.schedule == "zbv":
            return v_placement(self.stages, ranks)
        return None

    @property
    def ideal_ms(self) -> float:
        m, p = self.microbatches, self.ranks
        if self.schedule == "zb-h1":  # the paper's (P - 1)(F + I - W) bubble
            return (3 * m + p - 1) * F_MS
        if self.schedule == "interleaved-1f1b":  # two stages per rank: (P - 1)(F + B) bubble
            return (2 * m + p - 1) * 3 * F_MS
        if self.schedule == "zbv":
            return 6 * m * F_MS
        return (m + p - 1) * 3 * F_MS

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
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--microbatches", default="8,16")
    args = parser.parse_args(argv)
    counts = [int(m) for m in args.microbatches.split(",")]
    rank_counts = [int(r) for r in args.ranks.split(",")]
    timelines = REPO / "benchmarks" / "timelines"
    for stale in timelines.glob("zb-*.png"):
        stale.unlink()
    rows, commands, drawn = [], [], []
    for ranks in rank_counts:
        groups = [
            [ZeroBubbleCase("small", ranks, s, m) for m in counts for s in ("1f1b", "zb-h1")],
            [
                ZeroBubbleCase("small", 2 * ranks, s, m)
                for m in counts
                for s in ("interleaved-1f1b", "zbv")
            ],
        ]
        for group in groups:
            ours = {case.name: run_ours(case) for case in group}
            torch_ms, torch_command = run_torch(group[0].stages, group)
            commands += [line for result in ours.values() for line in result["commands"]]
            commands.append(torch_command.shell())
            rows += [_row(case, ours[case.name], torch_ms.get(case.name)) for case in group]
            for case in group:  # the smallest shape of every schedule, drawn
                if ranks == rank_counts[0] and case.microbatches == counts[0]:
                    if "period_ms" in ours[case.name]:
                        path = timelines / f"{case.name}.png"
                        save_timeline(ours[case.name], path)
                        drawn.append(path.relative_to(REPO / "benchmarks"))
    body = "\n".join(
        [
            "## Today's schedules on the sleep workload (benchmarks/zero_bubble.py)",
            "",
            *machine_lines(),
            "",
            f"Sleep layers of F = I = W = {F_MS:g} ms per microbatch (B = I + W), "
            f"{SIZES['small'] // 1024} KiB activations, microbatches of {MICROBATCH_SIZE}; one "
            "layer per rank for 1f1b and zb-h1, two (looped, or a V) for interleaved-1f1b and "
            "zbv. Milliseconds per minibatch; in brackets the reference over ours (above 1: "
            "ours is faster, or the reference is ideal time ours does not reach).",
            "",
            "| case | ours | formula | the tables in unit time | torch.distributed.pipelining "
            "| path: compute ms | overrun ms | messages ms | executor ms | hops |",
            "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
            *rows,
            "",
            "Formulas: 1f1b (m + P - 1)(F + B); zb-h1 (3m + P - 1) F, the paper's (P - 1)"
            "(F + I - W) bubble; interleaved-1f1b (2m + P - 1)(F + B), its bubble halved; zbv "
            "6m F, no bubble. PyTorch: Schedule1F1B, ScheduleInterleavedZeroBubble with one "
            "stage per rank (ZB1P), ScheduleInterleaved1F1B, ScheduleZBVZeroBubble.",
            "",
            "Timelines (two steady minibatches): "
            + ", ".join(f"[{path.stem}]({path})" for path in drawn)
            + ".",
            "",
            "Commands run:",
            "",
            *(f"    {line}" for line in commands),
        ]
    )
    write_section("zero-bubble", body)
    print(body)
    return 0


def _row(case: ZeroBubbleCase, result: dict[str, Any], theirs: float | None) -> str:
    name = f"P={case.ranks} m={case.microbatches} {case.schedule}"
    if "period_ms" not in result:
        return f"| {name} | failed: {result.get('error')} | | | | | | | | |"
    period, tables = result["period_ms"], unit_time_ms(case)
    versus = f"{theirs:.0f} ({theirs / period:.3f})" if theirs else "failed"
    return (
        f"| {name} | {period:.0f} | {case.ideal_ms:.0f} ({case.ideal_ms / period:.3f}) | "
        f"{tables:.0f} ({tables / period:.3f}) | {versus} | {_path(result)} |"
    )


def _path(result: dict[str, Any]) -> str:
    """The critical path's compute, then the cells of ``sleep_report``'s path columns."""
    accounting = result.get("accounting")
    if accounting is None:
        return "- | - | - | - | -"
    return f"{accounting.categories['compute']:.0f} | {path_cells(result)}"


if __name__ == "__main__":
    sys.exit(main())
