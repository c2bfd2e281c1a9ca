"""Run every benchmark in order and refresh ``benchmarks/RESULTS.md`` (about an hour, most of
it in sleep_pipeline.py, whose runs last as long as their sleeps and messages).

    python benchmarks/run_all.py

sleep_pipeline.py (schedules vs the ideal and torch.distributed.pipelining), real_compute.py
(mlp speedup on 2 cores), simulator_accuracy.py (which reads the runs of the first two).
Each writes its own section; run one alone to refresh only that section.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

__all__ = ["SCRIPTS", "main"]

SCRIPTS = ("sleep_pipeline.py", "real_compute.py", "simulator_accuracy.py")


def main() -> int:
    here = Path(__file__).resolve().parent
    for script in SCRIPTS:
        start = time.perf_counter()
        print(f"== {script}", flush=True)
        code = subprocess.call([sys.executable, str(here / script)], cwd=here.parent)
        print(f"== {script}: exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
