"""The ``pipedream`` command line (DESIGN.md section 4).

Each verb's work lives in its own package; this module only parses arguments, imports the verb's
module lazily (``pipedream plan`` must not pay for importing torch) and turns user errors into
one clear line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pipedream import __version__
from pipedream.errors import PipedreamError, RunFailure

__all__ = ["build_parser", "main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2

# verb -> "module:function" taking the parsed argparse.Namespace and returning an exit code
_HANDLERS = {
    "profile": "pipedream.profiler.command:run",
    "plan": "pipedream.optimizer.command:run",
    "train": "pipedream.runtime.command:run",
    "export": "pipedream.runtime.command:export",
}


class _Parser(argparse.ArgumentParser):
    """argparse that exits with status 2 and a one-line message on bad usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pipedream",
        description="PipeDream-style pipeline-parallel training: profile, plan, train.",
    )
    parser.add_argument("--version", action="version", version=f"pipedream {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    profile = verbs.add_parser("profile", help="measure every layer of a workload")
    profile.add_argument("workload", nargs="?", help="built-in name or package.module:function")
    profile.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="option for the workload factory (repeatable)",
    )
    profile.add_argument("--microbatch-size", type=int, default=None, metavar="B")
    profile.add_argument(
        "--from-pipedream",
        metavar="GRAPH_TXT",
        help="import a graph.txt written by the original PipeDream profiler",
    )
    profile.add_argument("--warmup", type=int, default=3, help="untimed runs per layer")
    profile.add_argument("--repeats", type=int, default=10, help="timed runs per layer (median)")
    profile.add_argument("-o", "--output", required=True, metavar="PROFILE")

    plan = verbs.add_parser("plan", help="split a profiled model into pipeline stages")
    plan.add_argument("profile", help="profile YAML from `pipedream profile`")
    plan.add_argument("--workers", type=int, metavar="N", help="number of workers (one level)")
    plan.add_argument(
        "--bandwidth",
        metavar="B",
        help="bytes/s between workers, e.g. 1e9 or '10 GB/s' (default 1e9)",
    )
    plan.add_argument("--topology", metavar="TOPO", help="topology YAML (several levels)")
    plan.add_argument(
        "--schedule",
        default="pipedream",
        help="pipedream, pipedream-vs, 2bw, 1f1b, gpipe (default pipedream)",
    )
    plan.add_argument("--microbatches", type=int, default=None, metavar="M")
    plan.add_argument("--straight", action="store_true", help="one replica per stage")
    plan.add_argument("--memory", metavar="X", help="memory per worker, e.g. '16 GiB'")
    plan.add_argument("--cost-model", default="pipedream", help="cost model (default pipedream)")
    plan.add_argument("--compare", action="store_true", help="print baseline plans too")
    plan.add_argument(
        "--fewer-workers",
        action="store_true",
        help="allow plans that leave workers idle when that is no slower",
    )
    plan.add_argument("-o", "--output", required=True, metavar="PLAN")

    train = verbs.add_parser("train", help="train a plan (run under torchrun / launch.sh)")
    train.add_argument("plan", help="plan YAML from `pipedream plan`")
    train.add_argument("--steps", type=int, default=100, metavar="K", help="minibatches")
    train.add_argument(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="where metrics and checkpoints go (default runs/<timestamp>)",
    )
    train.add_argument("--seed", type=int, default=0, help="data order seed")
    train.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="also checkpoint every N minibatches (a final one is always written)",
    )
    train.add_argument("--resume", default=None, metavar="auto|PATH",
                       help="continue from the newest complete checkpoint in --run-dir (auto) "
                       "or from a checkpoint directory, possibly written under another plan")
    train.add_argument("--keep", type=int, default=0, metavar="K",
                       help="keep only the newest K checkpoints (default 0: keep all)")
    train.add_argument("--on-nonfinite", default="stop", choices=["stop", "skip"],
                       help="on a NaN/inf loss: stop with a message (default), or skip the "
                       "microbatch (zero gradient) and count it")
    train.add_argument("--trace", action="store_true", help="record per-rank action timelines")
    train.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    train.add_argument("--recompute", action="store_true", help="recompute activations in backward")
    train.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="give up on a silent peer after this long",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")

    export = verbs.add_parser("export", help="write a checkpoint's full model state dict")
    export.add_argument("checkpoint", help="checkpoint directory (runs/.../checkpoints/step-N)")
    export.add_argument("-o", "--output", required=True, metavar="MODEL_PT")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module_name, _, function = _HANDLERS[args.verb].partition(":")
    try:
        handler = getattr(importlib.import_module(module_name), function)
        code = handler(args)
    except PipedreamError as exc:
        print(f"pipedream {args.verb}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunFailure as exc:
        print(f"pipedream {args.verb}: failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"pipedream {args.verb}: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
