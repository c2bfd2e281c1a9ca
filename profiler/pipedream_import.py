"""Import a profile written by the original PipeDream profiler (its ``graph.txt``).

The original profiler (msr-fiddle/pipedream, ``graph/graph.py``) writes one line per node::

    node4 -- Conv2d(3, 64, ...) -- forward_compute_time=1.2, backward_compute_time=2.3, \
activation_size=411041792.0, parameter_size=7168.0

(``activation_size`` may be a list ``[a; b; c]`` for nodes with several outputs; it is summed,
as the original does), followed by tab-indented edge lines ``\\tnode4 -- node5``. Times are in
milliseconds for one minibatch, sizes in bytes.

The graph is a DAG; :class:`~pipedream.formats.Profile` is a list of layers in execution order
plus ``cut_bytes`` (the bytes live across each boundary), which is what the optimizer needs to
plan contiguous stages, and ``values`` (each node's output and the nodes that read it), which
is what the simulator needs to send a skip connection where the runtime does: from its
producer's stage straight to its consumer's. Data-loader sources (description
``Input...``) get zero cost by default, as the original optimizer does before planning (their
"forward time" is the data loading time, which is no stage's work, and the input always lives
on the first stage).

This module must not import torch: ``pipedream profile --from-pipedream`` and the tests use it on
machines without an accelerator, and the optimizer reads its output without torch.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipedream.errors import FormatError
from pipedream.formats.profile import LayerProfile, Profile, ProfileValue
from pipedream.workload_options import IMPORTED

__all__ = ["GraphNode", "import_pipedream_graph", "parse_pipedream_graph", "topological_order"]

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")


@dataclass(frozen=True)
class GraphNode:
    """One node of a PipeDream ``graph.txt``, as written (sizes summed, nothing zeroed)."""

    node_id: str
    """The node's id (``node4``); used as the layer name."""
    description: str
    """The module description (``Conv2d(3, 64, ...)``); used as the layer type."""
    forward_ms: float
    """``forward_compute_time`` in milliseconds."""
    backward_ms: float
    """``backward_compute_time`` in milliseconds."""
    activation_bytes: float
    """``activation_size`` in bytes (summed over outputs)."""
    parameter_bytes: float
    """``parameter_size`` in bytes."""
    line: int
    """1-based line number in the file, for error messages."""

    @property
    def is_input(self) -> bool:
        """True for the profiler's data-loader nodes (``Input``, ``Input0``, ...)."""
        return self.description.startswith("Input")


def _number(text: str, *, source: str, line: int, key: str) -> float:
    if not _NUMBER.match(text.strip()):
        raise FormatError(
            source, f"line {line}", f"{key}={text!r} is not a number", "write e.g. 1.5 or 1e6"
        )
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise FormatError(source, f"line {line}", f"{key}={text} must be finite and >= 0")
    return value


def _parse_node(text: str, *, source: str, line: int) -> GraphNode:
    parts = text.split(" -- ")
    if len(parts) >= 4 and parts[-1].startswith("stage_id="):
        parts = parts[:-1]  # written by the original optimizer after partitioning; ignored
    if len(parts) < 3 or not parts[0] or any(c.isspace() for c in parts[0]):
        raise FormatError(
            source,
            f"line {line}",
            f"expected 'ID -- DESCRIPTION -- forward_compute_time=..., ...', got {text[:60]!r}",
            "edge lines must start with a tab",
        )
    node_id, description, metadata = parts[0], " -- ".join(parts[1:-1]), parts[-1]
    values: dict[str, float] = {}
    for item in metadata.split(", "):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in _FIELDS or key in values:
            raise FormatError(
                source,
                f"line {line}",
                f"unexpected metadata {item.strip()[:40]!r}",
                f"write each of {', '.join(_FIELDS)} once as KEY=NUMBER, separated by ', '",
            )
        raw = raw.strip()
        if key == "activation_size" and raw.startswith("[") and raw.endswith("]"):
            values[key] = sum(
                _number(x, source=source, line=line, key=key) for x in raw[1:-1].split(";")
            )
        else:
            values[key] = _number(raw, source=source, line=line, key=key)
    missing = [key for key in _FIELDS if key not in values]
    if missing:
        raise FormatError(
            source, f"line {line}", f"node {node_id} lacks {', '.join(missing)}", "add them"
        )
    return GraphNode(
        node_id=node_id,
        description=description.strip(),
        forward_ms=values["forward_compute_time"],
        backward_ms=values["backward_compute_time"],
        activation_bytes=values["activation_size"],
        parameter_bytes=values["parameter_size"],
        line=line,
    )


def parse_pipedream_graph(
    text: str, *, source: str = "<graph.txt>"
) -> tuple[list[GraphNode], list[tuple[str, str]]]:
    """Parse ``graph.txt`` text into its nodes (file order) and edges ``(src, dst)`` (file order).

    Raises :class:`FormatError` naming ``source`` and the line for any malformed line, a
    duplicate node, an edge to an unknown node, or an empty graph.
    """
    nodes: dict[str, GraphNode] = {}
    edges: list[tuple[str, str]] = []
    edge_lines: list[int] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if raw[0] in " \t":
            ends = raw.strip().split(" -- ")
            if len(ends) != 2 or not all(ends) or any(" " in end for end in ends):
                raise FormatError(
                    source,
                    f"line {number}",
                    f"expected an edge 'SRC -- DST', got {raw.strip()[:60]!r}",
                    "node lines must not be indented",
                )
            edges.append((ends[0], ends[1]))
            edge_lines.append(number)
            continue
        node = _parse_node(raw.strip(), source=source, line=number)
        if node.node_id in nodes:
            raise FormatError(
                source,
                f"line {number}",
                f"node {node.node_id} is already defined on line {nodes[node.node_id].line}",
                "give every node a unique id",
            )
        nodes[node.node_id] = node
    if not nodes:
        raise FormatError(source, "", "no nodes found", "is this a PipeDream graph.txt?")
    for (src, dst), number in zip(edges, edge_lines):
        for end in (src, dst):
            if end not in nodes:
                raise FormatError(
                    source, f"line {number}", f"edge names unknown node {end!r}", "define it"
                )
        if src == dst:
            raise FormatError(source, f"line {number}", f"edge {src} -- {dst} is a self-loop")
    return list(nodes.values()), edges


def topological_order(
    names: list[str], *, edges: list[tuple[str, str]], source: str = "<graph>"
) -> list[str]:
    """Kahn's algorithm, depth-first among ready nodes, ties broken by position in ``names``.

    Depth first (the node made ready most recently runs next) finishes one branch before
    starting another and emits dead-end nodes (``__getitem__`` sinks) right after their
    producer, which keeps the bytes live across each boundary (``cut_bytes``) small. The result
    depends only on the order of ``names`` and ``edges``, so it is deterministic.
    """
    position = {name: i for i, name in enumerate(names)}
    successors: dict[str, list[str]] = {name: [] for name in names}
    indegree = dict.fromkeys(names, 0)
    for src, dst in dict.fromkeys(edges):  # repeated edges count once
        successors[src].append(dst)
        indegree[dst] += 1
    # a stack of ready nodes; the top is the next to run
    ready = sorted((n for n in names if indegree[n] == 0), key=position.__getitem__, reverse=True)
    order: list[str] = []
    while ready:
        node = ready.pop()
        order.append(node)
        newly = []
        for succ in successors[node]:
            indegree[succ] -= 1
            if indegree[succ] == 0:
                newly.append(succ)
        # sinks first, then file order: push in reverse so the preferred one is on top
        newly.sort(key=lambda n: (bool(successors[n]), position[n]), reverse=True)
        ready.extend(newly)
    if len(order) != len(names):
        stuck = sorted((n for n in names if indegree[n] > 0), key=position.__getitem__)
        raise FormatError(
            source,
            "edges",
            f"the graph has a cycle through {', '.join(stuck[:5])}",
            "a PipeDream graph must be a DAG",
        )
    return order


def _infer_microbatch_size(nodes: list[GraphNode]) -> int:
    """The minibatch size, if the input is a batch of 3x224x224 float32 images; else 1.

    The original image-classification profiles record the input batch's bytes as the
    ``Input`` node's activation size; nothing else in ``graph.txt`` names the batch size.
    """
    image_bytes = 3 * 224 * 224 * 4
    sizes = {round(node.activation_bytes) for node in nodes if node.is_input}
    if len(sizes) == 1:
        (size,) = sizes
        if size > 0 and size % image_bytes == 0:
            return size // image_bytes
    return 1


def import_pipedream_graph(
    path: str | os.PathLike[str], *, keep_input_costs: bool = False
) -> Profile:
    """Read a PipeDream ``graph.txt`` and return it as a :class:`Profile`.

    Layers are the graph's nodes in :func:`topological_order`, named by node id, typed by their
    description. ``cut_bytes[i]`` is the total ``activation_size`` of nodes at positions ``<= i``
    that feed a node at a position ``> i``. With ``keep_input_costs=False`` (the default) the
    ``Input*`` sources get zero time and size, as the original optimizer does before planning;
    pass ``True`` to keep every number exactly as written.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FormatError(
            source, "", f"cannot read PipeDream graph ({exc})", "check the path"
        ) from None
    nodes, edges = parse_pipedream_graph(text, source=source)
    by_id = {node.node_id: node for node in nodes}
    order = topological_order([node.node_id for node in nodes], edges=edges, source=source)
    index = {name: i for i, name in enumerate(order)}

    layers = []
    for name in order:
        node = by_id[name]
        zero = node.is_input and not keep_input_costs
        layers.append(
            LayerProfile(
                name=name,
                type=node.description,
                forward_ms=0.0 if zero else node.forward_ms,
                backward_ms=0.0 if zero else node.backward_ms,
                output_bytes=0 if zero else round(node.activation_bytes),
                parameter_bytes=0 if zero else round(node.parameter_bytes),
            )
        )
    # an output is live across boundary i (after layer i) if produced at <= i and consumed > i:
    # add it at its producer and remove it after its last consumer (a difference array)
    delta = [0] * (len(order) + 1)
    last_use: dict[str, int] = {}
    for src, dst in edges:
        last_use[src] = max(last_use.get(src, -1), index[dst])
    for src, last in last_use.items():
        delta[index[src]] += layers[index[src]].output_bytes
        delta[last] -= layers[index[src]].output_bytes
    cuts, live = [], 0
    for i in range(len(order) - 1):
        live += delta[i]
        cuts.append(live)
    consumers: dict[str, list[str]] = {}
    for src, dst in edges:
        consumers.setdefault(src, []).append(dst)
    values = tuple(  # a sink (the output, a dead end) sends nothing, as in cut_bytes
        ProfileValue(
            name=src,
            bytes=layers[index[src]].output_bytes,
            made_by=src,
            used_by=tuple(sorted(set(consumers[src]), key=index.__getitem__)),
        )
        for src in order
        if src in consumers
    )
    name = Path(path).stem if Path(path).stem != "graph" else Path(path).resolve().parent.name
    return Profile(
        workload=f"{IMPORTED}:{name}",
        microbatch_size=_infer_microbatch_size(nodes),
        device=IMPORTED,
        dtype="float32",
        layers=tuple(layers),
        cut_bytes=tuple(cuts),
        values=values,
    )
