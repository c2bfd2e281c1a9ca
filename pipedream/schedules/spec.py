"""The shape of a pipeline run: stages and their ranks, microbatches, minibatches, the stage
pairs that exchange tensors and those that share tied parameters. Pure code, no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipedream.errors import ScheduleError

__all__ = ["MAX_MICROBATCHES", "PipelineSpec", "warmup_depth"]

MAX_MICROBATCHES = 16384
"""Microbatches per minibatch at most. Every rank builds and checks tables with actions for
each microbatch of each of its stages, and the planner simulates them: at this many that takes
seconds and gigabytes before the first step, far beyond it more than a host has, for no gain a
larger microbatch would not give."""


@dataclass(frozen=True)
class PipelineSpec:
    """The shape of a pipeline run: what the schedule generator needs to know."""

    schedule: str
    """Schedule name (a key of :data:`pipedream.schedules.SCHEDULES`)."""
    stage_ranks: tuple[tuple[int, ...], ...]
    """Global ranks of each stage's replicas, in pipeline order. A rank appears once, except
    under schedules that run several stages per rank (their ``placement``)."""
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
    global_norm: bool = False
    """Every update waits for the whole model's gradient norm, a ``C`` per rank and update
    that all ranks take part in: to clip gradients, or for fp16's overflow check
    (:mod:`pipedream.schedules.global_norm`)."""

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
        return len({rank for ranks in self.stage_ranks for rank in ranks})

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages ``rank`` runs a replica of (one, but for several-stage schedules)."""
        return [stage for stage, ranks in enumerate(self.stage_ranks) if rank in ranks]

    def replicas(self, stage: int) -> int:
        return len(self.stage_ranks[stage])

    def pipeline_copy(self, copy: int) -> tuple[PipelineSpec, list[int]]:
        """Under a schedule that orders whole ranks with every stage on ``r`` ranks (``r``
        copies of the pipeline, minibatch ``t`` on copy ``t mod r``): copy ``copy`` as an
        unreplicated spec, its ranks renumbered ``0..P-1`` in the order its stages first use
        them, and those local ranks' global ranks."""
        flat = [ranks[copy] for ranks in self.stage_ranks]
        global_of = list(dict.fromkeys(flat))
        local = {rank: i for i, rank in enumerate(global_of)}
        view = PipelineSpec(
            self.schedule,
            tuple((local[rank],) for rank in flat),
            self.microbatches,
            self.num_minibatches // len(self.stage_ranks[0]),
            edges=self.edges,
            tied=self.tied,
            global_norm=self.global_norm,
        )
        return view, global_of

    def copy_of_rank(self, rank: int) -> int:
        """Which copy of the pipeline ``rank`` belongs to (its replica index)."""
        for ranks in self.stage_ranks:
            if rank in ranks:
                return ranks.index(rank)
        raise ValueError(f"rank {rank} runs no stage")

    def rank_of(self, stage: int, minibatch: int) -> int:
        """The rank whose replica of ``stage`` runs ``minibatch``."""
        ranks = self.stage_ranks[stage]
        return ranks[minibatch % len(ranks)]

    def validate(self) -> None:
        from pipedream.schedules.registry import lookup  # the schedules import this module

        schedule = lookup(self.schedule)
        if self.num_stages < 1:
            raise ScheduleError("a pipeline needs at least one stage")
        if not 1 <= self.microbatches <= MAX_MICROBATCHES:
            raise ScheduleError(
                f"microbatches must be 1 to {MAX_MICROBATCHES}, got {self.microbatches}"
            )
        problem = schedule.microbatches_problem(self.microbatches, self.num_stages)
        if problem:
            raise ScheduleError(problem)
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
        if schedule.rank_order is not None and len({len(r) for r in self.stage_ranks}) > 1:
            raise ScheduleError(
                f"schedule {self.schedule!r} replicates whole pipelines: give every stage the "
                f"same number of replicas; got {[len(r) for r in self.stage_ranks]}"
            )
        copies = len(self.stage_ranks[0]) if schedule.rank_order is not None else 1
        views = [self.pipeline_copy(j) for j in range(copies)] if copies > 1 else []
        first = views[0][0] if views else self
        problem = schedule.spec_problem(first) if schedule.spec_problem else ""
        if problem:
            raise ScheduleError(problem)
        if copies > 1:
            self._check_copies(views)
        if schedule.placement is not None:
            if not views:
                self._check_placement(schedule.placement, flat)
            for copy, (view, global_of) in enumerate(views):
                local = [r for (r,) in view.stage_ranks]
                where = f"copy {copy} of the pipeline (ranks {[global_of[r] for r in local]}): "
                view._check_placement(schedule.placement, local, where)
        elif sorted(flat) != list(range(len(flat))):
            raise ScheduleError(f"ranks must be 0..{len(flat) - 1}, each once; got {flat}")
        for owner, copy in self.tied:
            if not 0 <= owner < copy < self.num_stages:
                raise ScheduleError(
                    f"tied pair ({owner}, {copy}) must name an owner stage before a copy stage"
                )
        if self.global_norm:
            from pipedream.schedules.global_norm import global_norm_problem

            problem = global_norm_problem(self)
            if problem:
                raise ScheduleError(problem)

    def _check_copies(self, views: list[tuple[PipelineSpec, list[int]]]) -> None:
        """The copies of a whole-pipeline-replicated spec: disjoint, together ranks 0..W-1."""
        ranks = [rank for _, global_of in views for rank in global_of]
        if sorted(ranks) != list(range(len(ranks))):
            raise ScheduleError(
                f"schedule {self.schedule!r}: replica j of every stage forms copy j of the "
                f"pipeline, and the copies must share no rank and use ranks 0..W-1; got "
                f"copies {[global_of for _, global_of in views]}"
            )

    def _check_placement(
        self, placement: Callable[[int, int], list[int]], flat: list[int], where: str = ""
    ) -> None:
        """Stages on ranks as a several-stages-per-rank schedule places them (``flat``: the
        rank of every stage; ``where``: which copy of the pipeline, for the message)."""
        ranks = len(set(flat))
        if sorted(set(flat)) != list(range(ranks)):
            raise ScheduleError(f"{where}ranks must be 0..{ranks - 1}; got {flat}")
        wanted = placement(self.num_stages, ranks) if self.num_stages % ranks == 0 else None
        if flat != wanted:
            raise ScheduleError(
                f"{where}schedule {self.schedule!r} places {self.num_stages} stages on {ranks} "
                f"ranks as {wanted}; got {flat}"
                if wanted is not None
                else f"{where}schedule {self.schedule!r} needs the same number of stages on "
                f"every rank; got {self.num_stages} stages on {ranks} ranks"
            )


def warmup_depth(spec: PipelineSpec, stage: int) -> int:
    """Forwards a replica of ``stage`` runs before its first backward (in its own minibatches).

    PipeDream's rule: ``(world_size - 1 - sum of replicas of earlier stages) // r_s``; for a
    straight pipeline this is ``S - 1 - s``.
    """
    earlier = sum(spec.replicas(s) for s in range(stage))
    return (spec.world_size - 1 - earlier) // spec.replicas(stage)
