"""The topology file (``format: pipedream/topology@1``): the cluster the optimizer plans for.

Levels are listed innermost first. ``workers`` of a level is the number of units of the level
below inside one unit of this level (for the innermost level: workers per unit); the total
number of workers is the product. ``bandwidth`` is the bandwidth between units of the level below
within one unit of this level, in bytes/s.

Example (8 servers of 4 GPUs)::

    format: pipedream/topology@1
    levels:
      - {name: server, workers: 4, bandwidth: "100 GB/s"}
      - {name: cluster, workers: 8, bandwidth: "25 Gbit/s"}
    memory: "80 GiB"
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from pipedream.formats.reader import MappingReader
from pipedream.formats.units import MIN_BANDWIDTH, format_bytes, parse_bandwidth, parse_bytes
from pipedream.formats.yamlio import read_yaml_mapping, write_yaml

__all__ = [
    "DEFAULT_BANDWIDTH",
    "MAX_LEVEL_WORKERS",
    "MAX_WORKERS",
    "TOPOLOGY_FORMAT",
    "Level",
    "Topology",
    "load_topology",
    "save_topology",
]

TOPOLOGY_FORMAT = "pipedream/topology@1"
DEFAULT_BANDWIDTH = 1e9
"""PipeDream's default bandwidth (bytes/s) when only a worker count is given."""
MAX_WORKERS = 1 << 20
"""Most workers a topology describes (the product of its levels)."""
MAX_LEVEL_WORKERS = 4096
"""Most units in one level. The planner's dynamic program on a level grows with the square of
its units (a level of thousands takes minutes), while levels of a few hundred each describe any
real cluster: GPUs per server, servers per rack, racks."""


@dataclass(frozen=True)
class Level:
    """One level of the cluster hierarchy."""

    name: str
    """Human-readable name (``server``, ``rack``)."""
    workers: int
    """Units of the level below in one unit of this level (>= 1)."""
    bandwidth: float
    """Bandwidth between those units, bytes per second (> 0)."""


@dataclass(frozen=True)
class Topology:
    """A cluster: levels innermost first, and optional memory per worker."""

    levels: tuple[Level, ...]
    """Levels, innermost first."""
    memory: float | None = None
    """Memory per worker in bytes, or None for unlimited."""

    @property
    def num_workers(self) -> int:
        return math.prod(level.workers for level in self.levels)

    @classmethod
    def single_level(
        cls, num_workers: int, bandwidth: float = DEFAULT_BANDWIDTH, memory: float | None = None
    ) -> Topology:
        return cls(levels=(Level("workers", num_workers, bandwidth),), memory=memory)

    def describe(self) -> str:
        parts = [
            f"{lvl.workers} x {lvl.name} @ {lvl.bandwidth / 1e9:g} GB/s" for lvl in self.levels
        ]
        text = " within ".join(parts) + f" = {self.num_workers} workers"
        if self.memory is not None:
            text += f", {format_bytes(self.memory)} per worker"
        return text

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": TOPOLOGY_FORMAT,
            "levels": [
                {"name": lvl.name, "workers": lvl.workers, "bandwidth": lvl.bandwidth}
                for lvl in self.levels
            ],
        }
        if self.memory is not None:
            out["memory"] = self.memory
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<topology>") -> Topology:
        reader = MappingReader(data, source=source)
        fmt = reader.str("format")
        if fmt != TOPOLOGY_FORMAT:
            raise reader.error(
                "format", f"expected {TOPOLOGY_FORMAT!r}, got {fmt!r}", "is this a topology file?"
            )
        return cls.from_reader(reader)

    @classmethod
    def from_reader(cls, reader: MappingReader) -> Topology:
        """The levels and memory of a mapping (a topology file's body, or a plan's
        ``topology`` key); rejects unknown keys."""
        levels = []
        for i, raw in enumerate(reader.list("levels")):
            level_reader = reader.child(raw, f"levels[{i}]")
            workers = level_reader.int("workers", minimum=1)
            if workers > MAX_LEVEL_WORKERS:
                raise level_reader.error(
                    "workers",
                    f"{workers} units in one level, at most {MAX_LEVEL_WORKERS} supported",
                    "split the level in two (e.g. GPUs per server, then servers)",
                )
            bandwidth = level_reader.number("bandwidth", parse=parse_bandwidth, positive=True)
            if bandwidth < MIN_BANDWIDTH:
                raise level_reader.error(
                    "bandwidth",
                    f"{bandwidth:g} bytes/s is below {MIN_BANDWIDTH:g} byte/s",
                    "write the link's bandwidth, e.g. 1e9 or '10 GB/s'",
                )
            levels.append(
                Level(
                    name=level_reader.str("name", f"level{i}"), workers=workers, bandwidth=bandwidth
                )
            )
            level_reader.finish()
        memory = reader.number("memory", None, parse=parse_bytes, positive=True)
        reader.finish()
        topology = cls(levels=tuple(levels), memory=memory)
        if topology.num_workers > MAX_WORKERS:
            raise reader.error(
                "levels",
                f"describes {topology.num_workers} workers",
                f"at most {MAX_WORKERS} supported",
            )
        return topology


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Load and validate a topology YAML file."""
    return Topology.from_dict(read_yaml_mapping(path, what="topology"), source=str(path))


def save_topology(topology: Topology, path: str | os.PathLike[str]) -> None:
    write_yaml(path, topology.to_dict(), header=f"cluster: {topology.describe()}")
