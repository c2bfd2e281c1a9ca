"""How fast ``pipedream plan`` is, as a whole process, on the original PipeDream's cases.

Run from the repository root::

    python benchmarks/optimizer_speed.py [--repeat N] [--only NAME]

It imports the PipeDream sample profiles vendored in ``tests/data/pipedream-profiles`` (vgg16,
resnet50, gnmt) with ``pipedream profile --from-pipedream``, writes a synthetic 2,000-layer
profile, then times ``pipedream plan`` (a fresh ``python -m pipedream.cli`` process each time:
interpreter start, imports, planning, writing the plan) on every case: one level of 4/8/16
workers at 1e9 bytes/s and two levels of 4 workers per server (10e9) x 2 or 4 servers (1.25e9),
with ``--cost-model pipedream`` (the original's numbers), and the synthetic profile on three
levels (8 GPUs x 8 servers x 16 racks = 1,024 workers). For each case it reports the predicted
time per minibatch next to the original optimizer's, the best wall time of ``--repeat`` runs and
the process's peak resident memory (``os.wait4``), and rewrites ``benchmarks/RESULTS-optimizer.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipedream import __version__
from pipedream.formats import (
    LayerProfile,
    Level,
    Profile,
    Topology,
    load_plan,
    save_profile,
    save_topology,
)

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "tests" / "data" / "pipedream-profiles"
RESULTS = REPO / "benchmarks" / "RESULTS-optimizer.md"
ORIGINAL_MS = {
    ("vgg16", "4"): 205.5,
    ("vgg16", "8"): 103.8,
    ("vgg16", "16"): 56.5,
    ("vgg16", "4x2"): 157.8,
    ("vgg16", "4x4"): 67.1,
    ("resnet50", "4"): 162.9,
    ("resnet50", "8"): 92.0,
    ("resnet50", "16"): 47.8,
    ("resnet50", "4x2"): 76.2,
    ("resnet50", "4x4"): 43.2,
    ("gnmt", "4"): 25.9,
    ("gnmt", "8"): 19.3,
    ("gnmt", "16"): 19.3,
    ("gnmt", "4x4"): 11.1,
}
"""The original optimizer's "time per stage in pipeline" (ms), as quoted in issue 4."""


@dataclass(frozen=True)
class Case:
    """One ``pipedream plan`` invocation."""

    name: str
    """Row label."""
    argv: list[str]
    """Arguments after ``python -m pipedream.cli``."""
    original_ms: float | None
    """The original optimizer's result, if known."""


def synthetic_profile(num_layers: int = 2000, seed: int = 0) -> Profile:
    """A transformer-like chain: 0.5-1.5 ms per layer, half of the layers with 1-30 MB of
    parameters, 1-8 MB of activations and cut bytes (seeded, so every run plans the same)."""
    rng = random.Random(seed)
    layers = []
    for i in range(num_layers):
        ms = rng.uniform(0.5, 1.5)
        params = rng.choice([0, int(rng.uniform(1e6, 3e7))])
        output = int(rng.uniform(1e6, 8e6))
        layers.append(LayerProfile(f"layer{i}", "Synthetic", ms / 3, 2 * ms / 3, output, params))
    return Profile("synthetic-2000", 1, "synthetic", "float32", tuple(layers))


def measure(argv: list[str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS MiB) of one ``python -m pipedream.cli`` process."""
    with tempfile.TemporaryFile("w+") as output:
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "pipedream.cli", *argv],
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        _, status, usage = os.wait4(process.pid, 0)  # this child's own resource usage
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode:
            output.seek(0)
            raise SystemExit(f"pipedream {' '.join(argv)} failed:\n{output.read()}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def build_cases(work: Path) -> list[Case]:
    """Import the sample profiles and write the topologies; the cases of the module docstring."""
    cases = []
    servers = {"4x2": 2, "4x4": 4}
    for servers_name, count in servers.items():
        topology = Topology((Level("server", 4, 10e9), Level("cluster", count, 1.25e9)))
        save_topology(topology, work / f"{servers_name}.yaml")
    for name in ("vgg16", "resnet50", "gnmt"):
        graph = SAMPLES / f"{name}.txt"
        profile = work / f"{name}.yaml"
        command = ["profile", "--from-pipedream", str(graph), "-o", str(profile)]
        subprocess.run(
            [sys.executable, "-m", "pipedream.cli", *command],
            check=True,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        for shape in ("4", "8", "16", "4x2", "4x4"):
            cluster = (
                ["--workers", shape, "--bandwidth", "1e9"]
                if "x" not in shape
                else ["--topology", str(work / f"{shape}.yaml")]
            )
            argv = ["plan", str(profile), *cluster, "--cost-model", "pipedream"]
            argv += ["-o", str(work / f"plan-{name}-{shape}.yaml")]
            cases.append(Case(f"{name} {shape}", argv, ORIGINAL_MS.get((name, shape))))
    synthetic = work / "synthetic-2000.yaml"
    save_profile(synthetic_profile(), synthetic)
    big = Topology((Level("gpu", 8, 100e9), Level("server", 8, 25e9), Level("rack", 16, 5e9)))
    save_topology(big, work / "8x8x16.yaml")
    argv = ["plan", str(synthetic), "--topology", str(work / "8x8x16.yaml")]
    cases.append(Case("synthetic-2000 8x8x16", [*argv, "-o", str(work / "plan-big.yaml")], None))
    return cases


def machine() -> list[str]:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        f"- date: {datetime.date.today().isoformat()}; load average at the start: {load}",
        f"- machine: {cpu}, {os.cpu_count()} logical CPUs (shared), {platform.system()} "
        f"{platform.release()}",
        f"- versions: Python {platform.python_version()}, numpy {np.__version__}, pipedream "
        f"{__version__}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (best is kept)")
    parser.add_argument("--only", default=None, help="run only the cases whose name has this")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="optimizer-speed-"))
    rows, commands = [], []
    for case in build_cases(work):
        if args.only and args.only not in case.name:
            continue
        runs = [measure(case.argv) for _ in range(args.repeat if "2000" not in case.name else 1)]
        wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
        rss = max(r[2] for r in runs)
        plan = load_plan(case.argv[case.argv.index("-o") + 1])
        assert plan.prediction is not None
        ours = plan.prediction.time_per_minibatch_ms
        original = "-" if case.original_ms is None else f"{case.original_ms:.1f}"
        shape = "-".join(str(stage.replicas) for stage in plan.stages)
        shape = shape if len(shape) <= 28 else f"{plan.num_stages} stages"
        rows.append(
            f"| {case.name} | {plan.world_size} | {shape} | {ours:.3f} | {original} | "
            f"{wall:.2f} | {cpu:.2f} | {rss:.0f} |"
        )
        commands.append(
            "python -m pipedream.cli " + " ".join(case.argv).replace(str(work), "$WORK")
        )
        print(rows[-1], flush=True)
    lines = [
        "# `pipedream plan` speed",
        "",
        "Written by `python benchmarks/optimizer_speed.py` (see its docstring). Wall time is the",
        "whole `python -m pipedream.cli plan` process (interpreter start, imports, planning,",
        "writing the plan), best of the runs, CPU time its user + system time (the machine is",
        "shared: wall > CPU means other work was running); memory is the process's peak",
        "resident set size.",
        "Planning never imports torch. Times per minibatch are the optimizer's prediction in ms",
        "(`--cost-model pipedream` for the original's cases) next to the original optimizer's",
        "(issue 4).",
        "",
        *machine(),
        "",
        "| case | workers | replicas per stage | predicted ms | original ms | wall s | CPU s "
        "| peak MiB |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Commands. `$WORK` is a temporary folder holding the imported profiles (`python -m",
        "pipedream.cli profile --from-pipedream tests/data/pipedream-profiles/NAME.txt -o",
        "$WORK/NAME.yaml`), the synthetic profile (`synthetic_profile()` in the script) and the",
        "topologies: `4x2.yaml`/`4x4.yaml` = 4 workers per server at 10e9 B/s x 2/4 servers at",
        "1.25e9 B/s (the original's `-n 4 2`/`-n 4 4 -b 10e9 1.25e9`), `8x8x16.yaml` = 8 GPUs",
        "at 100 GB/s x 8 servers at 25 GB/s x 16 racks at 5 GB/s.",
        "",
        "```",
        *commands,
        "```",
        "",
    ]
    if args.only is None:
        RESULTS.write_text("\n".join(lines))
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
