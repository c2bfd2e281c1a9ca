"""Does the profile add up? Sum of per-layer forward+backward vs the whole model's.

For each workload: ``pipedream profile`` times every layer inside whole passes of the model
(split at the layer boundaries); here the plain model's forward+backward on the same microbatch
is timed on its own (warm-up, median of repeats), in the same process, rounds interleaved. The
ratio sum/whole should be close to 1 (target: within 15%): the profiler's per-layer modules
(graph layers are cut out as modules of their own), its clock reads and hooks push it above 1,
and a shared 2-core machine adds noise.

    python benchmarks/profile_accuracy.py            # writes benchmarks/RESULTS-profiler.md
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from pipedream.profiler.command import profile_workload
from pipedream.workload import load_workload

CASES = [
    ("mlp", {"layers": "8", "width": "512"}, 64, None),
    ("gpt", {"layers": "4", "dim": "128", "heads": "4", "seq": "64"}, 16, None),
    ("gpt", {"layers": "4", "dim": "128", "heads": "4", "seq": "64"}, 16, 2),
    ("resnet", {"width": "16"}, 32, None),
]
REPEATS = 20
ROUNDS = 3


def whole_model_ms(name: str, args: dict[str, str], microbatch: int) -> float:
    workload = load_workload(name, args, microbatch_size=microbatch)
    model, x = workload.model, workload.example_input
    times = []
    for i in range(3 + REPEATS):
        for p in model.parameters():
            p.grad = None
        start = time.perf_counter()
        out = model(x)
        out.backward(torch.ones_like(out))
        elapsed = (time.perf_counter() - start) * 1000
        if i >= 3:
            times.append(elapsed)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    sums: dict[int, list[float]] = {case: [] for case in range(len(CASES))}
    wholes: dict[int, list[float]] = {case: [] for case in range(len(CASES))}
    counts: dict[int, int] = {}
    for _ in range(ROUNDS):
        for case, (name, args, microbatch, depth) in enumerate(CASES):
            profile = profile_workload(
                name, args, microbatch_size=microbatch, repeats=REPEATS, depth=depth
            )
            counts[case] = len(profile.layers)
            sums[case].append(sum(layer.forward_ms + layer.backward_ms for layer in profile.layers))
            wholes[case].append(whole_model_ms(name, args, microbatch))
    rows = []
    for case, (name, args, microbatch, depth) in enumerate(CASES):
        layers, whole = statistics.median(sums[case]), statistics.median(wholes[case])
        rows.append((name, args, microbatch, depth, counts[case], layers, whole))
    lines = [
        "# Profiler accuracy: sum of per-layer times vs the whole model",
        "",
        f"- date: {datetime.date.today()}, machine: {platform.machine()} "
        f"{platform.processor() or ''} ({torch.get_num_threads()} thread), "
        f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f} when written "
        "(shared machine)",
        "- command: `python benchmarks/profile_accuracy.py` (median of "
        f"{REPEATS} runs after 3 warm-up, forward + backward; {ROUNDS} interleaved rounds, "
        "medians)",
        "",
        "| workload | args | microbatch | granularity | layers | sum of layers ms "
        "| whole model ms | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, args, microbatch, depth, count, layers, whole in rows:
        granularity = f"--depth {depth}" if depth else "default"
        arg_text = " ".join(f"{k}={v}" for k, v in args.items())
        lines.append(
            f"| {name} | {arg_text} | {microbatch} | {granularity} | {count} | {layers:.2f} | "
            f"{whole:.2f} | {layers / whole:.2f} |"
        )
    lines += [
        "",
        "Target: ratio within 0.85-1.15. The profiler times each layer inside whole passes of the",
        "model (`profiler/chain.py`), so caches are as warm or cold as in the model; the whole",
        "model is timed separately as plain `model(x)` + `backward`. Ratios above 1 come from the",
        "profiler's per-layer modules and clock reads; a shared 2-core machine adds noise.",
        "",
    ]
    out = Path(__file__).with_name("RESULTS-profiler.md")
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
