"""``python -m pipedream.runtime.launch_check PLAN [--nnodes N] [--nproc-per-node P]
[-- TRAIN_OPTIONS...]``.

Used by ``launch.sh`` before torchrun starts: validates the plan, its action tables, its
workload's name and options (without building the model) and the options for ``pipedream
train`` (as every rank would, and a checkpoint to resume from), and prints the number of
processes per node and the number of nodes (``--nnodes 1:1`` is one), or prints the error and
exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipedream.errors import LaunchError, PipedreamError
from pipedream.formats.plan import Plan, load_plan
from pipedream.runtime.train_options import (
    check_global_norm,
    check_options,
    check_segments,
    train_options,
)
from pipedream.schedules import validate_plan_schedule, validation_bound
from pipedream.torch_support import check_installed_torch
from pipedream.workload_options import check_workload

__all__ = ["check_train_options", "main", "node_count", "processes_per_node"]


def _whole_number(value: str, option: str, what: str) -> int:
    """``value`` of ``option`` as an integer, else :class:`LaunchError` naming the option."""
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{option} {value!r}: must be a whole number of {what}") from None


def node_count(value: str, world_size: int) -> int:
    """The number of nodes that ``--nnodes value`` asks for: ``N``, or torchrun's elastic range
    ``MIN:MAX`` where ``MIN == MAX``. A range that lets the job start on fewer nodes than it
    waits for is refused: a plan's world size is fixed, so torchrun would wait for the other
    nodes forever, or start too few processes."""
    low, colon, high = value.partition(":")
    if not colon:
        return _whole_number(value, "--nnodes", "nodes, or MIN:MAX with MIN = MAX")
    try:
        nodes = int(low), int(high)
    except ValueError:
        raise LaunchError(
            f"--nnodes {value!r}: must be a whole number of nodes, or MIN:MAX with MIN = MAX"
        ) from None
    if nodes[0] != nodes[1]:
        raise LaunchError(
            f"--nnodes {value}: a plan runs on a fixed number of processes ({world_size}), so "
            f"not on an elastic range of nodes; give one number, e.g. --nnodes {nodes[1]}"
        )
    return nodes[0]


def processes_per_node(world_size: int, *, nnodes: int, nproc_per_node: int | None) -> int:
    """Processes per node so that ``nnodes x nproc == world_size``."""
    if nnodes < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {nnodes}")
    if nproc_per_node is None:
        if world_size % nnodes:
            raise LaunchError(
                f"the plan's world_size {world_size} does not divide into {nnodes} nodes; "
                f"give --nproc-per-node per node or re-plan for a multiple of {nnodes} workers"
            )
        return world_size // nnodes
    if nproc_per_node * nnodes != world_size:
        raise LaunchError(
            f"--nnodes {nnodes} x --nproc-per-node {nproc_per_node} = "
            f"{nnodes * nproc_per_node} processes, but the plan's world_size is {world_size}; "
            "drop --nproc-per-node (launch.sh derives it from the plan) or re-plan with "
            f"--workers {nnodes * nproc_per_node}"
        )
    return nproc_per_node


def check_train_options(
    plan_path: str, plan: Plan, train_args: Sequence[str], *, nproc_per_node: int = 1
) -> None:
    """What every rank would refuse in ``pipedream train PLAN TRAIN_ARGS`` before it joins the
    others: its options (argparse's usage errors exit 2 here), a ``--device`` this node's GPUs
    cannot give its ``nproc_per_node`` ranks, the checkpoint to resume from, the steps from
    there, and a run directory with checkpoints past them. ``--resume auto`` needs the run
    directory given, not launch.sh's fresh default."""
    from pipedream.cli import parse_command_line

    options = train_options(parse_command_line(["train", plan_path, *train_args]))
    check_options(options)
    check_global_norm(options, plan)
    if options.device.startswith("cuda"):  # only then is torch imported, to count the GPUs
        import torch

        from pipedream.runtime.environment import choose_placement

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        choose_placement(options.device, local_rank=0, local_world_size=nproc_per_node, gpus=gpus)
    start = 0
    run_dir = options.run_dir
    has_checkpoints = run_dir is not None and (Path(run_dir) / "checkpoints").is_dir()
    if options.resume is not None or has_checkpoints:
        from pipedream.runtime.checkpoint import check_stage_file, load_manifest  # torch
        from pipedream.runtime.checkpoint_protocol import (
            check_run_dir,
            newest_checkpoint,
            resume_point,
        )

        if options.resume == "auto" and run_dir is not None:
            newest = newest_checkpoint(Path(run_dir))
            start = 0 if newest is None else newest[1]
            if newest is not None:  # its manifest against the plan, as --resume PATH's
                resume_point(str(newest[0]), run_dir, plan)
        else:
            found = resume_point(options.resume, run_dir, plan)
            start = 0 if found is None else int(load_manifest(found)["step"])
            if found is not None:  # as auto's newest: every file there, intact
                for entry in load_manifest(found)["stages"]:
                    check_stage_file(found, entry)
            check_run_dir(run_dir, start)
    check_segments(options, plan, start=start)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="launch.sh")
    parser.add_argument("plan")
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--nproc-per-node", default=None)
    args = parser.parse_args(argv[:split])
    try:
        check_installed_torch()
        plan = load_plan(args.plan)
        nnodes = node_count(args.nnodes, plan.world_size)
        nproc = None
        if args.nproc_per_node is not None:
            nproc = _whole_number(args.nproc_per_node, "--nproc-per-node", "processes")
        count = processes_per_node(plan.world_size, nnodes=nnodes, nproc_per_node=nproc)
        check_workload(plan.workload, plan.workload_args, source=args.plan)  # cheap: first
        validate_plan_schedule(plan, [validation_bound(plan)], source=args.plan)
        check_train_options(args.plan, plan, argv[split + 1 :], nproc_per_node=count)
        print(count, nnodes)
    except PipedreamError as exc:
        print(f"launch.sh: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
