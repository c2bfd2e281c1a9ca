"""What a schedule is: one record per schedule, which every other part of pipedream reads.

A :class:`Schedule` says everything the table builder, the runtime, the planner and the
simulator need to know about a schedule: the order in which a stage replica runs its forwards
and backwards (and where its minibatches close with an update), which weight version each
forward uses (the update rule as data), whether the pipeline flushes, how many microbatches a
minibatch may have, how many weight versions and microbatches' activations a stage keeps (the
memory model), and for schedules that order a rank's work as a whole, where its stages sit and
whether backwards split. Each schedule is one module of this package that builds its record
(``pipedream.py``, ``vertical_sync.py``, ``twobw.py``, ``onefoneb.py``, ``gpipe.py``,
``interleaved_1f1b.py``, ``zero_bubble.py``) and the registry lists them; no code outside the
package compares schedule names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipedream.schedules.actions import Op
from pipedream.schedules.spec import PipelineSpec

__all__ = [
    "CLOSE",
    "OrderEntry",
    "RankEntry",
    "Schedule",
    "interleaved",
    "one_f_one_b",
    "every_minibatch",
    "flushed_one_f_one_b",
    "replica_minibatches",
    "stage_order_of_rank_order",
]

CLOSE = Op.UPDATE
"""In a schedule's order: the minibatch of the entry's index closes (its update follows)."""

OrderEntry = tuple[Op, int]
"""``(Op.FORWARD | Op.BACKWARD, microbatch)`` or ``(CLOSE, minibatch)``."""

RankEntry = tuple[Op, int, int]
"""``(op, stage, index)``: one entry of a rank's order when the rank runs several stages; ``op``
is F, B, I or W (index: microbatch) or ``CLOSE`` (index: minibatch), each stage's minibatch
closing after the rank's last backward of it."""


@dataclass(frozen=True)
class Schedule:
    """One schedule: its update rule and what the planner and the runtime need of it."""

    name: str
    """The name plans and ``--schedule`` use."""
    summary: str
    """One line for people: the rule and what it is for."""
    asynchronous: bool
    """Minibatches overlap across updates (no flush): a stage updates while later minibatches
    are in flight, so weights are stale by the version rule. Otherwise the pipeline drains after
    every minibatch (a bubble of ``S - 1`` slots) and training is synchronous SGD."""
    order: Callable[[PipelineSpec, int, Sequence[int]], list[OrderEntry]]
    """``(spec, stage, the replica's minibatches)``: its forwards and backwards in execution
    order, each minibatch closed (``CLOSE``) right after its last backward."""
    version: Callable[[PipelineSpec, int, int, int], int]
    """``(spec, stage, microbatch, updates done before the forward)``: the weight version the
    forward (and its backward) of ``microbatch`` uses."""
    in_flight: Callable[[int, int, int], int]
    """``(microbatches, stages from this one on, PipeDream's warm-up depth + 1)``: the most
    microbatches whose activations a replica of a stage holds at once."""
    memory_key: Callable[[int, int, int], object]
    """``(workers after the unit, replicas of the unit, microbatches)``: what of a unit's
    placement :attr:`in_flight` depends on (equal keys, equal estimates: the planner solves an
    inner level once per key)."""
    versions_kept: int | None
    """Weight versions a stage keeps, the live one included (None: one per microbatch in
    flight, weight stashing)."""
    one_microbatch: bool = False
    """A minibatch is exactly one microbatch (gradient accumulation is another schedule's)."""
    microbatches_at_least_stages: bool = False
    """A minibatch needs at least as many microbatches as the pipeline has stages."""
    vertical_sync: bool = False
    """Every stage computes a minibatch on the version stage 0 used for it; the version tag
    that travels with the activations is checked."""
    auto_rank: int = 0
    """Preference of ``pipedream plan --schedule auto`` among equally fast plans (lower first)."""
    placement: Callable[[int, int], list[int]] | None = None
    """``(stages, ranks)`` -> the rank of every stage, for schedules that run several stages
    per rank (interleaved, V); None: one stage per rank, as the plan places them."""
    rank_order: Callable[[PipelineSpec, int, Sequence[int]], list[RankEntry]] | None = None
    """``(spec, rank, minibatches)``: the rank's computation over all its stages, in execution
    order (schedules with a :attr:`placement`; the others give each stage's :attr:`order`)."""

    splits_backward: bool = False
    """Backwards run as an input-gradient half ``I`` and a later weight-gradient half ``W``."""
    bubble_slots: Callable[[int], float] | None = None
    """``stages`` -> the idle slots (of one forward and backward) a minibatch adds in the
    planner's formula; None: ``S - 1`` for a schedule that flushes, else none."""
    spec_problem: Callable[[PipelineSpec], str] | None = None
    """Why a pipeline's shape does not suit this schedule ("" when it does), beyond the
    microbatch rules above (say, microbatches that must be a multiple of the ranks)."""

    @property
    def several_stages_per_rank(self) -> bool:
        return self.placement is not None

    @property
    def replicates(self) -> bool:
        """Whether the planner may replicate a stage alone (schedules that order whole ranks
        replicate only whole copies of the pipeline, every stage as often)."""
        return self.rank_order is None

    def drain_slots(self, num_stages: int) -> float:
        """Idle slots per minibatch in the planner's formula (the fill and drain bubble)."""
        if self.bubble_slots is not None:
            return self.bubble_slots(num_stages)
        return num_stages - 1 if self.flushes else 0

    @property
    def flushes(self) -> bool:
        """The pipeline drains after every minibatch."""
        return not self.asynchronous

    def microbatches_problem(self, microbatches: int, num_stages: int) -> str:
        """Why ``microbatches`` per minibatch do not suit this schedule ("" when they do)."""
        if self.one_microbatch and microbatches != 1:
            return (
                f"schedule {self.name!r} takes one microbatch per minibatch, got "
                f"{microbatches}; use '2bw' for gradient accumulation"
            )
        if self.microbatches_at_least_stages and microbatches < num_stages:
            return (
                f"schedule {self.name!r} needs microbatches >= stages ({num_stages}), "
                f"got {microbatches}"
            )
        return ""

    def weight_versions(self, in_flight: int) -> int:
        """Weight versions a replica keeps when ``in_flight`` microbatches are in flight."""
        return in_flight if self.versions_kept is None else self.versions_kept


def replica_minibatches(spec: PipelineSpec, stage: int, replica: int) -> list[int]:
    """The minibatches replica ``replica`` of ``stage`` runs: those ``t`` with
    ``t mod replicas = replica`` (1F1B-RR), counted from minibatch 0 as
    :meth:`PipelineSpec.rank_of` counts them, also where the stretch starts elsewhere (a run
    resumed from a checkpoint at a step that is not a multiple of ``replicas``, one written
    under another plan): counted from ``first_minibatch``, the replicas' tables disagreed with
    the messages' routes and the run hung."""
    r = spec.replicas(stage)
    first = spec.first_minibatch
    return [t for t in range(first, first + spec.num_minibatches) if t % r == replica]


def one_f_one_b(items: Sequence[int], warmup: int) -> list[OrderEntry]:
    """1F1B over ``items``: ``warmup`` forwards, then F/B alternating, then the remaining Bs."""
    order: list[OrderEntry] = []
    warmup = min(warmup, len(items))
    for i in range(warmup):
        order.append((Op.FORWARD, items[i]))
    for i in range(warmup, len(items)):
        order.append((Op.FORWARD, items[i]))
        order.append((Op.BACKWARD, items[i - warmup]))
    for i in range(max(len(items) - warmup, 0), len(items)):
        order.append((Op.BACKWARD, items[i]))
    return order


def flushed_one_f_one_b(
    spec: PipelineSpec, stage: int, minibatches: Sequence[int]
) -> list[OrderEntry]:
    """1F1B within each minibatch (``S - 1 - s`` forwards of warm-up), drained before the
    next one starts."""
    m = spec.microbatches
    order: list[OrderEntry] = []
    for k in minibatches:
        order.extend(one_f_one_b([k * m + j for j in range(m)], spec.num_stages - 1 - stage))
        order.append((CLOSE, k))
    return order


def interleaved(spec: PipelineSpec, minibatches: Sequence[int], warmup: int) -> list[OrderEntry]:
    """1F1B across minibatch boundaries (no flush): every minibatch closes right after the
    backward of its last microbatch."""
    m = spec.microbatches
    micro = [k * m + j for k in minibatches for j in range(m)]
    order: list[OrderEntry] = []
    for op, index in one_f_one_b(micro, warmup):
        order.append((op, index))
        if op is Op.BACKWARD and index % m == m - 1:
            order.append((CLOSE, index // m))
    return order


def every_minibatch(
    one: Sequence[tuple[Op, int, int]], minibatches: Sequence[int], microbatches: int
) -> list[RankEntry]:
    """A flushing rank order: ``one`` minibatch's ``(op, stage, microbatch)`` order repeated
    for each of ``minibatches``, each closing every stage it ran at its end."""
    stages = sorted({stage for _, stage, _ in one})
    order: list[RankEntry] = []
    for k in minibatches:
        order += [(op, stage, k * microbatches + j) for op, stage, j in one]
        order += [(CLOSE, stage, k) for stage in stages]
    return order


def stage_order_of_rank_order(
    rank_order: Callable[[PipelineSpec, int, Sequence[int]], list[RankEntry]],
) -> Callable[[PipelineSpec, int, Sequence[int]], list[OrderEntry]]:
    """A several-stages-per-rank schedule's :attr:`Schedule.order`: the stage's entries of its
    rank's order (for a replica: its rank's order in its copy of the pipeline)."""

    def order(spec: PipelineSpec, stage: int, minibatches: Sequence[int]) -> list[OrderEntry]:
        copies = spec.replicas(stage)
        if copies == 1:
            view, rank = spec, spec.stage_ranks[stage][0]
        else:  # a replica of a whole-pipeline copy: its rank's order in that copy
            copy = minibatches[0] % copies if minibatches else 0
            view, global_of = spec.pipeline_copy(copy)
            rank = global_of.index(spec.stage_ranks[stage][copy])
        return [(op, index) for op, s, index in rank_order(view, rank, minibatches) if s == stage]

    return order
