"""Schedule generation: (schedule, stages, replicas, microbatches) -> one action list per rank.

Pure code, no torch. The tables are what every interpreter runs (see ``actions.py``). Each
rank's table is built in three passes:

1. the *compute order* of forwards, backwards, allreduces and updates for each stage replica,
   which is where the schedules differ;
2. the *weight version* of every forward and backward (the schedule's update rule as data);
3. *communication*: a receive right before each forward/backward that needs remote data and a
   send right after each one that produces it (the executor posts receives ahead of time).

PipeDream's 1F1B for S = 3 stages, one microbatch per minibatch (``pipedream``)::

    stage 0:  F0 F1 F2 B0 U F3 B1 U F4 B2 U ...      warm-up w_0 = 2
    stage 1:     F0 F1 B0 U F2 B1 U F3 B2 U ...      warm-up w_1 = 1
    stage 2:        F0 B0 U F1 B1 U F2 B2 U ...      warm-up w_2 = 0

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
from dataclasses import dataclass

from pipedream.errors import ScheduleError
from pipedream.runtime.actions import Action, Op

__all__ = [
    "SUPPORTED_SCHEDULES",
    "PipelineSpec",
    "build_tables",
    "compute_order",
    "forward_versions",
    "warmup_depth",
]

SUPPORTED_SCHEDULES = ("pipedream", "pipedream-vs", "2bw", "1f1b", "gpipe")


@dataclass(frozen=True)
class PipelineSpec:
    """The shape of a pipeline run: what the schedule generator needs to know."""

    schedule: str
    """Schedule name (DESIGN.md section 7)."""
    stage_ranks: tuple[tuple[int, ...], ...]
    """Global ranks of each stage's replicas, in pipeline order."""
    microbatches: int
    """Microbatches per minibatch."""
    num_minibatches: int
    """Minibatches to run (K); every replicated stage needs K to be a multiple of its replicas."""
    first_minibatch: int = 0
    """Index of the first minibatch (for resumed runs; only shifts the indices)."""
    edges: tuple[tuple[int, int], ...] | None = None
    """(producer stage, consumer stage) pairs that exchange tensors; None: each stage with the
    next. A skip connection adds a pair (s, s + k), k > 1: the tensor is sent directly."""
    tied: tuple[tuple[int, int], ...] = ()
    """(owner stage, copy stage) pairs: the copy stage holds copies of tied parameters that
    the owner stage (the first stage using them) owns (see the module docstring)."""

    def tie_owners(self, stage: int) -> list[int]:
        """The stages that own the tied tensors ``stage`` holds copies of."""
        return sorted({owner for owner, copy in self.tied if copy == stage})

    def tie_copies(self, stage: int) -> list[int]:
        """The stages that hold copies of tensors ``stage`` owns."""
        return sorted({copy for owner, copy in self.tied if owner == stage})

    def producers(self, stage: int) -> list[int]:
        if self.edges is None:
            return [stage - 1] if stage > 0 else []
        return sorted({p for p, c in self.edges if c == stage})

    def consumers(self, stage: int) -> list[int]:
        if self.edges is None:
            return [stage + 1] if stage < self.num_stages - 1 else []
        return sorted({c for p, c in self.edges if p == stage})

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.stage_ranks)

    def replicas(self, stage: int) -> int:
        return len(self.stage_ranks[stage])

    def rank_of(self, stage: int, minibatch: int) -> int:
        """The rank whose replica of ``stage`` runs ``minibatch``."""
        ranks = self.stage_ranks[stage]
        return ranks[minibatch % len(ranks)]

    def validate(self) -> None:
        if self.schedule not in SUPPORTED_SCHEDULES:
            raise ScheduleError(
                f"unknown schedule {self.schedule!r}; use one of {', '.join(SUPPORTED_SCHEDULES)}"
            )
        if self.num_stages < 1:
            raise ScheduleError("a pipeline needs at least one stage")
        if self.microbatches < 1:
            raise ScheduleError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.schedule in ("pipedream", "pipedream-vs") and self.microbatches != 1:
            raise ScheduleError(
                f"schedule {self.schedule!r} takes one microbatch per minibatch, got "
                f"{self.microbatches}; use '2bw' for gradient accumulation"
            )
        if self.schedule == "2bw" and self.microbatches < self.num_stages:
            raise ScheduleError(
                f"schedule '2bw' needs microbatches >= stages ({self.num_stages}), "
                f"got {self.microbatches}"
            )
        if self.num_minibatches < 0:
            raise ScheduleError(f"number of minibatches must be >= 0, got {self.num_minibatches}")
        for stage, ranks in enumerate(self.stage_ranks):
            if not ranks:
                raise ScheduleError(f"stage {stage} has no ranks")
            if self.num_minibatches % len(ranks):
                raise ScheduleError(
                    f"stage {stage} has {len(ranks)} replicas, so the number of minibatches "
                    f"({self.num_minibatches}) must be a multiple of {len(ranks)}"
                )
        for producer, consumer in self.edges or ():
            if not 0 <= producer < consumer < self.num_stages:
                raise ScheduleError(
                    f"edge ({producer}, {consumer}) must go forward between existing stages"
                )
        flat = [rank for ranks in self.stage_ranks for rank in ranks]
        if sorted(flat) != list(range(len(flat))):
            raise ScheduleError(f"ranks must be 0..{len(flat) - 1}, each once; got {flat}")
        for owner, copy in self.tied:
            if not 0 <= owner < copy < self.num_stages:
                raise ScheduleError(
                    f"tied pair ({owner}, {copy}) must name an owner stage before a copy stage"
                )


def warmup_depth(spec: PipelineSpec, stage: int) -> int:
    """Forwards a replica of ``stage`` runs before its first backward (in its own minibatches).

    PipeDream's rule: ``(world_size - 1 - sum of replicas of earlier stages) // r_s``; for a
    straight pipeline this is ``S - 1 - s``.
    """
    earlier = sum(spec.replicas(s) for s in range(stage))
    return (spec.world_size - 1 - earlier) // spec.replicas(stage)


def _replica_minibatches(spec: PipelineSpec, stage: int, replica: int) -> list[int]:
    r = spec.replicas(stage)
    first = spec.first_minibatch
    return [first + k for k in range(spec.num_minibatches) if k % r == replica]


def _one_f_one_b(items: Sequence[int], warmup: int) -> list[tuple[Op, int]]:
    """1F1B over ``items``: ``warmup`` forwards, then F/B alternating, then the remaining Bs."""
    order: list[tuple[Op, int]] = []
    warmup = min(warmup, len(items))
    for i in range(warmup):
        order.append((Op.FORWARD, items[i]))
    for i in range(warmup, len(items)):
        order.append((Op.FORWARD, items[i]))
        order.append((Op.BACKWARD, items[i - warmup]))
    for i in range(max(len(items) - warmup, 0), len(items)):
        order.append((Op.BACKWARD, items[i]))
    return order


def compute_order(spec: PipelineSpec, stage: int, replica: int) -> list[tuple[Op, int]]:
    """F, B, A and U of one stage replica, in execution order, with the tied-parameter
    exchanges around its updates (SG, RG, SW; no other communication yet).

    F/B carry microbatch indices, A/U carry the minibatch index of the update's last minibatch
    divided by the replica count (the replica-group's update number, counted from
    ``first_minibatch``), SG/RG the minibatch whose tied gradient they move, SW the version
    the update makes (its number + 1).
    """
    m = spec.microbatches
    minibatches = _replica_minibatches(spec, stage, replica)
    replicated = spec.replicas(stage) > 1
    order: list[tuple[Op, int]] = []

    holds_copies = bool(spec.tie_owners(stage))
    owns_tied = bool(spec.tie_copies(stage))

    def close_minibatch(local: int) -> None:
        update = spec.first_minibatch // spec.replicas(stage) + local
        if holds_copies:
            order.append((Op.SEND_TIED_GRAD, minibatches[local]))
        if owns_tied:
            order.append((Op.RECV_TIED_GRAD, minibatches[local]))
        if replicated:
            order.append((Op.ALLREDUCE, update))
        order.append((Op.UPDATE, update))
        if owns_tied:
            order.append((Op.SEND_WEIGHTS, update + 1))

    if spec.schedule in ("pipedream", "pipedream-vs", "2bw"):
        # Asynchronous: 1F1B across minibatch boundaries, no flush. An update follows the
        # backward of the last microbatch of each minibatch.
        micro = [k * m + j for k in minibatches for j in range(m)]
        warmup = warmup_depth(spec, stage) if m == 1 else spec.num_stages - 1 - stage
        local_of = {k: i for i, k in enumerate(minibatches)}
        for op, mb in _one_f_one_b(micro, warmup):
            order.append((op, mb))
            if op is Op.BACKWARD and mb % m == m - 1:
                close_minibatch(local_of[mb // m])
        return order

    # Synchronous (flush after every minibatch): 1f1b or gpipe within each minibatch.
    for local, k in enumerate(minibatches):
        micro = [k * m + j for j in range(m)]
        if spec.schedule == "gpipe":
            order.extend((Op.FORWARD, mb) for mb in micro)
            order.extend((Op.BACKWARD, mb) for mb in micro)
        else:
            order.extend(_one_f_one_b(micro, spec.num_stages - 1 - stage))
        close_minibatch(local)
    return order


def _version_of(spec: PipelineSpec, stage: int, microbatch: int, updates_done: int) -> int:
    """The weight version a forward uses, by the schedule's update rule (DESIGN.md section 7)."""
    minibatch = microbatch // spec.microbatches
    if spec.schedule == "pipedream-vs":
        # Every stage uses the weights stage 0 used for this minibatch. Stage 0's replica ran
        # max(0, i - w_0) updates before the forward of its i-th minibatch, each covering r_0
        # minibatches; this stage's version covering the same minibatches is that // r_s.
        r0 = spec.replicas(0)
        local0 = (minibatch - spec.first_minibatch) // r0
        covered = max(0, local0 - warmup_depth(spec, 0)) * r0
        return (spec.first_minibatch + covered) // spec.replicas(stage)
    if spec.schedule == "2bw":
        base = spec.first_minibatch // spec.replicas(stage)
        local = (minibatch - spec.first_minibatch) // spec.replicas(stage)
        return base + max(0, local - 1)
    return updates_done


def forward_versions(spec: PipelineSpec, stage: int, replica: int) -> dict[int, int]:
    """Microbatch -> the weight version its forward (and backward) uses at a stage replica."""
    updates_done = spec.first_minibatch // spec.replicas(stage)
    versions: dict[int, int] = {}
    for op, index in compute_order(spec, stage, replica):
        if op is Op.FORWARD:
            versions[index] = _version_of(spec, stage, index, updates_done)
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
    for stage, ranks in enumerate(spec.stage_ranks):
        for replica, rank in enumerate(ranks):
            if only_ranks is None or rank in only_ranks:
                tables[rank] = _table(spec, stage, replica)
    return tables


def _table(spec: PipelineSpec, stage: int, replica: int) -> list[Action]:
    """One stage replica's table: its compute order with the communication around it."""
    table: list[Action] = []
    versions = forward_versions(spec, stage, replica)
    owners = spec.tie_owners(stage)
    copies = spec.tie_copies(stage)
    # the owners' versions of every microbatch, and the newest version received from each
    owner_versions = {
        owner: {
            microbatch: version
            for owner_replica in range(spec.replicas(owner))
            for microbatch, version in forward_versions(spec, owner, owner_replica).items()
        }
        for owner in owners
    }
    received = {owner: spec.first_minibatch // spec.replicas(owner) for owner in owners}

    def receive_versions(owner: int, upto: int) -> None:
        assert upto >= received[owner], (spec, stage, replica, owner, upto)  # never backwards
        peer = spec.stage_ranks[owner][replica % spec.replicas(owner)]
        while received[owner] < upto:
            received[owner] += 1
            table.append(Action(Op.RECV_WEIGHTS, stage, received[owner], peer=peer))

    for op, index in compute_order(spec, stage, replica):
        if op is Op.FORWARD:
            minibatch = index // spec.microbatches
            for owner in owners:
                receive_versions(owner, owner_versions[owner][index])
            for producer in spec.producers(stage):
                peer = spec.rank_of(producer, minibatch)
                table.append(Action(Op.RECV_ACT, stage, index, peer=peer))
            table.append(Action(Op.FORWARD, stage, index, version=versions[index]))
            for consumer in spec.consumers(stage):
                peer = spec.rank_of(consumer, minibatch)
                table.append(Action(Op.SEND_ACT, stage, index, peer=peer))
        elif op is Op.BACKWARD:
            minibatch = index // spec.microbatches
            for consumer in spec.consumers(stage):
                peer = spec.rank_of(consumer, minibatch)
                table.append(Action(Op.RECV_GRAD, stage, index, peer=peer))
            table.append(Action(Op.BACKWARD, stage, index, version=versions[index]))
            for producer in spec.producers(stage):
                peer = spec.rank_of(producer, minibatch)
                table.append(Action(Op.SEND_GRAD, stage, index, peer=peer))
        elif op is Op.SEND_TIED_GRAD:  # to the owners' replicas of minibatch `index`
            for owner in owners:
                table.append(Action(op, stage, index, peer=spec.rank_of(owner, index)))
        elif op is Op.RECV_TIED_GRAD:
            for copy in copies:
                table.append(Action(op, stage, index, peer=spec.rank_of(copy, index)))
        elif op is Op.SEND_WEIGHTS:  # to the copy replicas k with k mod replicas = replica
            for copy in copies:
                for k, peer in enumerate(spec.stage_ranks[copy]):
                    if k % spec.replicas(stage) == replica:
                        table.append(Action(op, stage, index, peer=peer))
        else:
            table.append(Action(op, stage, index))
    # the versions made by the last updates: the copies end as the owners' final tensors
    for owner in owners:
        first_version = spec.first_minibatch // spec.replicas(owner)
        receive_versions(owner, first_version + spec.num_minibatches // spec.replicas(owner))
    return table
