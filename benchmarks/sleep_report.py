"""The ``sleep`` section of ``benchmarks/RESULTS.md``: tables, targets met or missed, diagnosis.

Kept apart from ``sleep_pipeline.py`` (which runs things) so that the report can be re-rendered
and read on its own. Every number comes from the run's traces: efficiency = ideal / measured,
and the critical path (``pipedream trace --plan``, :mod:`pipedream.optimizer.critical_path`)
puts every millisecond of the measured time per minibatch in the ideal compute, the actions'
overrun beyond their sleep, the messages or the executor's work between actions.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import WARM_MESSAGES, machine_lines, write_section

__all__ = ["PATH_PARTS", "TARGETS", "path_cells", "render"]

TARGETS = {"small": 0.97, "large": 0.90}
"""The efficiency targets per activation size."""
_LABEL = {"small": "32 KiB", "large": "32 MiB"}


def _size_label(size: int) -> str:
    return f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 2**10} KiB"


PATH_PARTS = {
    "overrun": ("compute overrun",),
    "messages": ("send", "receive", "delivery"),
    "executor": ("posting receives", "reclaiming sends", "between actions", "update"),
}
"""The critical path's categories, in the table's three columns beside the ideal compute."""


def path_cells(result: dict[str, Any], ideal_ms: float | None = None) -> str:
    """Milliseconds per minibatch of the critical path beyond the ideal compute, in three
    parts (four with ``ideal_ms``: first the path's compute beyond it), and the number of
    messages the path waited for."""
    accounting = result.get("accounting")
    if accounting is None:
        return " | ".join(["-"] * (5 if ideal_ms is not None else 4))
    parts = [sum(accounting.categories[c] for c in names) for names in PATH_PARTS.values()]
    if ideal_ms is not None:
        parts.insert(0, accounting.categories["compute"] - ideal_ms)
    return " | ".join(f"{round(ms, 1) + 0.0:.1f}" for ms in parts) + f" | {accounting.hops:.0f}"


def _copy_bound_ms(case: Any, message_ms: dict[int, float]) -> float:
    """max(ideal, m (S - 1) T): the 2 m (S - 1) messages of a minibatch each keep about one of
    the 2 cores busy for the one-way time T of a message (loopback TCP copies, page faults)."""
    from sleep_pipeline import SIZES

    one_way = message_ms.get(SIZES[case.size], 0.0)
    cores = os.cpu_count() or 1
    return max(case.ideal_ms, 2 * case.microbatches * (case.stages - 1) * one_way / cores)


def _verdict(efficiency: float, target: float, torch_eff: float | None) -> str:
    parts = ["met" if efficiency >= target else f"**missed by {target - efficiency:.2f}**"]
    if torch_eff is not None:
        gap = efficiency - torch_eff
        parts.append(">= torch" if gap >= 0 else f"**{-gap:.2f} below torch**")
    return ", ".join(parts)


def _table(
    rows: Sequence[dict[str, Any]], torch_ms: dict[str, float], size: str, **kw: Any
) -> list[str]:
    lines = [
        "| S | schedule | m | ideal ms | ours ms | ours eff. | torch ms | torch eff. "
        "| copy bound ms | ours / bound | path: waited compute ms | overrun ms | messages ms "
        f"| executor ms | hops | target (>= {TARGETS[size]:.2f}; >= torch) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in rows:
        case = result["case"]
        if "period_ms" not in result:
            lines.append(
                f"| {case.stages} | {case.schedule} | {case.microbatches} | {case.ideal_ms:.0f} "
                f"| failed: {' '.join(result['error'])[:60]} |" + " |" * 10 + " **not measured** |"
            )
            continue
        eff = case.ideal_ms / result["period_ms"]
        theirs = torch_ms.get(case.name)
        torch_eff = case.ideal_ms / theirs if theirs else None
        torch_cells = f"{theirs:.0f} | {torch_eff:.3f}" if theirs else "- | -"
        bound = _copy_bound_ms(case, kw["message_ms"])
        lines.append(
            f"| {case.stages} | {case.schedule} | {case.microbatches} | {case.ideal_ms:.0f} "
            f"| {result['period_ms']:.0f} | {eff:.3f} | {torch_cells} "
            f"| {bound:.0f} | {bound / result['period_ms']:.3f} "
            f"| {path_cells(result, case.ideal_ms)} "
            f"| {_verdict(eff, TARGETS[size], torch_eff)} |"
        )
    return lines


def _summary(ours: Sequence[dict[str, Any]], torch_ms: dict[str, float]) -> list[str]:
    lines = []
    for size, target in TARGETS.items():
        measured = [r for r in ours if r["case"].size == size and "period_ms" in r]
        if not measured:
            continue
        effs = [r["case"].ideal_ms / r["period_ms"] for r in measured]
        met = sum(e >= target for e in effs)
        pairs = [
            (r["case"].ideal_ms / r["period_ms"], r["case"].ideal_ms / torch_ms[r["case"].name])
            for r in measured
            if r["case"].name in torch_ms
        ]
        beat = sum(a >= b for a, b in pairs)
        lines.append(
            f"- {_LABEL[size]} activations: efficiency >= {target} in {met} of {len(effs)} cases "
            f"(range {min(effs):.3f} .. {max(effs):.3f}); >= torch.distributed.pipelining in "
            f"{beat} of {len(pairs)} comparable cases."
        )
    return lines


def render(
    ours: Sequence[dict[str, Any]],
    torch_ms: dict[str, float],
    message_ms: dict[int, float],
    commands: Sequence[str],
    timelines: Sequence[tuple[str, Path]],
    *,
    f_ms: float,
    b_ms: float,
) -> None:
    """Write the ``sleep`` section of the results file."""
    lines = [
        "## Sleep workload: efficiency against the ideal and torch.distributed.pipelining",
        "",
        *machine_lines(),
        "- regenerate: `python benchmarks/sleep_pipeline.py` (all commands it ran are listed "
        "below)",
        "",
        f"One sleep layer per stage: F = {f_ms:g} ms forward, B = {b_ms:g} ms backward per "
        "microbatch, microbatches of 8 samples, one process per stage on "
        f"{os.cpu_count()} cores (gloo on 127.0.0.1, one thread each). Measured = mean time "
        "between the last stage's optimizer updates after the warm-up, from the `--trace` "
        "timelines. Ideal = (m + S - 1)(F + B) per minibatch for 1f1b and gpipe (and for "
        "torch's ScheduleGPipe and Schedule1F1B), m(F + B) for the asynchronous schedules "
        "(pipedream and pipedream-vs run one microbatch per minibatch). Efficiency = ideal / "
        "measured. Copy bound = max(ideal, 2 m (S - 1) T / cores), T the one-way time of one "
        "message (below): a rough floor set by copying a minibatch's 2 m (S - 1) messages "
        "through loopback TCP on this machine's cores (it matters for 32 MiB only). "
        "Path: where the measured time per minibatch went beyond the ideal compute, along "
        "the run's critical path (`pipedream trace RUN_DIR --plan PLAN`): more sleeps on the "
        "path than the ideal schedule's (waited compute: a rank waited for another that ran "
        "late, as asynchronous pipelines do when their stages' paces wobble), the forwards' "
        "and backwards' time beyond their sleep (overrun: the actions' own work), the messages "
        "(posting sends, taking messages, and the delivery of those the path waited for; hops: "
        "how many it waited for), and the executor between actions (posting receives, "
        "reclaiming sends, bookkeeping, the updates); ideal + waited compute + overrun + "
        "messages + executor = ours. A sleep ends at its deadline (the kernel's lateness is "
        "waited out on the clock).",
        "",
    ]
    if message_ms:
        cells = ", ".join(
            f"{_size_label(size)}: {ms:.2f} ms" for size, ms in sorted(message_ms.items())
        )
        large = max(message_ms)
        lines += [
            f"One gloo message between two processes of this machine, one way ({cells}; on a "
            f"link warmed up by {WARM_MESSAGES} of them); a 32 MiB activation costs "
            f"{message_ms[large] / f_ms:.2f} forwards, and both processes' CPU while it is "
            "copied.",
            "",
        ]
    for size in TARGETS:
        rows = [r for r in ours if r["case"].size == size]
        if rows:
            lines += [f"### {_LABEL[size]} activations", ""]
            lines += _table(rows, torch_ms, size, f_ms=f_ms, b_ms=b_ms, message_ms=message_ms)
            lines += [""]
    lines += ["### Targets", "", *_summary(ours, torch_ms), ""]
    for name, path in timelines:
        lines += [f"Timeline of {name} (two minibatches): ![{name}]({path})", ""]
    lines += ["<details><summary>Commands run</summary>", "", "```"]
    lines += [*commands, "```", "", "</details>"]
    write_section("sleep", "\n".join(lines))
