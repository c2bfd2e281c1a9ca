"""The ``pipedream`` command line (docs/cli.md).

Each verb's work lives in its own package; this module only parses arguments, imports the verb's
module lazily (``pipedream plan`` must not pay for importing torch) and turns user errors into
one clear line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from pipedream import __version__
from pipedream.errors import AlreadyReported, PipedreamError, RunFailure
from pipedream.outputs import check_distinct, check_not_input, check_output
from pipedream.precision import PRECISIONS

__all__ = ["build_parser", "main", "parse_command_line"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2

# verb -> "module:function" taking the parsed argparse.Namespace and returning an exit code
_HANDLERS = {
    "profile": "pipedream.profiler.command:run",
    "plan": "pipedream.optimizer.command:run",
    "train": "pipedream.runtime.command:run",
    "export": "pipedream.runtime.command:export",
    "evaluate": "pipedream.runtime.command:evaluate",
    "trace": "pipedream.runtime.trace_export:run_command",
    "simulate": "pipedream.optimizer.simulate_command:run",
}

_OUTPUTS = {
    "profile": (("output", "-o", "profile.yaml"), ("plot", "--plot", "profile.png")),
    "plan": (("output", "-o", "plan.yaml"),),
    "simulate": (("png", "--png", "timeline.png"),),
    "export": (("output", "-o", "model.pt"),),
    "trace": (("output", "-o", "trace.json"), ("png", "--png", "timeline.png")),
}
"""Each verb's output options: ``(attribute, option, an example file name)``, checked before
the work (an example ending in .png: an image)."""

_INPUTS: dict[str, Callable[[argparse.Namespace], list[str | None]]] = {
    "profile": lambda args: [args.from_pipedream],
    "plan": lambda args: [args.profile, args.topology],
    "simulate": lambda args: [args.plan, args.profile, args.topology],
    "export": lambda args: [args.checkpoint],
    "trace": lambda args: [args.plan, os.path.join(args.run_dir, "traces")],
}
"""Each verb's inputs that its outputs must not replace (files) or write into (folders)."""

_NEEDS_TORCH = frozenset({"profile", "train", "export", "evaluate"})
"""The verbs that run torch: they check its release first (``pipedream/torch_support.py``)."""


def _trace_defaults(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The files ``pipedream trace`` writes where ``-o`` or ``--png`` is not given."""
    from pipedream.runtime.trace_plot import matplotlib_available

    defaults = []
    if args.output is None:
        defaults.append(("-o (default)", os.path.join(args.run_dir, "trace.json")))
    if args.png is None and matplotlib_available():
        defaults.append(("--png (default)", os.path.join(args.run_dir, "timeline.png")))
    return defaults


_DEFAULT_OUTPUTS: dict[str, Callable[[argparse.Namespace], list[tuple[str, str]]]] = {
    "trace": _trace_defaults,
}
"""The files a verb writes by default where its output options are left out: ``(how the
messages call it, path)``, checked against the outputs given."""


class _Parser(argparse.ArgumentParser):
    """argparse that exits with status 2 and a one-line message on bad usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _key_value(text: str) -> str:
    """A ``--workload-arg``, checked as it is read: ``--workload-arg layers 8`` was told that
    ``8`` is an unrecognized argument, not to write ``layers=8``."""
    from pipedream.workload_options import key_value_problem  # only where the option is given

    problem = key_value_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


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
        type=_key_value,
        metavar="KEY=VALUE",
        help="option for the workload factory (repeatable)",
    )
    profile.add_argument("--microbatch-size", type=int, default=None, metavar="B")
    profile.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="measure the forwards as train --precision runs them: fp32, the model's own "
        "dtypes (default), bf16, autocast to bfloat16, or fp16, autocast to float16 with a "
        "loss scale; the plan and train follow it",
    )
    profile.add_argument(
        "--from-pipedream",
        metavar="GRAPH_TXT",
        help="import a graph.txt written by the original PipeDream profiler",
    )
    profile.add_argument(
        "--depth",
        type=int,
        default=None,
        metavar="D",
        help="layers = module paths cut to D components (traces the model)",
    )
    profile.add_argument(
        "--layers",
        action="append",
        default=[],
        metavar="GLOB",
        help="layers = module paths matching GLOB, e.g. 'blocks.*' (repeatable)",
    )
    profile.add_argument(
        "--plot",
        metavar="PNG",
        help="also draw per-layer compute time, output bytes and parameter bytes (matplotlib)",
    )
    profile.add_argument(
        "--concurrent",
        type=int,
        default=1,
        metavar="K",
        help="CPU: measure while K-1 more processes train the workload, as K ranks sharing "
        "this host will (default 1)",
    )
    profile.add_argument(
        "--warmup", type=int, default=None, help="untimed runs per layer (default 3)"
    )
    profile.add_argument(
        "--repeats", type=int, default=None, help="timed runs per layer, their median (default 10)"
    )
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
        default=None,
        help="pipedream, pipedream-vs, 2bw, 1f1b, gpipe, interleaved-1f1b, zb-h1, zbv, or auto: "
        "the fastest that fits, with its number of microbatches (default pipedream; 1f1b for "
        "an fp16 profile, whose loss scaling needs a schedule that flushes)",
    )
    plan.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="M",
        help="microbatches per minibatch (the schedules but pipedream(-vs); default "
        "max(4, stages), for interleaved-1f1b and zbv about 2 per worker)",
    )
    plan.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="stages per worker for interleaved-1f1b (default: the fastest of 2, 3, 4)",
    )
    plan.add_argument("--straight", action="store_true", help="one replica per stage")
    plan.add_argument(
        "--recompute",
        action="store_true",
        help="plan a run that recomputes activations in backward (train --recompute): "
        "slower backwards, a stage keeps only its inputs",
    )
    plan.add_argument(
        "--memory", metavar="X", help="memory per worker, e.g. '16 GiB' (overrides the topology)"
    )
    plan.add_argument(
        "--cost-model",
        default="symmetric",
        help="symmetric (default: every cut charged to the stages on both sides) or pipedream "
        "(the original optimizer's arithmetic exactly, e.g. the first stage pays no transfer)",
    )
    plan.add_argument(
        "--compare",
        action="store_true",
        help="also print data parallelism, the best straight pipeline, a uniform split and a "
        "split by parameters under the same model",
    )
    plan.add_argument(
        "--fewer-workers",
        action="store_true",
        help="allow plans that leave workers idle when that is no slower",
    )
    plan.add_argument(
        "--no-search",
        action="store_true",
        help="skip the local search by simulation beside the dynamic program's plan (faster "
        "planning; the plan is the fastest simulated of the dynamic program's, the best "
        "straight pipeline and data parallelism)",
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
    train.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the data order and of the random draws (dropout); default 0, or the "
        "seed of the checkpoint a run resumes from",
    )
    train.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="also checkpoint every N minibatches (a final one is always written)",
    )
    train.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="also evaluate the whole model (the workload's evaluation) every N minibatches, "
        "at a checkpoint (a multiple of --checkpoint-every; without it, checkpoints every N), "
        "into evaluations.jsonl; the final checkpoint is always evaluated",
    )
    train.add_argument(
        "--resume",
        default=None,
        metavar="auto|PATH",
        help="continue from the newest complete checkpoint in --run-dir (auto) "
        "or from a checkpoint directory, possibly written under another plan",
    )
    train.add_argument(
        "--keep",
        type=int,
        default=0,
        metavar="K",
        help="keep only the newest K checkpoints (default 0: keep all)",
    )
    train.add_argument(
        "--on-nonfinite",
        default="stop",
        choices=["stop", "skip"],
        help="on a NaN/inf loss: stop with a message (default), or skip the "
        "microbatch (zero gradient) and count it",
    )
    train.add_argument("--trace", action="store_true", help="record per-rank action timelines")
    train.add_argument(
        "--precision",
        default=None,
        choices=PRECISIONS,
        help="fp32, the model's own dtypes, bf16, autocast to bfloat16, or fp16, autocast to "
        "float16 with a dynamic loss scale (as --clip-grad-norm, a schedule that flushes with "
        "the same replicas at every stage, or one stage) (default: the plan's, which its "
        "profile was measured in; fp32 for a plan that names none)",
    )
    train.add_argument("--recompute", action="store_true", help="recompute activations in backward")
    train.add_argument(
        "--clip-grad-norm",
        type=float,
        default=None,
        metavar="C",
        help="clip every update's gradient to global norm C over the whole model, as "
        "clip_grad_norm_ in a plain loop (e.g. 1.0; a schedule that flushes and the same "
        "replicas at every stage, or a plan of one stage)",
    )
    train.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda", "cuda-shared"],
        help="auto (default): a GPU per rank with NCCL where the node has one for each rank, "
        "else the CPU with gloo; cuda: a GPU per rank; cuda-shared: ranks share the node's "
        "GPUs, messages over gloo through host memory; cpu: the CPU",
    )
    train.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels (torch.use_deterministic_algorithms): the same run gives "
        "the same numbers, also on GPUs, somewhat slower",
    )
    train.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="give up on a silent peer after this long",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")

    simulate = verbs.add_parser(
        "simulate", help="simulate a plan's action tables: predicted timeline and time/minibatch"
    )
    simulate.add_argument("plan", help="plan YAML")
    simulate.add_argument(
        "--profile",
        metavar="PROFILE",
        help="per-layer costs (default: the profile the plan records)",
    )
    simulate.add_argument(
        "--topology",
        metavar="TOPO",
        help="cluster for the bandwidths (default: the one the plan records, else one level "
        "at --bandwidth)",
    )
    simulate.add_argument(
        "--bandwidth", metavar="B", help="bytes/s between all ranks (default 1e9)"
    )
    simulate.add_argument(
        "--latency", type=float, default=0.0, metavar="MS", help="added to every message (ms)"
    )
    simulate.add_argument(
        "--host-bandwidth",
        metavar="B",
        help="bytes/s that all transfers touching one host (innermost unit) share, e.g. a "
        "CPU host copying loopback messages (default: every link independent)",
    )
    simulate.add_argument(
        "--duplex",
        type=float,
        default=None,
        metavar="F",
        help="what a link moves in both directions together, in multiples of its bandwidth: "
        "messages sent each way then move at once, sharing it (1: they share the link, 2: full "
        "duplex; default: one message at a time per link)",
    )
    simulate.add_argument(
        "--per-rank",
        type=float,
        default=None,
        metavar="F",
        help="what one rank moves in and out together, in multiples of a link's bandwidth: its "
        "messages share that (1: one link's worth, as gloo's one transport thread per process; "
        "default: no limit per rank)",
    )
    simulate.add_argument(
        "--interface",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every rank sends one message at a time and receives one at a time per level, "
        "through its network interface (default, as the planner); --no-interface: every "
        "link on its own",
    )
    simulate.add_argument(
        "--send-overhead",
        type=float,
        default=0.0,
        metavar="MS",
        help="time posting one message holds the sending rank (ms; default 0)",
    )
    simulate.add_argument(
        "--send-overhead-per-mib",
        type=float,
        default=0.0,
        metavar="MS",
        help="... plus this per MiB of the message (ms; default 0)",
    )
    simulate.add_argument(
        "--recv-overhead",
        type=float,
        default=0.0,
        metavar="MS",
        help="time posting one receive ahead holds the receiving rank, as the runtime does on "
        "gloo (ms; default 0)",
    )
    simulate.add_argument(
        "--spread",
        action="store_true",
        help="draw every forward and backward time from how much the profiler's whole passes "
        "varied (the profile's pass_spread; seeded), and report the mean time per minibatch",
    )
    simulate.add_argument(
        "--message-spread",
        metavar="R,R,...",
        help="draw every message's transfer time as its modelled time times one of these "
        "ratios (e.g. each repeat of a network calibration over their median; seeded), and "
        "report the mean time per minibatch",
    )
    simulate.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="K",
        help="minibatches to simulate (default: the fill, then doubling until the steady "
        "state repeats a cycle three times, then the drain)",
    )
    simulate.add_argument(
        "--width", type=int, default=64, metavar="SLOTS", help="time slots shown in the grid"
    )
    simulate.add_argument(
        "--png",
        metavar="FILE",
        help="draw the timeline (needs matplotlib: pip install -e '.[plot]')",
    )
    simulate.add_argument(
        "--trace",
        metavar="RUN_DIR",
        help="compare with the run of this plan (`pipedream train --trace --run-dir RUN_DIR`): "
        "its time per minibatch, each stage's measured action times, and the plan simulated "
        "again with those",
    )
    simulate.add_argument(
        "--trace-skip",
        type=int,
        default=None,
        metavar="N",
        help="minibatches (updates, if the last stage is replicated) at the start of the run "
        "left out of the measurement (default: the first third, at least one, leaving two to "
        "measure between)",
    )

    export = verbs.add_parser(
        "export",
        help="write a checkpoint's whole model: its state dict, or a transformers model directory",
    )
    export.add_argument("checkpoint", help="checkpoint directory (runs/.../checkpoints/step-N)")
    export.add_argument(
        "-o", "--output", metavar="MODEL_PT", help="write the state dict (torch.save) here"
    )
    export.add_argument(
        "--hf",
        metavar="DIR",
        help="write a transformers model directory (config.json, model.safetensors, and the "
        "tokenizer's files of an hf-lm pretrained= run) that from_pretrained loads",
    )
    export.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        type=_key_value,
        metavar="KEY=VALUE",
        help="with --hf, build the model with the workload's factory, this option of the "
        "checkpoint's replaced (repeatable): where the recorded config is not enough (a model "
        "class of your own, a checkpoint older than the record) and a file it names moved",
    )

    evaluate = verbs.add_parser(
        "evaluate", help="the workload's evaluation of the whole model at a checkpoint"
    )
    evaluate.add_argument("checkpoint", help="checkpoint directory (runs/.../checkpoints/step-N)")
    evaluate.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model is evaluated (auto: the first GPU if there is one)",
    )
    evaluate.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        type=_key_value,
        metavar="KEY=VALUE",
        help="replace one of the checkpoint's workload options (repeatable), e.g. "
        "tokens=val.bin to evaluate on other data, or a tokens file that moved",
    )
    evaluate.add_argument("--json", action="store_true", help="one JSON line instead of text")

    trace = verbs.add_parser("trace", help="merge a run's --trace timelines (Perfetto, PNG)")
    trace.add_argument("run_dir", help="run directory of `pipedream train --trace`")
    trace.add_argument(
        "-o", "--output", default=None, metavar="FILE", help="default RUN_DIR/trace.json"
    )
    trace.add_argument(
        "--png",
        default=None,
        metavar="FILE",
        help="Gantt chart (default RUN_DIR/timeline.png when matplotlib is installed)",
    )
    trace.add_argument(
        "--plan",
        default=None,
        metavar="PLAN",
        help="the plan the run trained: also print where its time per minibatch went (the "
        "critical path through all ranks, in milliseconds per minibatch by category)",
    )
    trace.add_argument(
        "--skip",
        type=int,
        default=None,
        metavar="N",
        help="with --plan: minibatches at the start left out (default: the first third, at "
        "least one, leaving two to measure between)",
    )
    return parser


def parse_command_line(argv: Sequence[str] | None) -> argparse.Namespace:
    """``pipedream ARGV`` parsed; a usage error exits 2 with one line. Arguments no option
    takes are said by the verb's parser ("pipedream train: error: unrecognized arguments:
    ..."), as its other usage errors are, not by the top-level one ("pipedream: error: ...")."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _verb_parsers(parser)[args.verb].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _verb_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each verb's parser, by name."""
    return next(
        action.choices
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
    )


def _stdout_closed() -> int:
    """The reader of stdout went away (``pipedream plan ... | head -1``): exit with status 1
    and no traceback, as Python's documentation advises (the note on SIGPIPE in the ``signal``
    module). stdout is pointed at ``os.devnull`` first, so that Python's own flush of it at exit
    does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file (io.UnsupportedOperation is both)
        pass
    return EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_command_line(argv)
    module_name, _, function = _HANDLERS[args.verb].partition(":")
    try:
        outputs = []
        drawn_by = next((o for _, o, e in _OUTPUTS.get(args.verb, ()) if e.endswith(".png")), None)
        for attribute, option, example in _OUTPUTS.get(args.verb, ()):
            if getattr(args, attribute) is not None:
                image = example.endswith(".png")
                check_not_input(getattr(args, attribute), option, _INPUTS[args.verb](args))
                check_output(
                    getattr(args, attribute),
                    option,
                    example=example,
                    image=image,
                    image_option=drawn_by,
                )
                outputs.append((option, getattr(args, attribute)))
        defaults = _DEFAULT_OUTPUTS.get(args.verb)
        check_distinct(outputs + (defaults(args) if defaults else []))
        if args.verb in _NEEDS_TORCH:
            from pipedream.torch_support import check_installed_torch

            check_installed_torch()
        handler = getattr(importlib.import_module(module_name), function)
        code = handler(args)
        sys.stdout.flush()  # here, where a reader that went away is caught
    except BrokenPipeError:
        return _stdout_closed()
    except AlreadyReported:
        return EXIT_BAD_INPUT
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
