"""Time to accuracy: asynchronous against synchronous schedules on one code base.

    python benchmarks/time_to_accuracy.py [--seeds 3] [--only digits|gpt]

PipeDream's headline measure is time to a target accuracy: throughput times statistical
efficiency (how much a stale gradient is worth). This trains two workloads on 4 processes
under six configurations and records, at every checkpoint, the held-out metric:

* ``digits`` (the MLP on scikit-learn's 8x8 digits, 4 layers, microbatches of 32) to 97%
  held-out accuracy;
* ``gpt`` (the small transformer on its Markov stream, 7 layers, microbatches of 16) to a
  held-out loss of :data:`GPT_TARGET` (the chain's entropy rate, the best possible, is ~1.08).

Configurations, each on the same number of samples (:data:`SAMPLES` per workload):
``pipedream``, ``pipedream-vs`` (4 stages, one microbatch per update), ``2bw``, ``1f1b``,
``gpipe`` (4 stages, 4 microbatches per update) and data parallelism (one stage on 4
replicas, one microbatch each, 4 per update). Each runs with 3 seeds (the data order and
the model's initialisation), checkpointing every twentieth of the run (each checkpoint drains
the pipeline; every configuration pays it alike). Updates, samples and seconds of training
(``metrics.jsonl``) to the target are the first checkpoint that meets it. Plots of the
held-out metric against samples and against seconds go to
``benchmarks/time_to_accuracy-<workload>.png``; the table to the ``time-to-accuracy``
section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO, RUNS, machine_lines, run_command, write_plan, write_section

from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.workload import load_workload

GPT_TARGET = 1.40
"""Held-out loss the gpt runs must reach."""
WORLD = 4
"""Processes of every run."""
CHECKPOINTS = 20
"""Checkpoints (held-out evaluations) per run."""


@dataclass(frozen=True)
class Task:
    workload: str
    args: dict[str, str]
    microbatch_size: int
    stages: list[tuple[str, str]]
    """Layer ranges of the 4-stage plans."""
    samples: int
    """Training samples of every run."""
    metric: str
    target: float
    higher_is_better: bool

    def reached(self, value: float) -> bool:
        return value >= self.target if self.higher_is_better else value <= self.target


TASKS = {
    "digits": Task(
        "digits",
        {},
        32,
        [("0", "0"), ("1", "1"), ("2", "2"), ("3", "3")],
        samples=16_000,
        metric="test_accuracy",
        target=0.97,
        higher_is_better=True,
    ),
    "gpt": Task(
        "gpt",
        {},
        16,
        [("embed", "h0"), ("h1", "h1"), ("h2", "h3"), ("norm", "head")],
        samples=8_000,
        metric="test_loss",
        target=GPT_TARGET,
        higher_is_better=False,
    ),
}


@dataclass(frozen=True)
class Config:
    name: str
    schedule: str
    microbatches: int
    data_parallel: bool = False

    @property
    def microbatches_per_update(self) -> int:
        return WORLD if self.data_parallel else self.microbatches


CONFIGS = [
    Config("pipedream", "pipedream", 1),
    Config("pipedream-vs", "pipedream-vs", 1),
    Config("2bw", "2bw", 4),
    Config("1f1b", "1f1b", 4),
    Config("gpipe", "gpipe", 4),
    Config("data parallel", "pipedream", 1, data_parallel=True),
]


def _plan(task: Task, config: Config, seed: int) -> dict[str, Any]:
    args = {**task.args, "seed": str(seed)}  # the model's initialisation
    if config.data_parallel:
        first, last = task.stages[0][0], task.stages[-1][1]
        stages = [{"first_layer": first, "last_layer": last, "replicas": WORLD,
                   "ranks": list(range(WORLD))}]  # fmt: skip
    else:
        stages = [
            {"first_layer": a, "last_layer": b, "replicas": 1, "ranks": [rank]}
            for rank, (a, b) in enumerate(task.stages)
        ]
    return {
        "format": "pipedream/plan@1",
        "workload": task.workload,
        "workload_args": args,
        "schedule": config.schedule,
        "microbatch_size": task.microbatch_size,
        "microbatches": config.microbatches,
        "world_size": WORLD,
        "stages": stages,
    }


def run_one(task: Task, config: Config, seed: int, directory: Path) -> dict[str, Any]:
    """Train, evaluate every checkpoint; the held-out metric by update, samples and seconds."""
    plan = _plan(task, config, seed)
    path = write_plan(plan, directory / "plan.yaml")
    samples_per_minibatch = task.microbatch_size * config.microbatches
    minibatches = task.samples // samples_per_minibatch
    every = minibatches // CHECKPOINTS
    every -= every % (WORLD if config.data_parallel else 1)
    argv = ["./launch.sh", str(path), "--steps", str(minibatches), "--seed", str(seed)]
    argv += ["--run-dir", str(directory / "run"), "--checkpoint-every", str(every)]
    command = run_command([*argv, "--no-progress", "--timeout", "120"], timeout=900)
    out: dict[str, Any] = {"command": command.shell(), "points": []}
    if command.returncode != 0:
        print(f"  {task.workload} {config.name} seed {seed}: FAILED {command.output[-1500:]}")
        return out
    lines = [json.loads(x) for x in (directory / "run" / "metrics.jsonl").read_text().splitlines()]
    per_line = WORLD if config.data_parallel else 1  # minibatches per logged update
    workload = load_workload(
        task.workload, plan["workload_args"], microbatch_size=task.microbatch_size
    )
    assert workload.evaluate is not None
    for checkpoint in sorted((directory / "run" / "checkpoints").glob("step-*")):
        step = int(checkpoint.name.removeprefix("step-"))
        workload.model.load_state_dict(load_full_state_dict(checkpoint))
        value = workload.evaluate(workload.model)[task.metric]
        line = lines[step // per_line - 1]
        out["points"].append(
            {
                "updates": step * config.microbatches // config.microbatches_per_update,
                "samples": step * samples_per_minibatch,
                "seconds": line["time_s"],
                "value": value,
            }
        )
    hit = next((p for p in out["points"] if task.reached(p["value"])), None)
    out["hit"] = hit
    print(
        f"  {task.workload} {config.name} seed {seed}: "
        + (
            f"target at {hit['updates']} updates, {hit['samples']} samples, {hit['seconds']:.1f} s"
            if hit
            else f"target not reached (last {out['points'][-1]['value']:.4f})"
        )
    )
    return out


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.0f}" if values else "-"


def _rows(task: Task, results: dict[str, list[dict[str, Any]]]) -> list[str]:
    rows = []
    for config in CONFIGS:
        runs = results[config.name]
        hits = [r["hit"] for r in runs if r.get("hit")]
        finals = [r["points"][-1]["value"] for r in runs if r.get("points")]
        seconds = [h["seconds"] for h in hits]
        rows.append(
            f"| {config.name} | {config.microbatches_per_update * task.microbatch_size} | "
            f"{len(hits)} of {len(runs)} | {_median([h['updates'] for h in hits])} | "
            f"{_median([h['samples'] for h in hits])} | "
            + (f"{statistics.median(seconds):.1f}" if seconds else "-")
            + f" | {statistics.median(finals):.4f} |"
            if finals
            else f"| {config.name} | | failed | | | | |"
        )
    return rows


def _plot(task: Task, results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_samples, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, config in zip(colors, CONFIGS):
        for index, run in enumerate(results[config.name]):
            points = run.get("points") or []
            label = config.name if index == 0 else None
            xs = [p["samples"] for p in points]
            ts = [p["seconds"] for p in points]
            ys = [p["value"] for p in points]
            by_samples.plot(xs, ys, color=color, label=label, alpha=0.8, marker=".")
            by_time.plot(ts, ys, color=color, label=label, alpha=0.8, marker=".")
    for axes, xlabel in ((by_samples, "training samples"), (by_time, "seconds of training")):
        axes.axhline(task.target, color="gray", linestyle="--", linewidth=1)
        axes.set_xlabel(xlabel)
        axes.set_ylabel(f"held-out {task.metric.replace('_', ' ')}")
        axes.grid(alpha=0.3)
    by_samples.legend(fontsize=8)
    figure.suptitle(
        f"{task.workload} on {WORLD} processes: held-out {task.metric} (target "
        f"{task.target:g}, dashed), every seed"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", choices=sorted(TASKS), default=None)
    args = parser.parse_args(argv)
    root = RUNS / "time-to-accuracy"
    sections, commands = [], []
    for name, task in TASKS.items():
        if args.only and name != args.only:
            continue
        results: dict[str, list[dict[str, Any]]] = {}
        for config in CONFIGS:
            for seed in range(args.seeds):
                directory = root / name / config.name.replace(" ", "-") / f"seed-{seed}"
                shutil.rmtree(directory, ignore_errors=True)
                result = run_one(task, config, seed, directory)
                results.setdefault(config.name, []).append(result)
                commands.append(result["command"])
        picture = REPO / "benchmarks" / f"time_to_accuracy-{name}.png"
        _plot(task, results, picture)
        (root / name / "results.json").write_text(json.dumps(results, indent=1))
        goal = f"{'>=' if task.higher_is_better else '<='} {task.target:g}"
        sections += [
            f"### {name}: held-out {task.metric} {goal}",
            "",
            f"{task.samples} training samples per run; medians over the seeds that reached "
            f"the target ([plot](time_to_accuracy-{name}.png)).",
            "",
            "| configuration | samples per update | reached | updates to target | samples to "
            f"target | seconds to target | final {task.metric} (median) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *_rows(task, results),
            "",
        ]
    body = "\n".join(
        [
            "## Time to accuracy (benchmarks/time_to_accuracy.py)",
            "",
            *machine_lines(),
            "",
            *sections,
            "Commands run:",
            "",
            *(f"    {line}" for line in commands),
        ]
    )
    if not args.only:
        write_section("time-to-accuracy", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
