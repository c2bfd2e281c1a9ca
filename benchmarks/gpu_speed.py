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
it). No assertions: speed is measured, not tested.

A bf16 step of this model is bound by the host's kernel launches, so its time depends on where
the host threads run: unpinned on a 16-core host the same loop took anywhere from 24 to 39 ms
per step from one process to the next. Both sides therefore run on the same ``--cpus`` cores
(default: one), this process pinned to them and the torchrun processes inheriting it, with one
intra-op thread each. The two sides take any device, so the test suite runs this comparison on
the CPU with a small model (``tests/unit/test_gpu_speed.py``) and a GPU session finds it working.

    python benchmarks/gpu_speed.py [--steps 40] [--warmup 10] [--cpus 1] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
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
        raise SystemExit(f"pipedream train failed:\n{result.output[-3000:]}")
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


def compare(
    precision: str, *, device: str, args: dict[str, str], warmup: int, steps: int, folder: Path
) -> tuple[str, dict[str, list[float]]]:
    """The table row of one precision (plain loop, then one stage) and both loss curves."""
    plain = plain_loop(precision, device=device, args=args, warmup=warmup, steps=steps)
    stage, busy = one_stage(
        precision, device=device, args=args, warmup=warmup, steps=steps, folder=folder
    )
    gap = max(abs(a - b) / abs(b) for a, b in zip(stage.losses, plain.losses, strict=True))
    row = (
        f"| {precision} | {plain.ms_per_step:.2f} | {stage.ms_per_step:.2f} "
        f"| {stage.ms_per_step / plain.ms_per_step:.3f} | {plain.host_cpu_ms_per_step:.2f} "
        f"| {stage.host_cpu_ms_per_step:.2f} | {plain.losses[-1]:.3f} | {stage.losses[-1]:.3f} "
        f"| {gap:.1e} | {busy:.0%} |"
    )
    return row, {"plain": plain.losses, "stage": stage.losses}


HEADER = (
    "| precision | plain loop ms/step | one stage ms/step | stage / plain "
    "| plain host CPU ms/step | stage host CPU ms/step "
    "| plain loss | stage loss | largest loss gap | stage busy |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cpus", type=int, default=1, help="cores both sides run on")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_speed.py: no CUDA GPU here")
    cpus = pin_to(args.cpus)
    rows: list[str] = []
    curves: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for precision in ("fp32", "bf16"):
            row, curves[precision] = compare(
                precision,
                device="cuda",
                args=ARGS,
                warmup=args.warmup,
                steps=args.steps,
                folder=Path(folder),
            )
            rows.append(row)
    table = "\n".join(
        [
            f"gpt 12x768, seq 256, vocab 256, microbatch {MICROBATCH}, Adam; {args.warmup} "
            f"warm-up + {args.steps} timed steps on {torch.cuda.get_device_name()} "
            f"(torch {torch.__version__}); both sides on cores {cpus}, one torch thread each",
            "",
            HEADER,
            *rows,
            "",
            "Host CPU is the median CPU time per step of the thread that issues the steps (on "
            "a GPU, near the time per step the host's launches set the pace; the backward's "
            "launches run on autograd's own thread, on neither side counted). Losses are each "
            "side's after the last step; the largest loss gap is the largest relative "
            "difference of the two sides' losses at the same step, over all steps.",
        ]
    )
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(curves, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
