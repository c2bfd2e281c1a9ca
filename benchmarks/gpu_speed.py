"""One stage of the runtime against a plain PyTorch loop on the same GPU, fp32 and bf16.

Both train the built-in ``gpt`` workload at GPT-2-small width (12 layers of 768, 12 heads,
sequences of 256 tokens, a vocabulary of 256) with its Adam, on the same microbatches of 16
samples: the plain loop in this process, written as a careful user writes it (inputs copied
through pinned memory without waiting, bf16 by ``torch.autocast``), the runtime as one
``torchrun`` process (``pipedream train --device cuda``). Each side runs ``--warmup`` steps, then
``--steps`` timed ones: the plain loop from a synchronised start to a synchronised end, the
runtime between the issue times of its updates in ``metrics.jsonl`` (a step is issued once the
GPU has room for it, so in the steady state their spacing is the GPU's pace). Printed as a
table with the ratio of the two, the CPU time per step of the thread that issues the steps on
each side (whether a gap is the runtime's own host work), each side's loss after the last step
and how far apart their losses were at any step (the curves go to ``--out``'s ``.json`` beside
it). Each precision is compared ``--rounds`` times (default 2), the plain loop first in odd
rounds and last in even ones, so that every ratio is measured twice against its peer in one
run. A comparison that fails (a launch that does not finish, an out-of-memory error) is named
under the table and the others still run; the exit status is then 1. No assertions: speed is
measured, not tested.

A bf16 step of this model is bound by the host's kernel launches, so its time depends on where
the host threads run: unpinned on a 16-core host the same loop took anywhere from 24 to 39 ms
per step from one process to the next. Both sides therefore run on the same ``--cpus`` cores
(default: one), this process pinned to them and the torchrun processes inheriting it, with one
intra-op thread each. The two sides take any device, so the test suite runs this comparison on
the CPU with a small model (``tests/unit/test_gpu_speed.py``) and a GPU session finds it working.

    python benchmarks/gpu_speed.py [--steps 40] [--warmup 10] [--cpus 1] [--rounds 2]
                                   [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import plan_dict, run_command, write_plan  # noqa: E402

from pipedream.data import MicrobatchStream  # noqa: E402
from pipedream.model_io import to_device  # noqa: E402
from pipedream.workload import load_workload  # noqa: E402

ARGS = {
    "layers": "12",
    "dim": "768",
    "heads": "12",
    "seq": "256",
    "vocab": "256",
    "samples": "1024",
    "lr": "1e-3",  # fixed here, so that the recorded losses stay comparable
}
MICROBATCH = 16


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Side:
    """What one side measured over its timed steps."""

    ms_per_step: float
    host_cpu_ms_per_step: float
    """The median CPU time per step of the thread that issues the steps (``thread_time``)."""
    losses: list[float]
    """Every step's loss, the warm-up's included."""


def _median_gap_ms(values: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(values, values[1:])) * 1000


def plain_loop(
    precision: str, *, device: str, args: dict[str, str], warmup: int, steps: int
) -> Side:
    """The plain loop of the ``gpt`` workload with ``args`` on ``device``."""
    torch.manual_seed(0)
    workload = load_workload("gpt", args, microbatch_size=MICROBATCH)
    where = torch.device(device)
    model = workload.model.to(where)
    optimizer = workload.optimizer(model.parameters())
    data = MicrobatchStream(workload.dataset, MICROBATCH, 0)
    losses = []
    cpu = []  # the thread's CPU time after issuing each timed step, and before the first
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _synchronize(where)
            start = time.perf_counter()
            cpu.append(time.thread_time())
        inputs, targets = (to_device(t, where) for t in data.microbatch(step))
        with torch.autocast(where.type, torch.bfloat16, enabled=precision == "bf16"):
            output = model(inputs)
        loss = workload.loss_fn(output.float(), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if step >= warmup:
            cpu.append(time.thread_time())
    _synchronize(where)
    ms = (time.perf_counter() - start) * 1000 / steps
    return Side(ms, _median_gap_ms(cpu), [float(x) for x in losses])


class LaunchFailed(RuntimeError):
    """The runtime's side of a comparison did not finish; says why, with its output."""


def one_stage(
    precision: str, *, device: str, args: dict[str, str], warmup: int, steps: int, folder: Path
) -> tuple[Side, float]:
    """The runtime training the same model as one stage, launched by torchrun on ``device``,
    and the stage's busy fraction."""
    plan = plan_dict(
        "gpt",
        args,
        [("embed", "head")],
        schedule="pipedream",
        microbatch_size=MICROBATCH,
        microbatches=1,
    )
    path = write_plan(plan, folder / f"plan-{precision}.yaml")
    run = folder / f"run-{precision}"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        "pipedream.cli",
        "train",
        str(path),
        *("--steps", str(warmup + steps), "--run-dir", str(run)),
        *("--device", device, "--precision", precision, "--no-progress"),
    ]
    result = run_command(command, timeout=300, env={"PYTHONPATH": str(REPO)})
    if result.returncode != 0:
        raise LaunchFailed(f"pipedream train failed:\n{result.output[-3000:]}")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = lines[warmup - 1 :]  # from the last warm-up update's issue to the last one's
    ms = (timed[-1]["time_s"] - timed[0]["time_s"]) * 1000 / steps
    side = Side(ms, _median_gap_ms([line["cpu_s"] for line in timed]), [x["loss"] for x in lines])
    summary = json.loads((run / "summary.json").read_text())
    return side, summary["ranks"][0]["busy_fraction"]


def pin_to(count: int) -> str:
    """Pin this process (and what it starts) to the first ``count`` cores it may use, with one
    intra-op thread as the runtime's side has (``OMP_NUM_THREADS=1``)."""
    available = sorted(os.sched_getaffinity(0))
    if not 1 <= count <= len(available):
        raise SystemExit(f"gpu_speed.py: --cpus {count}: this process may use {len(available)}")
    chosen = available[:count]
    os.sched_setaffinity(0, chosen)
    torch.set_num_threads(1)
    return ",".join(map(str, chosen))


@dataclass(frozen=True)
class Comparison:
    """One round of one precision: its table row, the ratio, and both sides' loss curves."""

    row: str
    ratio: float
    """The stage's time per step over the plain loop's."""
    curves: dict[str, list[float]]


def compare(
    precision: str,
    *,
    device: str,
    args: dict[str, str],
    warmup: int,
    steps: int,
    folder: Path,
    round_: int = 1,
) -> Comparison:
    """Round ``round_`` of one precision: the plain loop and one stage, the plain loop first
    in odd rounds and second in even ones (so that a drift of the machine over the run, its
    clocks warming or a neighbour's load, does not always favour the same side)."""
    run_dir = folder / f"round-{round_}"
    run_dir.mkdir(parents=True, exist_ok=True)

    def run_plain() -> Side:
        return plain_loop(precision, device=device, args=args, warmup=warmup, steps=steps)

    def run_stage() -> tuple[Side, float]:
        return one_stage(
            precision, device=device, args=args, warmup=warmup, steps=steps, folder=run_dir
        )

    if round_ % 2:
        plain = run_plain()
        stage, busy = run_stage()
    else:
        stage, busy = run_stage()
        plain = run_plain()
    gap = max(abs(a - b) / abs(b) for a, b in zip(stage.losses, plain.losses, strict=True))
    ratio = stage.ms_per_step / plain.ms_per_step
    row = (
        f"| {precision} | {round_} | {plain.ms_per_step:.2f} | {stage.ms_per_step:.2f} "
        f"| {ratio:.3f} | {plain.host_cpu_ms_per_step:.2f} "
        f"| {stage.host_cpu_ms_per_step:.2f} | {plain.losses[-1]:.3f} | {stage.losses[-1]:.3f} "
        f"| {gap:.1e} | {busy:.0%} |"
    )
    return Comparison(row, ratio, {"plain": plain.losses, "stage": stage.losses})


HEADER = (
    "| precision | round | plain loop ms/step | one stage ms/step | stage / plain "
    "| plain host CPU ms/step | stage host CPU ms/step "
    "| plain loss | stage loss | largest loss gap | stage busy |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def report(
    title: str, comparisons: dict[str, list[Comparison]], failures: Sequence[str] = ()
) -> str:
    """The printed table: ``title``, a row per precision and round, what the columns mean,
    each precision's ratios round by round, and the comparisons that failed."""
    rows = [c.row for done in comparisons.values() for c in done]
    ratios = "; ".join(
        f"{precision} " + ", ".join(f"{c.ratio:.3f}" for c in done)
        for precision, done in comparisons.items()
        if done
    )
    return "\n".join(
        [
            title,
            "",
            HEADER,
            *rows,
            "",
            "Host CPU is the median CPU time per step of the thread that issues the steps (on "
            "a GPU, near the time per step the host's launches set the pace; the backward's "
            "launches run on autograd's own thread, on neither side counted). Losses are each "
            "side's after the last step; the largest loss gap is the largest relative "
            "difference of the two sides' losses at the same step, over all steps. Each "
            "round runs both sides again, the plain loop first in odd rounds and last in even "
            "ones.",
            "",
            f"stage / plain by round: {ratios}",
            *(f"FAILED: {failure}" for failure in failures),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cpus", type=int, default=1, help="cores both sides run on")
    parser.add_argument(
        "--rounds", type=int, default=2, help="times each precision is compared (default 2)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"gpu_speed.py: --rounds {args.rounds}: give 1 or more")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_speed.py: no CUDA GPU here")
    cpus = pin_to(args.cpus)
    comparisons: dict[str, list[Comparison]] = {"fp32": [], "bf16": []}
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(1, args.rounds + 1):
            for precision, done in comparisons.items():
                try:
                    comparison = compare(
                        precision,
                        device="cuda",
                        args=ARGS,
                        warmup=args.warmup,
                        steps=args.steps,
                        folder=Path(folder),
                        round_=round_,
                    )
                except Exception as error:  # a GPU session runs this once: keep the rest
                    print(f"{precision} round {round_}: {error}", file=sys.stderr)
                    first = next(iter(str(error).splitlines()), "")
                    failures.append(f"{precision} round {round_}: {type(error).__name__}: {first}")
                    continue
                done.append(comparison)
    title = (
        f"gpt 12x768, seq 256, vocab 256, microbatch {MICROBATCH}, Adam; {args.warmup} "
        f"warm-up + {args.steps} timed steps on {torch.cuda.get_device_name()} "
        f"(torch {torch.__version__}); both sides on cores {cpus}, one torch thread each"
    )
    table = report(title, comparisons, failures)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
        curves = {p: [c.curves for c in done] for p, done in comparisons.items()}
        args.out.with_suffix(".json").write_text(json.dumps(curves, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
