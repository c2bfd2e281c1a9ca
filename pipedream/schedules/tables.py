"""Schedule generation: (schedule, stages, replicas, microbatches) -> one action list per rank.

Pure code, no torch. The tables are what every interpreter runs (see ``actions.py``). Each
rank's table is built in three passes:

1. the *compute order* of forwards and backwards for each stage replica, with its minibatches'
   closes, which is where the schedules differ (:attr:`Schedule.order`); each close becomes the
   update and what goes with it (allreduce, tied-parameter exchanges);
2. the *weight version* of every forward and backward (:attr:`Schedule.version`: the
   schedule's update rule as data);
3. *communication*: a receive right before each forward/backward that needs remote data and a
   send right after each one that produces it (the executor posts receives ahead of time).

Minibatch t goes to replica ``t mod r_s`` of stage s. A replicated stage averages gradients with
its replicas (``A``) before every update, so it updates once per ``r_s`` minibatches.

A tied parameter used by several stages belongs to the first of them (its *owner*); every
later one holds a copy. Each forward of a copy uses the version of the tensor that the owner
uses for the same microbatch, so one microbatch sees one value of the tensor everywhere: after
the last backward of minibatch ``t`` the copy's replica sends its copy's gradient to the owner's
replica of ``t``, which adds it to its own before its update (``SG``/``RG``), and the owner
sends every new version to the copies (``SW``; owner replica ``j`` to the copy replicas ``k``
with ``k mod r_owner = j``), which receive it right before the first forward that uses it
(``RW``)::

    pipedream, S = 2, stage 0 owns the embedding that stage 1's head reuses:
    stage 0:  F0 F1 B0 RG0 U0 SW1 F2 B1 RG1 U1 SW2 F3 ...   forward t on version max(0, t - 1)
    stage 1:     F0 B0 SG0 U0 F1 B1 SG1 U1 RW1 F2 ...       its copy on the same versions
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import groupby

from pipedream.schedules.actions import Action, Op
from pipedream.schedules.global_norm import with_global_norm
from pipedream.schedules.registry import lookup
from pipedream.schedules.schedule import CLOSE, RankEntry, replica_minibatches
from pipedream.schedules.spec import PipelineSpec

__all__ = ["build_tables", "compute_order", "forward_versions"]


def compute_order(spec: PipelineSpec, stage: int, replica: int) -> list[tuple[Op, int]]:
    """F, B, A and U of one stage replica, in execution order, with the tied-parameter
    exchanges around its updates (SG, RG, SW; no other communication yet).

    F/B carry microbatch indices, A/U carry the minibatch index of the update's last minibatch
    divided by the replica count (the replica-group's update number, counted from
    ``first_minibatch``), SG/RG the minibatch whose tied gradient they move, SW the version
    the update makes (its number + 1).
    """
    minibatches = replica_minibatches(spec, stage, replica)
    local_of = {k: i for i, k in enumerate(minibatches)}
    replicated = spec.replicas(stage) > 1
    holds_copies = bool(spec.tie_owners(stage))
    owns_tied = bool(spec.tie_copies(stage))
    order: list[tuple[Op, int]] = []
    for op, index in lookup(spec.schedule).order(spec, stage, minibatches):
        if op is not CLOSE:
            order.append((op, index))
            continue
        update = spec.first_minibatch // spec.replicas(stage) + local_of[index]
        if holds_copies:
            order.append((Op.SEND_TIED_GRAD, index))
        if owns_tied:
            order.append((Op.RECV_TIED_GRAD, index))
        if replicated:
            order.append((Op.ALLREDUCE, update))
        order.append((Op.UPDATE, update))
        if owns_tied:
            order.append((Op.SEND_WEIGHTS, update + 1))
    return order


def forward_versions(spec: PipelineSpec, stage: int, replica: int) -> dict[int, int]:
    """Microbatch -> the weight version its forward (and backward) uses at a stage replica."""
    version_of = lookup(spec.schedule).version
    updates_done = spec.first_minibatch // spec.replicas(stage)
    versions: dict[int, int] = {}
    for op, index in compute_order(spec, stage, replica):
        if op is Op.FORWARD:
            versions[index] = version_of(spec, stage, index, updates_done)
            assert versions[index] <= updates_done, (spec, stage, index, versions[index])
        elif op is Op.UPDATE:
            updates_done += 1
    return versions


def build_tables(
    spec: PipelineSpec, *, only_ranks: Collection[int] | None = None
) -> dict[int, list[Action]]:
    """One action list per global rank for the whole run (or just for ``only_ranks``)."""
    spec.validate()
    tables: dict[int, list[Action]] = {}
    if lookup(spec.schedule).rank_order is not None:
        for rank in range(spec.world_size):
            if only_ranks is None or rank in only_ranks:
                tables[rank] = _rank_table(spec, rank)
    else:
        for stage, ranks in enumerate(spec.stage_ranks):
            for replica, rank in enumerate(ranks):
                if only_ranks is None or rank in only_ranks:
                    tables[rank] = _table(spec, stage, replica)
    return with_global_norm(spec, tables) if spec.global_norm else tables


def _table(spec: PipelineSpec, stage: int, replica: int) -> list[Action]:
    """One stage replica's table: its compute order with the communication around it."""
    table: list[Action] = []
    versions = forward_versions(spec, stage, replica)
    receiver = _VersionReceiver(spec, spec.stage_ranks[stage][replica], table)
    for op, index in compute_order(spec, stage, replica):
        if op is Op.FORWARD:
            receiver.before_forward(stage, index)
        if op.is_compute:
            table += _with_messages(spec, op, stage, index, versions[index])
        elif op is Op.SEND_TIED_GRAD:  # to the owners' replicas of minibatch `index`
            table += _tied_gradients_sent(spec, stage, index)
        elif op is Op.RECV_TIED_GRAD:
            table += _tied_gradients_received(spec, stage, index)
        elif op is Op.SEND_WEIGHTS:
            table += _versions_sent(spec, stage, replica, index)
        else:
            table.append(Action(op, stage, index))
    receiver.finish()  # the copies end as the owners' final tensors
    return table


def _with_messages(
    spec: PipelineSpec, op: Op, stage: int, index: int, version: int
) -> list[Action]:
    """A forward, backward or backward half of microbatch ``index`` at ``stage`` with its
    messages: the activations it needs received before a forward and its own sent after it;
    the output gradients received before a backward (B or I) and the input gradients sent
    after it. A weight-gradient half (W) exchanges nothing."""
    minibatch = index // spec.microbatches
    before: list[Action] = []
    after: list[Action] = []
    if op is Op.FORWARD:
        for producer in spec.producers(stage):
            peer = spec.rank_of(producer, minibatch)
            before.append(Action(Op.RECV_ACT, stage, index, peer=peer, peer_stage=producer))
        for consumer in spec.consumers(stage):
            peer = spec.rank_of(consumer, minibatch)
            after.append(Action(Op.SEND_ACT, stage, index, peer=peer, peer_stage=consumer))
    elif op is not Op.BACKWARD_WEIGHT:
        for consumer in spec.consumers(stage):
            peer = spec.rank_of(consumer, minibatch)
            before.append(Action(Op.RECV_GRAD, stage, index, peer=peer, peer_stage=consumer))
        for producer in spec.producers(stage):
            peer = spec.rank_of(producer, minibatch)
            after.append(Action(Op.SEND_GRAD, stage, index, peer=peer, peer_stage=producer))
    return [*before, Action(op, stage, index, version=version), *after]


def _rank_table(spec: PipelineSpec, rank: int) -> list[Action]:
    """The table of a rank under a schedule that orders each rank's work (over all its stages):
    that order, each computation with its messages, each close an allreduce among the copies of
    the pipeline (when it is replicated) and an update. Forwards use the stage's weights as the
    schedule's rule says, backwards their forward's. A replicated pipeline's copy ``j`` runs
    minibatches ``j, j + r, ...`` in the order the unreplicated schedule gives its ranks.

    Tied parameters are exchanged as in :func:`_table`: each close of a stage holding copies
    sends their gradient to the owner's replica of the minibatch (``SG``), each close of an
    owner adds its copies' gradients (``RG``) before its update and sends the new version
    (``SW``), and each copy receives a version (``RW``) right before the first forward that
    uses it. Where a rank closes several stages in a row, those holding copies close first
    (highest stage first: an owner comes before its copies in the pipeline), so that an owner
    and its copy on one rank (the V's first and last stage) hand their messages over in order.
    """
    schedule = lookup(spec.schedule)
    assert schedule.rank_order is not None
    copies = spec.replicas(0)
    all_minibatches = range(spec.first_minibatch, spec.first_minibatch + spec.num_minibatches)
    if copies > 1:
        copy = spec.copy_of_rank(rank)
        view, global_of = spec.pipeline_copy(copy)
        local = global_of.index(rank)
        minibatches = [t for t in all_minibatches if t % copies == copy]
    else:
        view, local, minibatches = spec, rank, list(all_minibatches)
    first_update = spec.first_minibatch // copies
    updates_done = {stage: first_update for stage in spec.stages_of_rank(rank)}
    versions: dict[tuple[int, int], int] = {}
    table: list[Action] = []
    receiver = _VersionReceiver(spec, rank, table)
    order = schedule.rank_order(view, local, minibatches)
    for op, stage, index in _copies_close_first(order) if spec.tied else order:
        if op is CLOSE:
            table += _tied_gradients_sent(spec, stage, index)
            table += _tied_gradients_received(spec, stage, index)
            if copies > 1:
                table.append(Action(Op.ALLREDUCE, stage, updates_done[stage]))
            table.append(Action(Op.UPDATE, stage, updates_done[stage]))
            updates_done[stage] += 1
            replica = spec.stage_ranks[stage].index(rank)
            table += _versions_sent(spec, stage, replica, updates_done[stage])
            continue
        if op is Op.FORWARD:
            versions[stage, index] = schedule.version(spec, stage, index, updates_done[stage])
            receiver.before_forward(stage, index)
        table += _with_messages(spec, op, stage, index, versions[stage, index])
    receiver.finish()
    return table


def _copies_close_first(order: Sequence[RankEntry]) -> list[RankEntry]:
    """``order`` with each run of consecutive closes sorted by descending stage: a copy's
    gradient is sent before its owner (an earlier stage) waits for it on the same rank."""
    out: list[RankEntry] = []
    for closes, run in groupby(order, key=lambda entry: entry[0] is CLOSE):
        entries = list(run)
        out += sorted(entries, key=lambda entry: -entry[1]) if closes else entries
    return out


def _tied_gradients_sent(spec: PipelineSpec, stage: int, minibatch: int) -> list[Action]:
    """The sends of a stage's copies' gradients of ``minibatch`` to their owners' replicas
    of the minibatch, before its update."""
    return [
        Action(
            Op.SEND_TIED_GRAD,
            stage,
            minibatch,
            peer=spec.rank_of(owner, minibatch),
            peer_stage=owner,
        )
        for owner in spec.tie_owners(stage)
    ]


def _tied_gradients_received(spec: PipelineSpec, stage: int, minibatch: int) -> list[Action]:
    """The receives of the gradients of ``minibatch`` from the copies of a stage's tensors,
    before its update."""
    return [
        Action(
            Op.RECV_TIED_GRAD, stage, minibatch, peer=spec.rank_of(copy, minibatch), peer_stage=copy
        )
        for copy in spec.tie_copies(stage)
    ]


def _versions_sent(spec: PipelineSpec, stage: int, replica: int, version: int) -> list[Action]:
    """An owner replica's sends of the version its update made: to the copy replicas ``k``
    with ``k mod r_owner = replica`` (under whole-pipeline copies, its own copy's)."""
    return [
        Action(Op.SEND_WEIGHTS, stage, version, peer=peer, peer_stage=copy)
        for copy in spec.tie_copies(stage)
        for k, peer in enumerate(spec.stage_ranks[copy])
        if k % spec.replicas(stage) == replica
    ]


class _VersionReceiver:
    """Appends to a rank's table the receives of the owners' versions its copy stages need:
    before a copy's forward, every version up to the one its owner's forward of the same
    microbatch uses (received from the owner's replica ``k mod r_owner`` for copy replica
    ``k``); at the end, up to the owners' final versions."""

    def __init__(self, spec: PipelineSpec, rank: int, table: list[Action]) -> None:
        self.spec = spec
        self.table = table
        stages = spec.stages_of_rank(rank)
        self.replica = {stage: spec.stage_ranks[stage].index(rank) for stage in stages}
        owners = {owner for stage in stages for owner in spec.tie_owners(stage)}
        self.owner_versions = {
            owner: {
                microbatch: version
                for owner_replica in range(spec.replicas(owner))
                for microbatch, version in forward_versions(spec, owner, owner_replica).items()
            }
            for owner in owners
        }
        self.received = {
            (stage, owner): spec.first_minibatch // spec.replicas(owner)
            for stage in stages
            for owner in spec.tie_owners(stage)
        }
        """(copy stage, owner stage) -> the newest version received."""

    def before_forward(self, stage: int, microbatch: int) -> None:
        for owner in self.spec.tie_owners(stage):
            self._receive(stage, owner, self.owner_versions[owner][microbatch])

    def finish(self) -> None:
        """The versions made by the owners' last updates."""
        spec = self.spec
        for stage, owner in list(self.received):
            first = spec.first_minibatch // spec.replicas(owner)
            self._receive(stage, owner, first + spec.num_minibatches // spec.replicas(owner))

    def _receive(self, stage: int, owner: int, upto: int) -> None:
        spec, received = self.spec, self.received[stage, owner]
        assert upto >= received, (spec, stage, owner, upto)  # never backwards
        peer = spec.stage_ranks[owner][self.replica[stage] % spec.replicas(owner)]
        for version in range(received + 1, upto + 1):
            self.table.append(Action(Op.RECV_WEIGHTS, stage, version, peer=peer, peer_stage=owner))
        self.received[stage, owner] = upto
