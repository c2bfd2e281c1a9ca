"""A plan's pipeline spec, and checking its tables before anything is launched (pure code).

:func:`spec_from_plan` is the one place a plan becomes a :class:`PipelineSpec`: the runtime, the
simulator and the trace reader all go through it, with the stage pairs that exchange tensors
(skip connections) and the tied-parameter pairs they know of. ``launch.sh`` validates the tables
through ``pipedream.runtime.launch_check`` before torchrun starts, and every rank again before
joining the process group, so an invalid action table never reaches the network.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pipedream.errors import ScheduleError
from pipedream.schedules.host_waits import posting_for
from pipedream.schedules.posting import Posting
from pipedream.schedules.spec import PipelineSpec
from pipedream.schedules.tables import build_tables
from pipedream.schedules.validate import validate_tables

if TYPE_CHECKING:  # the plan format validates schedules with this package
    from pipedream.formats.plan import Plan

__all__ = [
    "MAX_STAGES_PER_RANK",
    "MAX_TABLE_ACTIONS",
    "actions_per_minibatch",
    "VALIDATION_MINIBATCHES",
    "message_routes",
    "plan_posting",
    "spec_from_plan",
    "validate_plan_schedule",
    "validation_bound",
]

VALIDATION_MINIBATCHES = 64
"""Segments longer than this (rounded up to the replica multiple) are validated at this length."""

MAX_STAGES_PER_RANK = 16
"""Stages one rank may run (the runtime's message tags have room for this many squared stage
pairs between two ranks)."""


MAX_TABLE_ACTIONS = 10_000_000
"""Actions one rank's table may hold for a stretch of a run between checkpoints. A rank builds
the whole table, and what it derives from it, before the stretch's first step: about 200 bytes
an action, so this many take about 2 GB of host memory per rank."""


def spec_from_plan(
    plan: Plan,
    first: int,
    count: int,
    edges: tuple[tuple[int, int], ...] | None = None,
    tied: tuple[tuple[int, int], ...] = (),
    *,
    global_norm: bool = False,
) -> PipelineSpec:
    """The schedule generator's view of ``count`` minibatches of ``plan`` from ``first`` on.

    ``edges`` are the stage pairs that exchange tensors (None: a plain chain); ``tied`` the
    (owner, copy) stage pairs of tied parameters; ``global_norm``: every update waits for
    the whole model's gradient norm (clipping, fp16).
    """
    return PipelineSpec(
        schedule=plan.schedule,
        stage_ranks=tuple(stage.ranks for stage in plan.stages),
        microbatches=plan.microbatches,
        num_minibatches=count,
        first_minibatch=first,
        edges=edges,
        tied=tied,
        global_norm=global_norm,
    )


def actions_per_minibatch(plan: Plan) -> int:
    """The most actions any rank's table holds per minibatch of ``plan`` (its stages as a plain
    chain: a skip connection adds its messages). Every microbatch and every minibatch puts the
    same actions in a table wherever it falls, so a table of ``k`` minibatches holds ``k``
    times this."""
    multiple = plan.steps_multiple
    return -(-_longest_table(spec_from_plan(plan, 0, multiple)) // multiple)


@functools.lru_cache(maxsize=64)
def _longest_table(spec: PipelineSpec) -> int:
    """The most actions any rank's table of ``spec`` holds, remembered: each rank checks the
    stretches of its run twice (before and after it knows where a resumed run starts)."""
    return max(len(table) for table in build_tables(spec).values())


def validation_bound(plan: Plan) -> int:
    multiple = plan.steps_multiple
    return multiple * math.ceil(max(VALIDATION_MINIBATCHES, 4 * plan.world_size) / multiple)


def validate_plan_schedule(
    plan: Plan,
    counts: Iterable[int],
    *,
    source: str,
    edges: tuple[tuple[int, int], ...] | None = None,
    tied: tuple[tuple[int, int], ...] = (),
    in_order: bool = False,
    global_norm: bool = False,
) -> Posting:
    """Validate every rank's action table for segments of each of ``counts`` minibatches, and
    return the posting the runtime runs them with (as :func:`plan_posting`, from the same
    tables; ``in_order``: NCCL's discipline; ``global_norm``: the tables of a run whose updates
    wait for the whole model's gradient norm).

    Tables are shift-invariant in the minibatch index and periodic after the warm-up, so a
    segment longer than :func:`validation_bound` is validated at that bound: the check covers the
    exact plan and schedule without building millions of actions.
    """
    for rank in range(plan.world_size):
        stages = len(plan.stages_of_rank(rank))
        if stages > MAX_STAGES_PER_RANK:
            raise ScheduleError(
                f"{source}: rank {rank} runs {stages} stages; the runtime takes at most "
                f"{MAX_STAGES_PER_RANK} per rank (fewer, larger stages)"
            )
    bound = validation_bound(plan)
    posting = Posting()
    for count in sorted(set(counts)):
        spec = spec_from_plan(plan, 0, min(count, bound), edges, tied, global_norm=global_norm)
        try:
            tables = build_tables(spec)
            validate_tables(spec, tables)
        except ScheduleError as exc:
            raise ScheduleError(f"{source}: the action tables are invalid: {exc}") from None
        posting = posting_for(tables, in_order=in_order, start=posting)
    return posting


def message_routes(
    plan: Plan,
    *,
    edges: tuple[tuple[int, int], ...] | None = None,
    tied: tuple[tuple[int, int], ...] = (),
) -> list[tuple[int, int]]:
    """Every (sender, receiver) pair of ranks that ``plan``'s tables send messages between,
    sorted (the NCCL transport gives each its own process group, which every rank must create
    in the same order). Read from tables of :func:`validation_bound` minibatches, which hold
    every route: a replica is chosen by the minibatch modulo the stage's replicas."""
    spec = spec_from_plan(plan, 0, validation_bound(plan), edges, tied)
    routes = {
        (rank, action.peer)
        for rank, table in build_tables(spec).items()
        for action in table
        if action.op.is_send and action.peer is not None and action.peer != rank
    }
    return sorted(routes)


def plan_posting(
    plan: Plan,
    counts: Iterable[int],
    *,
    in_order: bool,
    edges: tuple[tuple[int, int], ...] | None = None,
    tied: tuple[tuple[int, int], ...] = (),
) -> Posting:
    """The posting the runtime runs segments of each of ``counts`` minibatches with: the
    default, or the first doubling of it under which no rank's host waits forever for its sends
    (:func:`~pipedream.schedules.host_waits.posting_for`; ``in_order``: NCCL's discipline),
    read from tables of at most :func:`validation_bound` minibatches, as they are validated
    (:func:`validate_plan_schedule` returns it, from the tables it checks)."""
    bound = validation_bound(plan)
    posting = Posting()
    for count in sorted(set(counts)):
        spec = spec_from_plan(plan, 0, min(count, bound), edges, tied)
        posting = _spec_posting(spec, in_order, posting)
    return posting


@functools.lru_cache(maxsize=256)
def _spec_posting(spec: PipelineSpec, in_order: bool, start: Posting) -> Posting:
    """:func:`posting_for` of ``spec``'s tables, remembered: the simulator asks for the same
    plans' again and again."""
    return posting_for(build_tables(spec), in_order=in_order, start=start)
