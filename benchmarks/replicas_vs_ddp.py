"""One stage on 2 replicas against ``torch.nn.parallel.DistributedDataParallel``, same model.

    python benchmarks/replicas_vs_ddp.py [--rounds 3]

The ``mlp`` of ``real_compute.py`` (8 Linear(1024) blocks and a head, ~8.4 M parameters, 34 MB
of gradients: two buckets of 25 MiB), microbatches of 64, SGD, one thread per process, 2
processes on gloo over loopback:

* ours: a plan of one stage with 2 replicas (``schedule: pipedream``, one microbatch per
  minibatch): replica ``r`` trains minibatches ``r, r + 2, ...``, and the two average their
  gradients before every update, bucket by bucket as the backward produces them
  (``runtime/grad_buckets.py``). Time per update: the mean gap between the first replica's
  updates in its ``metrics.jsonl`` after :data:`SKIP` updates (no ``--trace``: DDP records
  nothing either);
* DDP: the same model wrapped in DistributedDataParallel (its default buckets), each rank a
  microbatch of 64 per step, its loss and SGD step; time per step after :data:`SKIP` steps.

Both do the same work per update (two microbatches of 64, one allreduce of every gradient).
The rounds alternate (ours, DDP, ours, ...) because the machine is shared; the table shows the
median and range of each and their ratio per round. Refreshes the ``replicas-vs-ddp`` section
of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from common import RUNS, machine_lines, run_command, write_plan, write_section

ARGS = {"layers": 8, "width": 1024, "in_features": 1024, "samples": 4096}
MICROBATCH_SIZE = 64
STEPS = 80
"""Updates per run (ours: minibatches per replica x 2)."""
SKIP = 20
"""Updates left out at the start (allocation, the first buckets, process start-up)."""


def run_ours(directory: Path) -> tuple[float | None, str]:
    plan = {
        "format": "pipedream/plan@1",
        "workload": "mlp",
        "workload_args": {k: str(v) for k, v in ARGS.items()},
        "schedule": "pipedream",
        "microbatch_size": MICROBATCH_SIZE,
        "microbatches": 1,
        "world_size": 2,
        "stages": [{"first_layer": "0", "last_layer": "8", "replicas": 2, "ranks": [0, 1]}],
    }
    path = write_plan(plan, directory / "plan.yaml")
    argv = ["./launch.sh", str(path), "--steps", str(2 * STEPS), "--run-dir"]
    argv += [str(directory / "run"), "--no-progress", "--timeout", "120"]
    command = run_command(argv, timeout=300)
    if command.returncode != 0:
        print(f"  ours: FAILED {command.output[-2000:]}", file=sys.stderr)
        return None, command.shell()
    lines = (directory / "run" / "metrics.jsonl").read_text().splitlines()
    times = [json.loads(line)["time_s"] for line in lines][SKIP:]
    return (times[-1] - times[0]) * 1000 / (len(times) - 1), command.shell()


def run_ddp(directory: Path) -> tuple[float | None, str]:
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "ddp.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    argv += ["2", "benchmarks/replicas_vs_ddp.py", "--ddp-worker", str(out)]
    command = run_command(argv, timeout=300)
    if command.returncode != 0 or not out.exists():
        print(f"  ddp: FAILED {command.output[-2000:]}", file=sys.stderr)
        return None, command.shell()
    return json.loads(out.read_text())["period_ms"], command.shell()


def ddp_worker(out: Path) -> None:  # pragma: no cover - runs under torchrun
    """One rank of the DDP run (torchrun's environment)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pipedream.data import MicrobatchStream
    from pipedream.host_memory import configure_host_memory
    from pipedream.runtime.gc_freeze import frozen_heap
    from pipedream.workload import load_workload

    configure_host_memory()  # as every rank of ours
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    workload = load_workload(
        "mlp", {k: str(v) for k, v in ARGS.items()}, microbatch_size=MICROBATCH_SIZE
    )
    model = DistributedDataParallel(workload.model)
    optimizer = workload.optimizer(model.parameters())
    stream = MicrobatchStream(workload.dataset, MICROBATCH_SIZE, seed=0)
    ends = []
    with frozen_heap():
        for step in range(STEPS):
            inputs, targets = stream.microbatch(2 * step + rank)
            loss = workload.loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ends.append(time.perf_counter())
    kept = ends[SKIP:]
    period = (kept[-1] - kept[0]) * 1000 / (len(kept) - 1)
    if rank == 0:
        out.write_text(json.dumps({"period_ms": period}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ddp-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ddp_worker is not None:
        ddp_worker(args.ddp_worker)
        return 0
    root = RUNS / "replicas-vs-ddp"
    shutil.rmtree(root, ignore_errors=True)
    ours, theirs, ratios, commands = [], [], [], []
    for round_index in range(args.rounds):
        directory = root / f"round-{round_index}"
        runs = [("ours", run_ours), ("ddp", run_ddp)]
        if round_index % 2:
            runs.reverse()  # what runs first in a round alternates
        found = {}
        for name, run in runs:
            found[name], command = run(directory / name)
            commands.append(command)
            if found[name] is not None:
                print(f"  {name} (round {round_index}): {found[name]:.1f} ms per update")
        if found["ours"] is not None:
            ours.append(found["ours"])
        if found["ddp"] is not None:
            theirs.append(found["ddp"])
        if found["ours"] is not None and found["ddp"] is not None:
            ratios.append(found["ddp"] / found["ours"])

    def summary(values: list[float]) -> str:
        if not values:
            return "failed"
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    body = "\n".join(
        [
            "## One stage on 2 replicas against DistributedDataParallel "
            "(benchmarks/replicas_vs_ddp.py)",
            "",
            *machine_lines(),
            "",
            f"mlp {ARGS['layers']} x {ARGS['width']} (~8.4 M parameters), microbatches of "
            f"{MICROBATCH_SIZE}, SGD, 2 processes of one thread on gloo; ms per update "
            f"(two microbatches, one allreduce), after {SKIP} updates, {args.rounds} rounds.",
            "",
            "| | ms per update, median (range) |",
            "| --- | --- |",
            f"| pipedream, 1 stage x 2 replicas (bucketed allreduce) | {summary(ours)} |",
            f"| DistributedDataParallel | {summary(theirs)} |",
            "",
            "DDP's time over ours, per round: "
            + (", ".join(f"{r:.3f}" for r in ratios) or "none")
            + " (above 1: ours is faster).",
            "",
            "Commands run:",
            "",
            *(f"    {line}" for line in commands),
        ]
    )
    write_section("replicas-vs-ddp", body)
    print(body)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
