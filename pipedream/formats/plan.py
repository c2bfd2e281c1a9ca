"""The plan file (``format: pipedream/plan@1``): stages, replicas, ranks, schedule, prediction.

A plan is written by ``pipedream plan`` (with a ``prediction``) or by hand (without one), and
read by ``pipedream train``. Stages are contiguous ranges of layers in profile order, named by
their first and last layer (inclusive).
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipedream.errors import ScheduleError
from pipedream.formats.reader import MappingReader
from pipedream.formats.topology import Topology
from pipedream.formats.yamlio import read_yaml_mapping, write_yaml
from pipedream.precision import DEFAULT_PRECISION, PRECISIONS
from pipedream.schedules.registry import SCHEDULES
from pipedream.schedules.schedule import Schedule
from pipedream.schedules.spec import MAX_MICROBATCHES, PipelineSpec
from pipedream.wording import count

__all__ = [
    "PLAN_FORMAT",
    "PREDICTION_METHODS",
    "Plan",
    "Prediction",
    "StagePlan",
    "load_plan",
    "profile_path",
    "save_plan",
]

PLAN_FORMAT = "pipedream/plan@1"
PREDICTION_METHODS = ("closed-form", "simulated")
"""How a plan's ``time_per_minibatch_ms`` was predicted."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a contiguous layer range run by ``replicas`` ranks."""

    first_layer: str
    """Name of the stage's first layer (inclusive)."""
    last_layer: str
    """Name of the stage's last layer (inclusive)."""
    replicas: int
    """Number of data-parallel replicas of this stage."""
    ranks: tuple[int, ...]
    """Global ranks running the replicas (``len(ranks) == replicas``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "first_layer": self.first_layer,
            "last_layer": self.last_layer,
            "replicas": self.replicas,
            "ranks": list(self.ranks),
        }


@dataclass(frozen=True)
class Prediction:
    """The optimizer's predicted performance of the plan."""

    time_per_minibatch_ms: float
    """Predicted steady-state time between consecutive minibatches leaving the pipeline."""
    throughput_samples_per_s: float
    """Samples per second implied by the above."""
    bottleneck: int
    """Index of the slowest stage."""
    stage_ms: tuple[float, ...]
    """Predicted time per minibatch of each stage (compute + communication, / replicas)."""
    memory_bytes: tuple[float, ...]
    """Predicted memory per worker of each stage."""
    data_parallel_time_per_minibatch_ms: float
    """Predicted time per minibatch of plain data parallelism on the same workers."""
    cost_model: str = "pipedream"
    """Name of the cost model that made the prediction."""
    method: str = "closed-form"
    """``closed-form`` (the cost model's formula) or ``simulated`` (the event simulation of the
    plan's action tables, where the formula is not exact: replicated stages in a pipeline,
    split backwards, several stages per worker)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "time_per_minibatch_ms": round(self.time_per_minibatch_ms, 6),
            "throughput_samples_per_s": round(self.throughput_samples_per_s, 3),
            "bottleneck": self.bottleneck,
            "stage_ms": [round(x, 6) for x in self.stage_ms],
            "memory_bytes": [int(x) for x in self.memory_bytes],
            "data_parallel_time_per_minibatch_ms": round(
                self.data_parallel_time_per_minibatch_ms, 6
            ),
            "cost_model": self.cost_model,
        }
        if self.method != "closed-form":
            out["method"] = self.method
        return out

    @classmethod
    def from_reader(cls, reader: MappingReader, num_stages: int) -> Prediction:
        stage_ms = reader.list("stage_ms")
        memory = reader.list("memory_bytes")
        for key, values in (("stage_ms", stage_ms), ("memory_bytes", memory)):
            if len(values) != num_stages:
                raise reader.error(
                    key, f"has {len(values)} entries for {num_stages} stages", "one per stage"
                )
        stage_reader = MappingReader(
            {f"stage_ms[{i}]": v for i, v in enumerate(stage_ms)}
            | {f"memory_bytes[{i}]": v for i, v in enumerate(memory)},
            source=reader.source,
            path=reader.path,
        )
        prediction = cls(
            time_per_minibatch_ms=reader.number("time_per_minibatch_ms"),
            throughput_samples_per_s=reader.number("throughput_samples_per_s"),
            bottleneck=reader.int("bottleneck"),
            stage_ms=tuple(stage_reader.number(f"stage_ms[{i}]") for i in range(num_stages)),
            memory_bytes=tuple(
                stage_reader.number(f"memory_bytes[{i}]") for i in range(num_stages)
            ),
            data_parallel_time_per_minibatch_ms=reader.number(
                "data_parallel_time_per_minibatch_ms"
            ),
            cost_model=reader.str("cost_model", "pipedream"),
            method=reader.str("method", "closed-form"),
        )
        if prediction.method not in PREDICTION_METHODS:
            raise reader.error(
                "method",
                f"unknown prediction method {prediction.method!r}",
                f"use one of {', '.join(PREDICTION_METHODS)} (or leave it out)",
            )
        if prediction.bottleneck >= num_stages:
            raise reader.error(
                "bottleneck",
                f"stage {prediction.bottleneck} does not exist",
                f"use 0..{num_stages - 1}",
            )
        reader.finish()
        return prediction


@dataclass(frozen=True)
class Plan:
    """A complete training plan."""

    workload: str
    """Workload name or ``package.module:function``."""
    schedule: str
    """A schedule name (:data:`pipedream.schedules.SCHEDULES`)."""
    microbatch_size: int
    """Samples per microbatch."""
    microbatches: int
    """Microbatches per minibatch (one optimizer update per stage per minibatch)."""
    world_size: int
    """Number of processes (workers) the plan needs."""
    stages: tuple[StagePlan, ...]
    """The stages, in pipeline order."""
    workload_args: dict[str, str] = field(default_factory=dict)
    """Keyword options for the workload factory."""
    layers: tuple[str, ...] | None = None
    """All layer names in profile order (written by the optimizer; optional)."""
    recompute: bool = False
    """Recompute activations in backward instead of storing them."""
    prediction: Prediction | None = None
    """The optimizer's prediction (absent in hand-written plans)."""
    profile: str | None = None
    """The profile the plan was made from: a path relative to the plan file's folder (or
    absolute); optional. ``pipedream simulate`` reads the per-layer costs from it."""
    topology: Topology | None = None
    """The cluster the plan was made for (levels, bandwidths, memory); optional.
    ``pipedream simulate`` takes the bandwidths between ranks from it."""
    precision: str = DEFAULT_PRECISION
    """What the profile's forwards ran in, so what the run trains in unless ``pipedream train
    --precision`` says otherwise (:mod:`pipedream.precision`); optional."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def is_straight(self) -> bool:
        return all(stage.replicas == 1 for stage in self.stages)

    @property
    def steps_multiple(self) -> int:
        """What every run's ``--steps`` and ``--checkpoint-every`` must be multiples of: the
        least common multiple of the replica counts (minibatch ``t`` goes to replica
        ``t mod r`` of a stage, and a checkpoint waits for every replica's update)."""
        return math.lcm(*(stage.replicas for stage in self.stages))

    def stage_of_rank(self, rank: int) -> int:
        for index, stage in enumerate(self.stages):
            if rank in stage.ranks:
                return index
        raise KeyError(rank)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs: one, or several under interleaved and V schedules."""
        return tuple(index for index, stage in enumerate(self.stages) if rank in stage.ranks)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": PLAN_FORMAT, "workload": self.workload}
        if self.workload_args:
            out["workload_args"] = dict(self.workload_args)
        out.update(
            {
                "schedule": self.schedule,
                "microbatch_size": self.microbatch_size,
                "microbatches": self.microbatches,
                "world_size": self.world_size,
            }
        )
        if self.recompute:
            out["recompute"] = True
        if self.precision != DEFAULT_PRECISION:
            out["precision"] = self.precision
        out["stages"] = [stage.to_dict() for stage in self.stages]
        if self.layers is not None:
            out["layers"] = list(self.layers)
        if self.prediction is not None:
            out["prediction"] = self.prediction.to_dict()
        if self.profile is not None:
            out["profile"] = self.profile
        if self.topology is not None:
            body = self.topology.to_dict()
            del body["format"]
            out["topology"] = body
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<plan>") -> Plan:
        reader = MappingReader(data, source=source)
        fmt = reader.str("format")
        if fmt != PLAN_FORMAT:
            raise reader.error(
                "format", f"expected {PLAN_FORMAT!r}, got {fmt!r}", "is this a plan file?"
            )
        workload = reader.str("workload")
        args = reader.options("workload_args")
        schedule = reader.str("schedule")
        if schedule not in SCHEDULES:
            raise reader.error(
                "schedule", f"unknown schedule {schedule!r}", f"use one of {', '.join(SCHEDULES)}"
            )
        microbatch_size = reader.int("microbatch_size", minimum=1)
        microbatches = reader.int("microbatches", 1, minimum=1)
        if microbatches > MAX_MICROBATCHES:
            raise reader.error(
                "microbatches",
                f"must be <= {MAX_MICROBATCHES}, got {microbatches}",
                "split each minibatch into fewer, larger microbatches",
            )
        if SCHEDULES[schedule].one_microbatch and microbatches != 1:
            raise reader.error(
                "microbatches",
                f"must be 1 for schedule {schedule!r}, got {microbatches}",
                "use schedule '2bw' for gradient accumulation over microbatches",
            )
        world_size = reader.int("world_size", minimum=1)
        recompute = reader.bool("recompute", False)
        precision = reader.choice("precision", PRECISIONS, DEFAULT_PRECISION)
        raw_layers = reader.list("layers", None)
        layers = None
        if raw_layers is not None:
            layer_reader = MappingReader(
                {f"layers[{i}]": name for i, name in enumerate(raw_layers)}, source=source
            )
            layers = tuple(layer_reader.str(f"layers[{i}]") for i in range(len(raw_layers)))
            for i, name in enumerate(layers):
                if name in layers[:i]:
                    raise reader.error(
                        f"layers[{i}]",
                        f"layer {name!r} is listed twice (first at layers[{layers.index(name)}])",
                        "list each layer once",
                    )
        stages = []
        for i, raw in enumerate(reader.list("stages")):
            stage_reader = reader.child(raw, f"stages[{i}]")
            first = stage_reader.str("first_layer")
            last = stage_reader.str("last_layer")
            replicas = stage_reader.int("replicas", 1, minimum=1)
            raw_ranks = stage_reader.list("ranks")
            rank_reader = MappingReader(
                {f"ranks[{j}]": r for j, r in enumerate(raw_ranks)},
                source=source,
                path=stage_reader.path,
            )
            ranks = tuple(rank_reader.int(f"ranks[{j}]") for j in range(len(raw_ranks)))
            stage_reader.finish()  # a typo such as 'replica: 2' first, not a count mismatch
            if len(ranks) != replicas:
                raise stage_reader.error(
                    "ranks",
                    f"lists {len(ranks)} ranks for {replicas} replicas",
                    "give exactly one rank per replica",
                )
            stages.append(StagePlan(first, last, replicas, ranks))
        _check_ranks(reader, stages, world_size, SCHEDULES[schedule], microbatches)
        if layers is not None:
            _check_stage_layers(reader, stages, layers)
        prediction = None
        raw_prediction = reader.mapping("prediction", None)
        if raw_prediction is not None:
            prediction = Prediction.from_reader(
                reader.child(raw_prediction, "prediction"), len(stages)
            )
        profile = reader.str("profile", None)
        topology = None
        raw_topology = reader.mapping("topology", None)
        if raw_topology is not None:
            topology = Topology.from_reader(reader.child(raw_topology, "topology"))
            if topology.num_workers < world_size:
                raise reader.error(
                    "topology",
                    f"has {topology.num_workers} workers but world_size is {world_size}",
                    "give the cluster the plan runs on, or remove the key",
                )
        reader.finish()
        return cls(
            workload=workload,
            schedule=schedule,
            microbatch_size=microbatch_size,
            microbatches=microbatches,
            world_size=world_size,
            stages=tuple(stages),
            workload_args=args,
            layers=layers,
            recompute=recompute,
            prediction=prediction,
            profile=profile,
            topology=topology,
            precision=precision,
        )


def _places_with(spec: PipelineSpec, *, microbatches: int) -> bool:
    """Whether the schedule takes ``spec``'s stages and ranks with ``microbatches``."""
    try:
        replace(spec, microbatches=microbatches).validate()
    except ScheduleError:
        return False
    return True


def _check_ranks(
    reader: MappingReader,
    stages: list[StagePlan],
    world_size: int,
    schedule: Schedule,
    microbatches: int,
) -> None:
    seen: dict[int, int] = {}
    for index, stage in enumerate(stages):
        for rank in stage.ranks:
            if rank >= world_size:
                raise reader.error(
                    f"stages[{index}].ranks",
                    f"rank {rank} is out of range for world_size {world_size}",
                    f"use ranks 0..{world_size - 1}",
                )
            if rank in seen and schedule.placement is None:
                raise reader.error(
                    f"stages[{index}].ranks",
                    f"rank {rank} is already used by stage {seen[rank]}",
                    "each rank runs exactly one stage replica",
                )
            seen[rank] = index
    if schedule.placement is not None:
        spec = PipelineSpec(schedule.name, tuple(s.ranks for s in stages), microbatches, 0)
        try:
            spec.validate()
        except ScheduleError as exc:
            # stages the schedule takes with a multiple of the ranks as microbatches (which
            # interleaving runs in groups of a copy's ranks): the microbatches are wrong
            other = (microbatches // spec.world_size + 1) * spec.world_size
            if _places_with(spec, microbatches=other):
                raise reader.error(
                    "microbatches", str(exc), f"e.g. microbatches: {other}"
                ) from None
            fix = "place the stages as the schedule does"
            raise reader.error("stages", str(exc), fix) from None
    if len(seen) != world_size:
        # every rank seen is below world_size, so the first few missing lie within reach
        # (world_size itself may be huge: never enumerate it)
        missing = list(itertools.islice((r for r in range(world_size) if r not in seen), 8))
        more = world_size - len(seen) - len(missing)
        listed = f"{missing}" + (f" and {more} more" if more else "")
        raise reader.error(
            "world_size",
            f"is {world_size} but ranks {listed} run no stage",
            f"set world_size to {len(seen)} or assign those ranks",
        )


def _check_stage_layers(
    reader: MappingReader, stages: list[StagePlan], layers: tuple[str, ...]
) -> None:
    """Stages must tile ``layers`` in order: contiguous, non-empty, covering all of them."""
    position = {name: i for i, name in enumerate(layers)}
    expected_first = 0
    for index, stage in enumerate(stages):
        for key in ("first_layer", "last_layer"):
            name = getattr(stage, key)
            if name not in position:
                raise reader.error(
                    f"stages[{index}].{key}",
                    f"unknown layer {name!r}",
                    f"use a name from 'layers' ({layers[0]!r} .. {layers[-1]!r})",
                )
        first, last = position[stage.first_layer], position[stage.last_layer]
        if last < first:
            raise reader.error(
                f"stages[{index}].last_layer",
                f"layer {stage.last_layer!r} comes before first_layer {stage.first_layer!r}",
                "a stage is the range first_layer..last_layer in the order of 'layers'",
            )
        if first != expected_first:
            where = (
                f"start at {layers[expected_first]!r}"
                if expected_first < len(layers)
                else "not exist: earlier stages already cover every layer"
            )
            raise reader.error(
                f"stages[{index}]",
                f"covers layers {stage.first_layer!r}..{stage.last_layer!r}, but the stage must "
                f"{where}",
                "stages must be contiguous, in order, and cover every layer once",
            )
        expected_first = last + 1
    if expected_first != len(layers):
        raise reader.error(
            "stages",
            f"end at layer {layers[expected_first - 1]!r}, leaving {layers[expected_first]!r}.. "
            "uncovered",
            "extend the last stage to the model's last layer",
        )


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Load and validate a plan YAML file."""
    return Plan.from_dict(read_yaml_mapping(path, what="plan"), source=str(path))


def profile_path(plan: Plan, plan_file: str | os.PathLike[str]) -> Path | None:
    """Where the plan's ``profile`` is: relative paths are relative to the plan file."""
    if plan.profile is None:
        return None
    path = Path(plan.profile)
    return path if path.is_absolute() else Path(plan_file).parent / path


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    shape = "-".join(str(stage.replicas) for stage in plan.stages)
    write_yaml(
        path,
        plan.to_dict(),
        header=(
            f"pipedream plan for {plan.workload}: {count(plan.num_stages, 'stage')} (replicas "
            f"{shape}), schedule {plan.schedule}, {count(plan.world_size, 'worker')}\n"
            "Edit freely: stages are layer ranges (inclusive) run by the listed global ranks."
        ),
    )
