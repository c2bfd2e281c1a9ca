"""Schedules as data, with no torch: everything pipedream knows about a pipeline schedule.

A :class:`Schedule` record per schedule (``pipedream``, ``pipedream-vs``, ``2bw``, ``1f1b``,
``gpipe``, ``interleaved-1f1b``, ``zb-h1``, ``zbv``; :data:`SCHEDULES`) says its update rule and
what the planner and the runtime need of it; :func:`build_tables` turns a
:class:`PipelineSpec` (a plan's stages, replicas, microbatches, skip edges, tied parameters;
:func:`spec_from_plan`) into one list of
:class:`Action` per rank, which the distributed executor, the single-process reference
executor, the simulator and the profiler's overhead measurement all run;
:func:`validate_tables` checks tables before anything runs; :func:`receives_posted_before` and
:func:`version_use` are the rules the executor and the simulator share for posting receives
ahead and stashing weight versions, and :func:`posting_for` sizes the posting (a
:class:`Posting`) so that no rank waits forever for its sends.
"""

from pipedream.schedules.actions import (
    MATCHING_RECEIVE,
    MESSAGE_KIND,
    RECEIVES,
    SENDS,
    Action,
    Op,
    parse_action,
)
from pipedream.schedules.host_waits import host_stall, posting_for
from pipedream.schedules.plan_spec import (
    MAX_STAGES_PER_RANK,
    MAX_TABLE_ACTIONS,
    VALIDATION_MINIBATCHES,
    actions_per_minibatch,
    message_routes,
    plan_posting,
    spec_from_plan,
    validate_plan_schedule,
    validation_bound,
)
from pipedream.schedules.posting import (
    MESSAGES_IN_FLIGHT,
    RECEIVE_WINDOW,
    Posting,
    receives_posted_before,
)
from pipedream.schedules.registry import SCHEDULES, lookup
from pipedream.schedules.schedule import Schedule
from pipedream.schedules.spec import MAX_MICROBATCHES, PipelineSpec, warmup_depth
from pipedream.schedules.tables import build_tables, compute_order, forward_versions
from pipedream.schedules.validate import format_grid, simulate_dependencies, validate_tables
from pipedream.schedules.versions import VersionUse, version_use

__all__ = [
    "MATCHING_RECEIVE",
    "MESSAGES_IN_FLIGHT",
    "MESSAGE_KIND",
    "RECEIVES",
    "RECEIVE_WINDOW",
    "SCHEDULES",
    "SENDS",
    "MAX_MICROBATCHES",
    "MAX_STAGES_PER_RANK",
    "MAX_TABLE_ACTIONS",
    "VALIDATION_MINIBATCHES",
    "Action",
    "actions_per_minibatch",
    "Op",
    "PipelineSpec",
    "Posting",
    "Schedule",
    "VersionUse",
    "build_tables",
    "compute_order",
    "format_grid",
    "forward_versions",
    "host_stall",
    "lookup",
    "message_routes",
    "parse_action",
    "plan_posting",
    "posting_for",
    "receives_posted_before",
    "simulate_dependencies",
    "spec_from_plan",
    "validate_plan_schedule",
    "validate_tables",
    "validation_bound",
    "version_use",
    "warmup_depth",
]
