"""Grouping an exported graph into layers, and cutting it into stages.

Every computing node of the exported graph carries the module path it ran in
(``nn_module_stack``). A *layer* is a module path; a node belongs to the longest layer name that
is a prefix of its path (nodes of the root module join the layer before them). Layers must be
contiguous in execution order, so a contiguous range of layers is a valid pipeline stage.

Values (graph nodes) that cross a boundary are what stages exchange: a value made in stage p and
used in stage c is sent from p to c directly, skip connections included.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.export import ExportedProgram

from pipedream.errors import WorkloadError
from pipedream.model_io import ModelIO

__all__ = ["LayerGraph", "StageIO"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class StageIO:
    """The tensors one stage takes and produces (named by exported-graph node names)."""

    stage: int
    """Stage index."""
    inputs: tuple[str, ...]
    """Values the stage module takes, in order: grouped by producer stage (ascending)."""
    producers: tuple[tuple[int, tuple[str, ...]], ...]
    """(producer stage, values) per message received; stage -1 is the data (model input)."""
    outputs: tuple[str, ...]
    """Values the stage module returns, in order (the last stage: the model output)."""
    consumers: tuple[tuple[int, tuple[str, ...]], ...] = field(default_factory=tuple)
    """(consumer stage, values) per message sent, values in ``outputs`` order."""
    no_grad: frozenset[str] = frozenset()
    """Inputs and outputs that carry no gradient (integer tensors, masks, values computed from
    buffers and inputs alone): no gradient message carries them back."""


_CHECKS = frozenset(
    {
        "_assert_async",
        "_assert_scalar",
        "_assert_tensor_metadata",
        "sym_constrain_range",
        "sym_constrain_range_for_size",
    }
)
"""Operations that only check a value (``x.to(dtype)`` exports as a check of ``x`` and then the
conversion): they compute nothing and run with the operation after them."""


def _is_check(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.overloadpacket.__name__ in _CHECKS


def _without_grad(node: fx.Node) -> bool:
    """Whether ``node`` runs a region of the forward under ``torch.no_grad()`` (torch.export
    keeps it as a submodule called with gradients off)."""
    return node.target is torch.ops.higher_order.wrap_with_set_grad_enabled and not node.args[0]


def _module_path(node: fx.Node) -> str:
    """The module a node ran in ("": the root module's own operations, and the checks, whose
    recorded module cannot be trusted: torch 2.8 records a check of a layer's input under the
    module that made the input)."""
    stack = node.meta.get("nn_module_stack")
    if not stack or _is_check(node):
        return ""
    return str(list(stack.values())[-1][0])


def _holds_module_list(module: nn.Module) -> bool:
    return any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in module.modules())


def _auto_names(module: nn.Module, prefix: str) -> list[str]:
    names: list[str] = []
    for name, child in module.named_children():
        path = prefix + name
        if isinstance(child, _CONTAINERS):
            names += [f"{path}.{sub}" for sub, _ in child.named_children()]
        elif _holds_module_list(child):
            names += _auto_names(child, path + ".")
        else:
            names.append(path)
    return names


def _within(path: str, layer: str) -> bool:
    return path == layer or path.startswith(layer + ".")


class LayerGraph:
    """An exported model grouped into layers."""

    def __init__(self, program: ExportedProgram, layer_names: Sequence[str]) -> None:
        self.program = program
        signature = program.graph_signature
        # a tied tensor (one object under several names) is known by its first name, the one
        # ``named_parameters()`` gives it: torch.export lifts one placeholder per name and may
        # use any of them
        canonical: dict[str, str] = {}
        first_name: dict[int, str] = {}
        for name, tensor in {**program.state_dict, **program.constants}.items():
            canonical[name] = first_name.setdefault(id(tensor), name)
        self.tensor_names: dict[str, str] = {
            placeholder: canonical.get(target, target)
            for placeholder, target in {
                **signature.inputs_to_parameters,
                **signature.inputs_to_buffers,
                **signature.inputs_to_lifted_tensor_constants,
            }.items()
        }
        """Placeholder name -> the model's own (canonical) state name (``blocks.0.l.weight``)."""
        if not signature.user_inputs or not signature.user_outputs:
            raise WorkloadError(
                f"the traced model takes {len(signature.user_inputs)} tensor inputs and returns "
                f"{len(signature.user_outputs)} tensors; pipedream pipelines models with at "
                "least one tensor in and one tensor out"
            )
        self.input_names: tuple[str, ...] = tuple(signature.user_inputs)
        """The model's tensor inputs, in the order of its flattened ``(args, kwargs)``."""
        self.output_names: tuple[str, ...] = tuple(str(o) for o in signature.user_outputs)
        """The tensors the model returns, in the order of its flattened output."""
        self.nodes = [n for n in program.graph.nodes if n.op == "call_function"]
        self.by_name = {n.name: n for n in program.graph.nodes}
        for value in self.output_names:
            if value not in self.by_name:
                raise WorkloadError(
                    f"the traced model returns {value!r}, which is not a tensor it computes; "
                    "return tensors (a tensor, a tuple or a dict of them, a ModelOutput)"
                )
        self.layers = list(layer_names)
        self.layer_of = self._assign()
        self.differentiable = self._differentiable(signature.inputs_to_parameters)
        """Values with a gradient: floating point and computed from a parameter."""

    def _differentiable(self, parameters: dict[str, str]) -> frozenset[str]:
        found: set[str] = set(parameters)
        for node in self.program.graph.nodes:
            if node.op != "call_function" or not any(a.name in found for a in node.all_input_nodes):
                continue
            if _without_grad(node):  # a ``torch.no_grad()`` region: its results carry none
                continue
            values = node.meta.get("val")
            tensors = values if isinstance(values, (tuple, list)) else [values]
            if any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
                found.add(node.name)
        return frozenset(found - set(parameters))

    @property
    def model_io(self) -> ModelIO:
        """How the model's own inputs and output map to the stages' flat tensor lists."""
        spec = self.program.call_spec
        return ModelIO(spec.in_spec, spec.out_spec, len(self.input_names))

    # -- granularity -------------------------------------------------------------------------
    @staticmethod
    def auto_layer_names(program: ExportedProgram, model: nn.Module) -> list[str]:
        """Top-level children, with containers (Sequential, ModuleList) expanded one level, and
        children that hold a ``ModuleList`` somewhere below (a Hugging Face model's
        ``transformer`` or ``model``) descended into by the same rule: ``transformer.wte``,
        ``transformer.h.0`` .. ``transformer.ln_f``, ``lm_head``."""
        return LayerGraph._in_execution_order(program, _auto_names(model, ""))

    @staticmethod
    def depth_layer_names(program: ExportedProgram, depth: int) -> list[str]:
        """Module paths cut to ``depth`` components (``--depth``)."""
        if depth < 1:
            raise WorkloadError(f"--depth must be >= 1, got {depth}")
        paths = [_module_path(n) for n in program.graph.nodes if n.op == "call_function"]
        names = [".".join(p.split(".")[:depth]) for p in paths if p]
        return LayerGraph._in_execution_order(program, list(dict.fromkeys(names)))

    @staticmethod
    def pattern_layer_names(program: ExportedProgram, patterns: Sequence[str]) -> list[str]:
        """Layers at module paths matching any glob (``--layers 'blocks.*'``): for each glob
        the shortest prefix of a module's path that it matches, and of several globs the most
        specific (longest) match, so ``'h*' 'h0.*'`` splits ``h0`` and keeps ``h1`` whole. The
        rest of the model is grouped by top-level child, and a module that holds a layer has
        its other children as layers of their own (``'h0.attn'`` gives ``h0.ln1``,
        ``h0.attn``, ``h0.ln2``, ``h0.mlp``), rather than folded into a neighbour's name."""
        paths = [
            _module_path(node)
            for node in program.graph.nodes
            if node.op == "call_function" and _module_path(node)
        ]
        matched = [LayerGraph._matched(path, patterns) for path in paths]
        chosen = {name for name in matched if name is not None}
        if not chosen:
            raise WorkloadError(
                f"--layers {' '.join(patterns)!r} matches no module of the model; patterns are "
                "globs over module paths such as 'blocks.*' or 'layer?.*'"
            )
        names = []
        for path, match in zip(paths, matched):
            if match is not None:
                names.append(match)
                continue
            parts = path.split(".")
            prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
            # the shortest prefix that holds no chosen layer (else the path itself: the holder's
            # own operations, which join the layer before them)
            free = [p for p in prefixes if not any(_within(c, p) for c in chosen)]
            names.append(free[0] if free else path)
        return LayerGraph._in_execution_order(program, list(dict.fromkeys(names)))

    @staticmethod
    def _matched(path: str, patterns: Sequence[str]) -> str | None:
        """The layer a glob makes of ``path``'s module: per glob the shortest matching prefix,
        the longest of those (None: no glob matches)."""
        parts = path.split(".")
        prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
        found = [
            next((p for p in prefixes if fnmatch.fnmatchcase(p, glob)), None) for glob in patterns
        ]
        matches = [p for p in found if p is not None]
        return max(matches, key=len) if matches else None

    @staticmethod
    def _in_execution_order(program: ExportedProgram, names: list[str]) -> list[str]:
        """Leaf names (a name that is a prefix of another is dropped: its own nodes join the
        layer before them) ordered by the first node they own."""
        leaves = [n for n in names if not any(o != n and _within(o, n) for o in names)]
        by_length = sorted(leaves, key=len, reverse=True)
        first: dict[str, int] = {}
        for index, node in enumerate(program.graph.nodes):
            path = _module_path(node)
            owner = next((n for n in by_length if path and _within(path, n)), None)
            if owner is not None and owner not in first:
                first[owner] = index
        return sorted(first, key=first.__getitem__)

    # -- assignment --------------------------------------------------------------------------
    def _assign(self) -> dict[str, int]:
        if not self.layers:
            raise WorkloadError("no layers: the model's forward ran no module")
        index = {name: i for i, name in enumerate(self.layers)}
        by_length = sorted(self.layers, key=len, reverse=True)
        layer_of: dict[str, int] = {}
        current = None
        owning: set[int] = set()  # layers whose module runs some operation
        checks: list[str] = []  # checks waiting for the operation after them
        for node in self.nodes:
            if _is_check(node):
                checks.append(node.name)
                continue
            path = _module_path(node)
            match = next((name for name in by_length if path and _within(path, name)), None)
            if match is not None:
                current = index[match]
                owning.add(current)
            layer_of[node.name] = current if current is not None else -1
            for check in checks:  # where the checked value is used: no value crosses for it
                layer_of[check] = layer_of[node.name]
            checks.clear()
        for check in checks:
            layer_of[check] = current if current is not None else -1
        # a name that is no module of the model would own only the root-level operations
        # around it: refused below, like a module that runs nothing
        for node in self.nodes:  # root-level nodes before the first layer join it
            if layer_of[node.name] == -1:
                layer_of[node.name] = 0
        previous = 0
        for node in self.nodes:
            layer = layer_of[node.name]
            if layer < previous:
                raise WorkloadError(
                    f"layer {self.layers[layer]!r} runs again after layer "
                    f"{self.layers[previous]!r} (node {node.name}); layers must be contiguous in "
                    "execution order: choose a coarser granularity (--depth or --layers)"
                )
            previous = layer
        empty = [name for i, name in enumerate(self.layers) if i not in owning]
        if empty:
            modules = list(
                dict.fromkeys(p.split(".")[0] for p in map(_module_path, self.nodes) if p)
            )
            raise WorkloadError(
                f"layers {empty[:6]}{'...' if len(empty) > 6 else ''} run no operation in the "
                "traced model; use module paths of the model (its top-level modules: "
                f"{', '.join(repr(m) for m in modules[:8])}{', ...' if len(modules) > 8 else ''})"
            )
        return layer_of

    # -- values crossing boundaries ------------------------------------------------------------
    def defined_in(self, value: str) -> int:
        """The layer that computes ``value`` (-1: a model input)."""
        return -1 if value in self.input_names else self.layer_of[value]

    def _users_layers(self, node: fx.Node) -> list[int]:
        out = []
        for user in node.users:
            if user.op == "output":
                out.append(len(self.layers))  # the loss, after the last layer
            elif user.name in self.layer_of:
                out.append(self.layer_of[user.name])
        return out

    def crossing(self, boundary: int) -> list[str]:
        """Values made at or before layer ``boundary`` and used after it (graph order)."""
        names = []
        for node in self.program.graph.nodes:
            if node.name not in self.input_names and node.name not in self.layer_of:
                continue
            if self.defined_in(node.name) <= boundary and any(
                layer > boundary for layer in self._users_layers(node)
            ):
                names.append(node.name)
        return names

    def value_bytes(self, value: str) -> int:
        meta = self.by_name[value].meta.get("val")
        if not isinstance(meta, torch.Tensor):
            raise WorkloadError(
                f"value {value} crosses a layer boundary but is not a tensor ({type(meta)}); "
                "choose a granularity that keeps it inside one layer"
            )
        return meta.numel() * meta.element_size()

    def cut_bytes(self, measured: Mapping[str, int] | None = None) -> list[int]:
        """Bytes live across each boundary: the traced sizes, or ``measured`` ones where given
        (a value's dtype under autocast is not the traced one)."""
        sizes = measured or {}
        return [
            sum(sizes[v] if v in sizes else self.value_bytes(v) for v in self.crossing(b))
            for b in range(len(self.layers) - 1)
        ]

    def layer_state_names(self, layer: int) -> list[str]:
        """The model's parameter and buffer names used by a layer."""
        names = []
        for node in self.nodes:
            if self.layer_of[node.name] != layer:
                continue
            for arg in node.all_input_nodes:
                name = self.tensor_names.get(arg.name)
                if name is not None and name not in names:
                    names.append(name)
        return names
