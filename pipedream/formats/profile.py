"""The profile file (``format: pipedream/profile@1``): measured per-layer costs of a workload."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipedream.formats.reader import MappingReader
from pipedream.formats.yamlio import read_yaml_mapping, write_yaml
from pipedream.precision import DEFAULT_PRECISION, PRECISIONS

__all__ = [
    "MAX_LAYERS",
    "PROFILE_FORMAT",
    "ActionOverhead",
    "LayerProfile",
    "PassSpread",
    "Profile",
    "ProfileValue",
    "TiedParameter",
    "load_profile",
    "save_profile",
]

PROFILE_FORMAT = "pipedream/profile@1"

MAX_LAYERS = 4096
"""Layers a profile may have: the planner's tables hold every range of layers, so their memory
grows with the square of the layers (a two-level cluster took gigabytes at this many)."""


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of one layer, for one microbatch."""

    name: str
    """Module path of the layer in the model (``"3"`` in a Sequential, ``"blocks.2"``)."""
    type: str
    """Short description of the layer (class name and shape), for humans."""
    forward_ms: float
    """Median forward compute time in milliseconds."""
    backward_ms: float
    """Median backward compute time in milliseconds."""
    output_bytes: int
    """Bytes of the layer's output (the activation sent to the next stage if cut here)."""
    parameter_bytes: int
    """Bytes of the layer's parameters (and buffers)."""
    saved_bytes: int | None = None
    """Bytes the layer keeps alive for its backward (activation memory); optional."""
    optimizer_state_bytes: int | None = None
    """Bytes of optimizer state for the layer's parameters (e.g. 2x params for Adam); optional."""
    update_ms: float | None = None
    """The layer's share (by parameter bytes) of the median time of one step of the workload's
    optimizer over the whole model; optional."""

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "type": self.type,
            "forward_ms": round(self.forward_ms, 6),
            "backward_ms": round(self.backward_ms, 6),
            "output_bytes": self.output_bytes,
            "parameter_bytes": self.parameter_bytes,
        }
        if self.saved_bytes is not None:
            out["saved_bytes"] = self.saved_bytes
        if self.optimizer_state_bytes is not None:
            out["optimizer_state_bytes"] = self.optimizer_state_bytes
        if self.update_ms is not None:
            out["update_ms"] = round(self.update_ms, 6)
        return out

    @classmethod
    def from_reader(cls, reader: MappingReader) -> LayerProfile:
        layer = cls(
            name=reader.str("name"),
            type=reader.str("type", ""),
            forward_ms=reader.number("forward_ms"),
            backward_ms=reader.number("backward_ms"),
            output_bytes=reader.int("output_bytes"),
            parameter_bytes=reader.int("parameter_bytes"),
            saved_bytes=reader.int("saved_bytes", None),
            optimizer_state_bytes=reader.int("optimizer_state_bytes", None),
            update_ms=reader.number("update_ms", None),
        )
        reader.finish()
        return layer


@dataclass(frozen=True)
class ActionOverhead:
    """The runtime's own cost per action on the profiled machine, beyond the layers' compute.

    Measured by running the runtime's stage worker on a stage with a single scalar weight: the
    fixed cost of an action (stashing and functional calls, the autograd call, the optimizer
    call), which small layers feel and the simulator adds to every action. Reading a
    microbatch from the workload's dataset is measured on the workload itself: the first stage
    pays it for the inputs, the last stage for the targets, on every forward. So is the loss,
    which no layer's time contains: the last stage computes it on every forward and its
    gradient on every backward.
    """

    forward_ms: float
    """Per forward action."""
    backward_ms: float
    """Per backward action."""
    update_ms: float
    """Per optimizer update."""
    copy_ms_per_mib: float = 0.0
    """Copying weights for weight stashing, per MiB of parameters (charged to the update that
    creates a stashed version); optional."""
    accumulate_ms_per_mib: float = 0.0
    """Adding a microbatch's gradient into ``.grad``, per MiB of parameters (every backward of
    a minibatch but its first, when it has several microbatches); optional."""
    inputs_ms: float = 0.0
    """Reading one microbatch's inputs from the dataset (every forward of the first stage);
    optional."""
    targets_ms: float = 0.0
    """Reading one microbatch's targets from the dataset (every forward of the last stage);
    optional."""
    loss_forward_ms: float = 0.0
    """The workload's loss of one microbatch's output and its check for a non-finite value
    (every forward of the last stage); optional."""
    loss_backward_ms: float = 0.0
    """The gradient of that loss with respect to the output (every backward of the last
    stage); optional."""

    def to_dict(self) -> dict[str, Any]:
        out = {
            "forward_ms": round(self.forward_ms, 6),
            "backward_ms": round(self.backward_ms, 6),
            "update_ms": round(self.update_ms, 6),
        }
        if self.copy_ms_per_mib:
            out["copy_ms_per_mib"] = round(self.copy_ms_per_mib, 6)
        if self.accumulate_ms_per_mib:
            out["accumulate_ms_per_mib"] = round(self.accumulate_ms_per_mib, 6)
        if self.inputs_ms:
            out["inputs_ms"] = round(self.inputs_ms, 6)
        if self.targets_ms:
            out["targets_ms"] = round(self.targets_ms, 6)
        if self.loss_forward_ms:
            out["loss_forward_ms"] = round(self.loss_forward_ms, 6)
        if self.loss_backward_ms:
            out["loss_backward_ms"] = round(self.loss_backward_ms, 6)
        return out

    @classmethod
    def from_reader(cls, reader: MappingReader) -> ActionOverhead:
        overhead = cls(
            forward_ms=reader.number("forward_ms"),
            backward_ms=reader.number("backward_ms"),
            update_ms=reader.number("update_ms"),
            copy_ms_per_mib=reader.number("copy_ms_per_mib", 0.0),
            accumulate_ms_per_mib=reader.number("accumulate_ms_per_mib", 0.0),
            inputs_ms=reader.number("inputs_ms", 0.0),
            targets_ms=reader.number("targets_ms", 0.0),
            loss_forward_ms=reader.number("loss_forward_ms", 0.0),
            loss_backward_ms=reader.number("loss_backward_ms", 0.0),
        )
        reader.finish()
        return overhead


@dataclass(frozen=True)
class PassSpread:
    """How much the profiler's whole passes varied: each timed pass's forward (backward) time
    over the median of them.

    The layers' times are medians; a pipeline's actions vary around them (a busy host, caches,
    interrupts), and a stage that runs late holds up its neighbours, which a simulation with
    fixed times does not see. ``pipedream simulate --spread`` draws every forward and backward
    from these ratios.
    """

    forward: tuple[float, ...]
    """Per timed pass: its forward time / the median forward time."""
    backward: tuple[float, ...]
    """Per timed pass: its backward time / the median backward time."""

    def __post_init__(self) -> None:
        assert self.forward and self.backward, self
        assert min(self.forward) > 0 and min(self.backward) > 0, self

    @classmethod
    def from_passes(cls, passes: Sequence[tuple[float, float]]) -> PassSpread | None:
        """From each pass's (forward ms, backward ms); None without passes, or if one took no
        time (a model too fast for the clock)."""
        if not passes or min(min(f, b) for f, b in passes) <= 0:
            return None
        forward = statistics.median(f for f, _ in passes)
        backward = statistics.median(b for _, b in passes)
        return cls(tuple(f / forward for f, _ in passes), tuple(b / backward for _, b in passes))

    def to_dict(self) -> dict[str, Any]:
        return {
            "forward": [round(ratio, 4) for ratio in self.forward],
            "backward": [round(ratio, 4) for ratio in self.backward],
        }

    @classmethod
    def from_reader(cls, reader: MappingReader) -> PassSpread:
        ratios = []
        for key in ("forward", "backward"):
            raw = reader.list(key)
            entries = {f"{key}[{i}]": value for i, value in enumerate(raw)}
            items = MappingReader(entries, source=reader.source, path=reader.path)
            ratios.append(tuple(items.number(name, positive=True) for name in entries))
        reader.finish()
        return cls(*ratios)


@dataclass(frozen=True)
class ProfileValue:
    """A tensor that crosses layers: made by one layer (or a model input) and used by later
    layers or the loss.

    A traced model's values say exactly what a plan's stages send each other: a stage sends
    every value it makes (the first stage: every model input) to each later stage that uses it,
    directly, so a skip connection is one message from its producer's stage to its consumer's,
    not a relay through the stages between. A profile without them (an ``nn.Sequential``, an
    older profile) describes a chain: each stage sends ``cut_bytes`` to the next.
    """

    name: str
    """The value's name in the traced graph."""
    bytes: int
    """Its size for one microbatch."""
    made_by: str | None
    """The layer that computes it; None: a model input (the first stage reads it)."""
    used_by: tuple[str, ...]
    """The later layers that use it, in model order."""
    loss: bool = False
    """Whether the loss uses it (a model output): the last stage then needs it."""
    grad: bool = True
    """Whether a gradient flows back along it (not for integer ids, masks, detached values)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "bytes": self.bytes}
        if self.made_by is not None:
            out["made_by"] = self.made_by
        out["used_by"] = list(self.used_by)
        if self.loss:
            out["loss"] = True
        if not self.grad:
            out["grad"] = False
        return out

    @classmethod
    def from_reader(cls, reader: MappingReader, layer_names: Sequence[str]) -> ProfileValue:
        order = {layer: i for i, layer in enumerate(layer_names)}
        name = reader.str("name")
        size = reader.int("bytes")
        made_by = reader.str("made_by", None)
        if made_by is not None and made_by not in order:
            raise reader.error(
                "made_by",
                f"names {made_by!r}, which is not a layer of the profile",
                "name the layer that computes the value, or leave it out for a model input",
            )
        raw = reader.list("used_by", [], nonempty=False)
        entries = {f"used_by[{i}]": value for i, value in enumerate(raw)}
        items = MappingReader(entries, source=reader.source, path=reader.path)
        used_by = [items.str(key) for key in entries]
        start = -1 if made_by is None else order[made_by]
        for key, layer in zip(entries, used_by):
            if layer not in order:
                raise reader.error(
                    key,
                    f"names {layer!r}, which is not a layer of the profile",
                    "list the layers that use the value",
                )
            if order[layer] <= start:
                raise reader.error(
                    key,
                    f"layer {layer!r} does not come after {made_by!r}, which makes the value",
                    "a value flows forward: list only later layers",
                )
        loss = reader.bool("loss", False)
        if not used_by and not loss:
            raise reader.error(
                "used_by",
                "is empty and the loss does not use the value either",
                "drop the entry, or list the layers that use it",
            )
        value = cls(
            name,
            size,
            made_by,
            tuple(sorted(set(used_by), key=order.__getitem__)),
            loss,
            reader.bool("grad", True),
        )
        reader.finish()
        return value


@dataclass(frozen=True)
class TiedParameter:
    """A parameter that several layers use (a language model's embedding and output head).

    Its bytes are counted once, in ``parameter_bytes`` (and ``optimizer_state_bytes``) of the
    first layer that uses it. A plan that puts its layers in different stages gives each later
    stage a copy (its memory) and exchanges the copies' gradients and new versions with the
    first stage after every update (their transfer time).
    """

    name: str
    """The parameter's name in the model (the first one, if it has several)."""
    layers: tuple[str, ...]
    """The layers that use it, in model order (two or more)."""
    bytes: int
    """Its size."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layers": list(self.layers), "bytes": self.bytes}

    @classmethod
    def from_reader(cls, reader: MappingReader, layer_names: Sequence[str]) -> TiedParameter:
        name = reader.str("name")
        raw = reader.list("layers")
        entries = {f"layers[{i}]": value for i, value in enumerate(raw)}
        items = MappingReader(entries, source=reader.source, path=reader.path)
        names = [items.str(key) for key in entries]
        order = {layer: i for i, layer in enumerate(layer_names)}
        unknown = [layer for layer in names if layer not in order]
        if unknown:
            raise reader.error(
                "layers",
                f"names {unknown[0]!r}, which is not a layer of the profile",
                "list the names of the layers that use the parameter",
            )
        if len(set(names)) < 2:
            raise reader.error(
                "layers",
                f"lists {len(set(names))} distinct layer(s)",
                "a tied parameter is used by two or more layers; drop the entry otherwise",
            )
        tied = cls(name, tuple(sorted(set(names), key=order.__getitem__)), reader.int("bytes"))
        reader.finish()
        return tied


@dataclass(frozen=True)
class Profile:
    """Per-layer costs of a workload, layers in execution (topological) order."""

    workload: str
    """Workload name or ``package.module:function`` the profile was measured on."""
    microbatch_size: int
    """Samples per microbatch during measurement."""
    device: str
    """Device the measurement ran on (``cpu``, ``cuda:0``, or ``pipedream-import``)."""
    dtype: str
    """Data type of the parameters during measurement (``float32``)."""
    layers: tuple[LayerProfile, ...]
    """The layers in execution order."""
    cut_bytes: tuple[int, ...] | None = None
    """Bytes live across the boundary after each layer (len(layers) - 1); None: output_bytes."""
    workload_args: dict[str, str] = field(default_factory=dict)
    """``--workload-arg`` options the workload was built with."""
    overhead: ActionOverhead | None = None
    """The runtime's cost per action on the profiled machine (``overhead_ms``); optional."""
    concurrent: int = 1
    """Processes training on the host while it was measured, the measuring one included
    (``pipedream profile --concurrent``: CPU ranks sharing a host); optional, default 1."""
    spread: PassSpread | None = None
    """How much the profiler's whole passes varied (``pass_spread``); optional."""
    tied: tuple[TiedParameter, ...] = ()
    """Parameters used by several layers (``tied``); optional."""
    values: tuple[ProfileValue, ...] | None = None
    """Every tensor that crosses layers (``values``: skip connections, model inputs used
    later); None: a chain, each layer feeding the next."""
    precision: str = DEFAULT_PRECISION
    """What the forwards ran in (:mod:`pipedream.precision`): ``fp32``, the model's own dtypes,
    ``bf16`` or ``fp16``, autocast to bfloat16 or float16 (``pipedream profile --precision``);
    optional."""
    device_memory: int | None = None
    """Bytes of memory of the device measured on (a GPU's total; None on the CPU, whose memory
    the ranks of a host share): ``pipedream plan``'s limit per worker unless told another."""
    input_bytes: int | None = None
    """Bytes of one microbatch of the model's input, which the first stage keeps per
    microbatch in flight when it recomputes its activations; optional (None: not measured)."""

    def __post_init__(self) -> None:
        assert self.cut_bytes is None or len(self.cut_bytes) == len(self.layers) - 1
        assert self.concurrent >= 1

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def boundary_bytes(self, index: int) -> int:
        """Bytes crossing the cut right after layer ``index`` (0-based)."""
        if self.cut_bytes is not None:
            return self.cut_bytes[index]
        return self.layers[index].output_bytes

    def index_of(self, name: str) -> int:
        for index, layer in enumerate(self.layers):
            if layer.name == name:
                return index
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "workload": self.workload,
        }
        if self.workload_args:
            out["workload_args"] = dict(self.workload_args)
        out.update(
            {
                "microbatch_size": self.microbatch_size,
                "device": self.device,
                "dtype": self.dtype,
            }
        )
        if self.precision != DEFAULT_PRECISION:
            out["precision"] = self.precision
        if self.device_memory is not None:
            out["device_memory"] = self.device_memory
        if self.input_bytes is not None:
            out["input_bytes"] = self.input_bytes
        if self.concurrent != 1:
            out["concurrent"] = self.concurrent
        out["layers"] = [layer.to_dict() for layer in self.layers]
        if self.cut_bytes is not None:
            out["cut_bytes"] = list(self.cut_bytes)
        if self.overhead is not None:
            out["overhead_ms"] = self.overhead.to_dict()
        if self.spread is not None:
            out["pass_spread"] = self.spread.to_dict()
        if self.tied:
            out["tied"] = [tied.to_dict() for tied in self.tied]
        if self.values is not None:
            out["values"] = [value.to_dict() for value in self.values]
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<profile>") -> Profile:
        reader = MappingReader(data, source=source)
        fmt = reader.str("format")
        if fmt != PROFILE_FORMAT:
            raise reader.error(
                "format", f"expected {PROFILE_FORMAT!r}, got {fmt!r}", "is this a profile file?"
            )
        workload = reader.str("workload")
        args = reader.options("workload_args")
        microbatch_size = reader.int("microbatch_size", minimum=1)
        device = reader.str("device")
        dtype = reader.str("dtype")
        precision = reader.choice("precision", PRECISIONS, DEFAULT_PRECISION)
        device_memory = reader.int("device_memory", None, minimum=1)
        input_bytes = reader.int("input_bytes", None, minimum=0)
        concurrent = reader.int("concurrent", 1, minimum=1)
        raw_layers = reader.list("layers")
        if len(raw_layers) > MAX_LAYERS:
            raise reader.error(
                "layers",
                f"{len(raw_layers)} layers, at most {MAX_LAYERS} supported (planning grows "
                "with the square of the layers)",
                "profile coarser layers: a smaller --depth, or --layers patterns",
            )
        layers = []
        names: set[str] = set()
        for i, raw in enumerate(raw_layers):
            layer = LayerProfile.from_reader(reader.child(raw, f"layers[{i}]"))
            if layer.name in names:
                raise reader.error(
                    f"layers[{i}].name",
                    f"duplicate layer name {layer.name!r}",
                    "layer names must be unique",
                )
            names.add(layer.name)
            layers.append(layer)
        raw_cuts = reader.list("cut_bytes", None, nonempty=False)
        cuts: tuple[int, ...] | None = None
        if raw_cuts is not None:
            if len(raw_cuts) != len(layers) - 1:
                raise reader.error(
                    "cut_bytes",
                    f"has {len(raw_cuts)} entries but the profile has {len(layers)} layers",
                    "give one entry per boundary (number of layers - 1)",
                )
            cut_reader = MappingReader(
                {f"cut_bytes[{i}]": v for i, v in enumerate(raw_cuts)}, source=source
            )
            cuts = tuple(cut_reader.int(f"cut_bytes[{i}]") for i in range(len(raw_cuts)))
        raw_overhead = reader.mapping("overhead_ms", None)
        overhead = None
        if raw_overhead is not None:
            overhead = ActionOverhead.from_reader(reader.child(raw_overhead, "overhead_ms"))
        raw_spread = reader.mapping("pass_spread", None)
        spread = None
        if raw_spread is not None:
            spread = PassSpread.from_reader(reader.child(raw_spread, "pass_spread"))
        tied = tuple(
            TiedParameter.from_reader(reader.child(raw, f"tied[{i}]"), [lay.name for lay in layers])
            for i, raw in enumerate(reader.list("tied", [], nonempty=False))
        )
        raw_values = reader.list("values", None, nonempty=False)
        values = None
        if raw_values is not None:
            names_in_order = [layer.name for layer in layers]
            values = tuple(
                ProfileValue.from_reader(reader.child(raw, f"values[{i}]"), names_in_order)
                for i, raw in enumerate(raw_values)
            )
            if not values and len(layers) > 1:
                raise reader.error(
                    "values",
                    f"is empty, but the profile's {len(layers)} layers must pass tensors on",
                    "list the tensors that cross layers, or leave `values` out for a chain",
                )
        reader.finish()
        return cls(
            workload=workload,
            microbatch_size=microbatch_size,
            device=device,
            dtype=dtype,
            layers=tuple(layers),
            precision=precision,
            device_memory=device_memory,
            input_bytes=input_bytes,
            cut_bytes=cuts,
            workload_args=args,
            overhead=overhead,
            concurrent=concurrent,
            spread=spread,
            tied=tied,
            values=values,
        )


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Load and validate a profile YAML file."""
    return Profile.from_dict(read_yaml_mapping(path, what="profile"), source=str(path))


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write ``profile`` atomically as YAML."""
    write_yaml(
        path,
        profile.to_dict(),
        header=f"pipedream profile of {profile.workload}: {len(profile.layers)} layers",
    )
