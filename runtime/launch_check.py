"""``python -m pipedream.runtime.launch_check PLAN [--nnodes N] [--nproc-per-node P]``.

Used by ``launch.sh`` before torchrun starts: validates the plan and its action tables and
prints the number of processes per node, or prints the error and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipedream.errors import LaunchError, PipedreamError
from pipedream.formats.plan import load_plan
from pipedream.schedules import validate_plan_schedule, validation_bound

__all__ = ["main", "processes_per_node"]


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch.sh")
    parser.add_argument("plan")
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--nproc-per-node", default=None)
    args = parser.parse_args(argv)
    try:
        plan = load_plan(args.plan)
        try:
            nnodes = int(str(args.nnodes).split(":")[-1])
            nproc = None if args.nproc_per_node is None else int(args.nproc_per_node)
        except ValueError:
            raise LaunchError(
                f"--nnodes {args.nnodes!r} / --nproc-per-node {args.nproc_per_node!r} must be "
                "whole numbers"
            ) from None
        count = processes_per_node(plan.world_size, nnodes=nnodes, nproc_per_node=nproc)
        validate_plan_schedule(plan, [validation_bound(plan)], source=args.plan)
        print(count)
    except PipedreamError as exc:
        print(f"launch.sh: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
