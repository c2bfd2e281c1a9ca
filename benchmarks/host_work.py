"""The host's work per step of one runtime stage against a plain PyTorch loop, in instructions.

A bf16 step of a GPT-2-sized model on a GPU is bound by the host: the GPU waits for the kernels
the host queues, so every microsecond of Python and dispatch a stage adds to a plain loop's shows
in its time per step. On a shared CPU host wall-clock time cannot resolve a 1% difference, but
instruction counts can: this script runs both sides under ``valgrind --tool=callgrind`` (which
counts every instruction every thread executes) for ``W + N`` and ``W + 3N`` steps and takes the
difference, so start-up, the warm-up and the end of the run (checkpoint, evaluation) cancel.
The counts repeat to a few tenths of a percent of a step between runs (the stage's gloo
threads, the memory allocator), where wall-clock time on a shared host varies by 10%.

Both sides train the built-in ``gpt`` workload (narrow, so the host's work is a large part of a
CPU step) with its Adam on the same microbatches, on the CPU in fp32: the plain loop as a
careful user writes it, the runtime as ``pipedream train`` of a one-stage plan, one rank on gloo
(started directly, with the variables torchrun would set). Printed as a table: instructions per
step on each side and the stage's excess. No assertions: speed is measured, not tested.

``--dim 8 --seq 4`` leaves next to no compute in a step: then nearly all of it is the host's
work (Python, the dispatcher, the optimizer's bookkeeping), as in a launch-bound GPU step, and
the ratio is the stage's host work against the plain loop's. On a GPU each operator also costs
a kernel launch, the same on both sides (a lone stage runs the plain loop's operators), so
there the ratio is lower still.

Needs valgrind (Debian: ``apt-get install valgrind``); about 10 minutes on 2 cores with the
defaults (callgrind runs a program about 50 times slower).

    python benchmarks/host_work.py [--layers 12] [--dim 32] [--seq 16] [--steps 10] [--warmup 10]
                                   [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common import REPO, plan_dict, write_plan

MICROBATCH = 16
COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


@dataclass(frozen=True)
class Model:
    """The ``gpt`` both sides train: ``layers`` blocks of width ``dim`` on sequences of ``seq``."""

    layers: int = 12
    dim: int = 32
    seq: int = 16

    def workload_args(self) -> dict[str, str]:
        return {
            "layers": str(self.layers),
            "dim": str(self.dim),
            "heads": str(max(1, self.dim // 8)),
            "seq": str(self.seq),
            "vocab": "64",
            "samples": "256",
            "lr": "1e-3",
        }

    def argv(self) -> list[str]:
        return [str(self.layers), str(self.dim), str(self.seq)]

    def __str__(self) -> str:
        return f"gpt {self.layers}x{self.dim}, seq {self.seq}, vocab 64"


def plain_loop(model: Model, steps: int) -> None:
    """``steps`` steps of the plain loop (run under callgrind by :func:`count`)."""
    import torch

    from pipedream.data import MicrobatchStream
    from pipedream.workload import load_workload

    torch.manual_seed(0)
    workload = load_workload("gpt", model.workload_args(), microbatch_size=MICROBATCH)
    module = workload.model
    optimizer = workload.optimizer(module.parameters())
    data = MicrobatchStream(workload.dataset, MICROBATCH, 0)
    for step in range(steps):
        inputs, targets = data.microbatch(step)
        loss = workload.loss_fn(module(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def stage_command(model: Model, steps: int, folder: Path) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``pipedream train`` on a one-stage plan, one rank."""
    plan = plan_dict(
        "gpt",
        model.workload_args(),
        [("embed", "head")],
        schedule="pipedream",
        microbatch_size=MICROBATCH,
        microbatches=1,
    )
    path = write_plan(plan, folder / "plan.yaml")
    with socket.socket() as probe:  # a free loopback port for the one-rank rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    command = ["-m", "pipedream.cli", "train", str(path), "--steps", str(steps)]
    command += ["--run-dir", str(folder / "run"), "--device", "cpu", "--no-progress"]
    return command, env


def count(side: str, model: Model, steps: int) -> int:
    """Instructions callgrind counts over a whole run of ``side`` for ``steps`` steps."""
    with tempfile.TemporaryDirectory(prefix="host-work-") as tmp:
        folder = Path(tmp)
        if side == "plain":
            args = [__file__, "--child-plain", *model.argv(), str(steps)]
            extra: dict[str, str] = {}
        else:
            args, extra = stage_command(model, steps, folder)
        # one thread, and the same string hashes in every run (dict and set layouts)
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
        env.update(extra)
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={folder / 'cg.out'}"]
        result = subprocess.run(
            [*command, sys.executable, *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
    found = COLLECTED.findall(result.stderr)
    if result.returncode != 0 or not found:
        raise SystemExit(f"{side} ({steps} steps) failed under callgrind:\n{result.stderr[-3000:]}")
    return int(found[-1])


def per_step(short: int, long: int, extra_steps: int) -> float:
    """Instructions per step from two runs ``extra_steps`` steps apart.

    >>> per_step(1_000_000, 1_500_000, 20)
    25000.0
    """
    return (long - short) / extra_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks of the gpt")
    parser.add_argument("--dim", type=int, default=32, help="its width (8: next to no compute)")
    parser.add_argument("--seq", type=int, default=16, help="its sequence length")
    parser.add_argument("--steps", type=int, default=10, help="N: runs of W + N and W + 3N")
    parser.add_argument("--warmup", type=int, default=10, help="W")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("host_work.py needs valgrind on PATH (Debian: apt-get install valgrind)")
        return 2
    short, long = args.warmup + args.steps, args.warmup + 3 * args.steps
    runs = [(side, steps) for side in ("plain", "stage") for steps in (short, long)]
    with ThreadPoolExecutor(max_workers=2) as pool:  # one callgrind per core of a 2-core host
        model = Model(args.layers, args.dim, args.seq)
        counted = dict(zip(runs, pool.map(lambda run: count(run[0], model, run[1]), runs)))
    plain = per_step(counted["plain", short], counted["plain", long], long - short)
    stage = per_step(counted["stage", short], counted["stage", long], long - short)
    lines = [
        f"{model}, microbatch {MICROBATCH}, Adam, fp32 on the CPU;"
        f" instructions per step from runs of {short} and {long} steps under callgrind",
        "",
        "| | instructions per step | stage / plain |",
        "| --- | --- | --- |",
        f"| plain loop | {plain:,.0f} | 1.000 |",
        f"| one stage (pipedream train) | {stage:,.0f} | {stage / plain:.4f} |",
        "",
        f"The stage's excess: {stage - plain:,.0f} instructions per step.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child-plain":
        layers, dim, seq, steps = (int(a) for a in sys.argv[2:])
        plain_loop(Model(layers, dim, seq), steps)
    else:
        raise SystemExit(main())
