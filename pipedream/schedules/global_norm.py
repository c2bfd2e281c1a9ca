"""Updates that wait for the whole model's gradient norm, as tables: where each rank takes part.

Two things need the norm of the *whole model's* gradient of an update. Gradient clipping: a
plain loop's ``clip_grad_norm_(model.parameters(), c)`` scales the gradient by
``min(1, c / (||g|| + 1e-6))``. And fp16's loss scaling, which skips an update where any
gradient overflowed, on every stage at once. Split over ranks, both need every stage's gradient
of the update: each rank adds its stages' squared norms (and its overflows) in one allreduce
over all ranks (a ``C`` action), then scales its own gradients, or skips, and runs its updates.
So ``C`` of update ``k`` must come after every gradient of ``k`` on its rank (backwards, the
tied copies' gradients received, the replicas' allreduce) and before the rank's first ``U`` of
``k``.

That is a rule only the flush schedules can keep: under ``pipedream``, ``pipedream-vs`` and
``2bw`` a stage updates while earlier stages still run the minibatch's backwards, so a whole
model's gradient of one minibatch never exists at one time (but for a plan of one stage,
whose gradient is the model's under any schedule). It also needs one update count for all
stages, hence every stage with the same number of replicas (then update ``k`` of every stage
applies the same minibatches). :func:`global_norm_problem` says why a spec cannot take it.

Pure code, no torch: :func:`with_global_norm` rewrites tables that :func:`build_tables` made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipedream.schedules.actions import Action, Op
from pipedream.schedules.registry import SCHEDULES, lookup
from pipedream.schedules.spec import PipelineSpec

__all__ = ["global_norm_problem", "update_of", "with_global_norm"]

_AFTER_CLIP = (Op.UPDATE, Op.SEND_WEIGHTS)
"""What must wait for the norm: the updates, and the new versions they make."""


def global_norm_problem(spec: PipelineSpec) -> str:
    """Why ``spec``'s updates cannot wait for the whole model's gradient norm, to clip it or
    for fp16's overflow check ("" where they can)."""
    schedule = lookup(spec.schedule)
    if spec.num_stages == 1:  # the stage's gradient is the model's, under any schedule
        return ""
    if schedule.asynchronous:
        flushing = sorted(name for name, s in SCHEDULES.items() if not s.asynchronous)
        return (
            f"schedule {spec.schedule!r} updates each stage while earlier stages still run the "
            "minibatch's backwards, so the whole model's gradient of a minibatch never exists "
            f"at once; use a schedule that flushes ({', '.join(flushing)}): plan with "
            "--schedule 1f1b, or set schedule: 1f1b in the plan"
        )
    counts = [spec.replicas(stage) for stage in range(spec.num_stages)]
    if len(set(counts)) > 1:
        return (
            "every stage must update on the same minibatches, so have the same number of "
            f"replicas; this plan's stages have {counts}: plan with --straight (one replica "
            "each), or give every stage the same replicas"
        )
    return ""


def update_of(spec: PipelineSpec, action: Action) -> int | None:
    """The update an action of a clipped spec belongs to (None: a version receive, which
    belongs to the forward after it). Every stage has ``r`` replicas, so minibatch ``t`` is
    closed by update ``t // r`` of every stage."""
    r = spec.replicas(action.stage)
    op = action.op
    if op in (Op.UPDATE, Op.ALLREDUCE, Op.CLIP):
        return action.index
    if op in (Op.SEND_TIED_GRAD, Op.RECV_TIED_GRAD):  # they name the minibatch
        return action.index // r
    if op is Op.SEND_WEIGHTS:  # the version the update makes
        return action.index - 1
    if op is Op.RECV_WEIGHTS:
        return None
    return action.index // spec.microbatches // r  # a microbatch


def with_global_norm(
    spec: PipelineSpec, tables: Mapping[int, Sequence[Action]]
) -> dict[int, list[Action]]:
    """Each rank's table with a ``C`` per update: right after the rank's last action of the
    update that is not an ``U`` or ``SW`` (its last gradient work), and those ``U`` and ``SW``
    that came earlier moved after it, in their order. The rest keeps its order."""
    return {rank: _clipped(spec, rank, table) for rank, table in tables.items()}


def _clipped(spec: PipelineSpec, rank: int, table: Sequence[Action]) -> list[Action]:
    last_work: dict[int, int] = {}
    for position, action in enumerate(table):
        update = update_of(spec, action)
        if update is not None and action.op not in _AFTER_CLIP:
            last_work[update] = position
    first_stage = min(spec.stages_of_rank(rank))
    held: dict[int, list[Action]] = {}
    out: list[Action] = []
    for position, action in enumerate(table):
        update = update_of(spec, action)
        if action.op in _AFTER_CLIP and update is not None and position < last_work[update]:
            held.setdefault(update, []).append(action)
            continue
        if held and update is not None and update > min(held):
            # internal: a later update's work would overtake an update held for the norm
            raise AssertionError(f"rank {rank}: {action} before the norm of update {min(held)}")
        out.append(action)
        if update is not None and last_work.get(update) == position:
            out.append(Action(Op.CLIP, first_stage, update))
            out += held.pop(update, [])
    assert not held, (rank, held)
    return out
