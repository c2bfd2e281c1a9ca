"""Measure every layer of an ``nn.Sequential``: compute times, bytes sent, memory kept.

Each child of the Sequential is one layer (its name is the child's name, as in ``state_dict``
keys).

- ``forward_ms`` / ``backward_ms``: medians over ``repeats`` whole forward+backward passes of
  the model (after ``warmup`` untimed ones), split at the layer boundaries
  (:mod:`pipedream.profiler.chain`): each layer's time as it runs inside the model, caches
  included, and the layers add up to the whole pass. The backward includes the parameter
  gradients and the gradient of the layer's input (what a stage sends back); the model's input
  gets no gradient, as on the first stage.
- ``output_bytes``: bytes of the output (summed over tensors if it is a tuple/list/dict).
- ``parameter_bytes``: parameters plus buffers; a tensor several layers use (tied weights) counts
  in the first of them only, and :func:`tied_parameters` lists the layers that share it.
- ``saved_bytes``: storages that autograd keeps for backward (found with
  ``torch.autograd.graph.saved_tensors_hooks``), each distinct storage once, *excluding* the
  layer's parameters/buffers (counted in ``parameter_bytes``) and the layer's input (it is the
  previous layer's output, counted there or stashed by the stage). So the activation memory of a
  stage for one microbatch is about its input bytes plus the sum of its layers' ``saved_bytes``.
- ``optimizer_state_bytes``: state tensors the workload's optimizer creates over copies of the
  layer's parameters (0 bytes for plain SGD, 2x parameters for Adam, ...);
- ``update_ms``: the layer's share of the median time of one step of that optimizer over the
  whole model's parameters, right after each whole backward pass (:class:`UpdateTimer`).

Times on CUDA use CUDA events (GPU time of the work); on CPU ``time.perf_counter``. The number of
CPU threads is torch's setting; this module leaves it alone. Under ``precision`` ``bf16`` every
forward runs in autocast, as the runtime's do (:mod:`pipedream.precision`): the times, the
outputs' bytes (what a stage sends: bfloat16 after a matmul) and the memory kept for backward
(bfloat16 copies of inputs and weights among it) are those of such a run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipedream.errors import PipedreamError
from pipedream.formats.profile import LayerProfile, TiedParameter
from pipedream.precision import autocast
from pipedream.profiler.chain import ChainLayer, time_chain

__all__ = [
    "OptimizerFactory",
    "ProfilerError",
    "UpdateTimer",
    "check_repetitions",
    "describe_layer",
    "layer_inputs",
    "measure_sequential",
    "sync_device",
    "tensors_in",
    "tied_parameters",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ProfilerError(PipedreamError):
    """The model or the measurement options cannot be profiled as given."""


def tensors_in(value: Any) -> list[Tensor]:
    """The tensors in a layer's output: a tensor, or nested tuples/lists/dicts of them."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    return []


def _nbytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_key(tensor: Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def _storage_nbytes(tensor: Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return tensor.numel() * tensor.element_size()


def _fresh_input(x: Any) -> Any:
    """A detached copy of the layer input (same storage) that requires grad where it can."""
    if isinstance(x, Tensor):
        detached = x.detach()
        return detached.requires_grad_(True) if detached.is_floating_point() else detached
    if isinstance(x, (tuple, list)):
        return type(x)(_fresh_input(item) for item in x)
    return x


def _describe(layer: nn.Module, output: list[Tensor]) -> str:
    """``Linear+ReLU -> [32, 64]``: class names (a Sequential's children) and output shape."""
    if isinstance(layer, nn.Sequential):
        kind = "+".join(type(child).__name__ for child in layer) or "Sequential"
    else:
        kind = type(layer).__name__
    shapes = ", ".join(str(list(t.shape)) for t in output)
    return f"{kind} -> {shapes}" if shapes else kind


def layer_inputs(model: nn.Sequential, example_input: Any, precision: str = "fp32") -> list[Any]:
    """The input each child sees when ``example_input`` runs through ``model`` (no grad) in
    ``precision``."""
    inputs = []
    x = example_input
    device = _device_of(model)
    with torch.no_grad(), autocast(precision, device):
        for layer in model:
            inputs.append(x)
            x = layer(x)
    return inputs


def _device_of(module: nn.Module, inputs: Any = None) -> torch.device:
    """Where ``module`` computes: the device of its first input tensor, else of its parameters
    (the CPU for neither). A layer without parameters (a softmax) computes on its input's."""
    for tensor in tensors_in(inputs):
        return tensor.device
    param = next(iter(module.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def _saved_bytes(layer: nn.Module, x: Any, precision: str) -> int:
    fresh = _fresh_input(x)
    excluded = {_storage_key(t) for t in (*layer.parameters(), *layer.buffers())}
    excluded.update(_storage_key(t) for t in tensors_in(fresh))
    seen: dict[tuple[str, int], int] = {}

    def pack(tensor: Tensor) -> Tensor:
        key = _storage_key(tensor)
        if key not in excluded:
            seen[key] = _storage_nbytes(tensor)
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    with hooks, autocast(precision, _device_of(layer, x)):
        output = layer(fresh)  # kept alive while counting, so storage addresses stay unique
    del output
    return sum(seen.values())


def _optimizer_state_bytes(
    layer: nn.Module, optimizer: OptimizerFactory, skip: Collection[int] = ()
) -> int:
    """Bytes of state the optimizer creates in one step over copies of the layer's parameters
    (the layer itself is not touched), but for those whose ``id`` is in ``skip``."""
    params = [p for p in layer.parameters() if p.requires_grad and id(p) not in skip]
    if not params:
        return 0
    copies = [nn.Parameter(torch.zeros_like(p)) for p in params]
    for clone in copies:
        clone.grad = torch.zeros_like(clone)
    opt = optimizer(copies)
    opt.step()
    return sum(
        _nbytes([value])
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, Tensor)
    )


class UpdateTimer:
    """Each layer's share of one optimizer step over the whole model, in ms.

    Called right after each whole backward pass (``time_chain``'s ``after_backward``), it times
    one step of the workload's optimizer over the model's live parameters and gradients, as the
    runtime's update runs: the weights and gradients are where the backward left them in the
    caches. (A step over fresh copies of the parameters, repeated back to back, finds them hot
    in the caches and runs markedly faster than the same step after a backward.) The step is then
    undone: the parameters get their values back, so profiling leaves the model as it was (the
    optimizer is the timer's own; the saved values cost one more copy of the parameters). The
    median step is split among the layers in proportion to their trainable parameter bytes.
    """

    def __init__(self, layers: Sequence[nn.Module], optimizer: OptimizerFactory) -> None:
        seen: set[int] = set()  # a parameter shared by several layers counts for the first
        owned: list[list[nn.Parameter]] = []
        for layer in layers:
            params = [p for p in layer.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in params)
            owned.append(params)
        self._sizes = [float(_nbytes(params)) for params in owned]
        self._params = [p for params in owned for p in params]
        self._optimizer = optimizer(self._params) if self._params else None
        self._times: list[float] = []
        self._saved: list[Tensor] | None = None

    def __call__(self) -> None:
        """Time one step over the current gradients, then restore the parameters."""
        if self._optimizer is None:
            return
        device = self._params[0].device
        if self._saved is None:  # once: the values never change (every step is undone), and
            with torch.no_grad():  # new memory on every pass would change the backward's timing
                self._saved = [p.detach().clone() for p in self._params]
        sync_device(device)
        begin = time.perf_counter()
        self._optimizer.step()
        sync_device(device)
        self._times.append((time.perf_counter() - begin) * 1000.0)
        with torch.no_grad():
            for param, value in zip(self._params, self._saved):
                param.copy_(value)

    def shares(self, *, skip: int) -> list[float]:
        """The median step after the first ``skip`` (at least the first, which creates the
        optimizer's state, when there are others), split by parameter bytes."""
        total_bytes = sum(self._sizes)
        if not self._times or total_bytes == 0:
            return [0.0] * len(self._sizes)
        times = self._times[min(max(1, skip), len(self._times) - 1) :]
        total = statistics.median(times)
        return [total * size / total_bytes for size in self._sizes]


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MAX_REPETITIONS = 100_000
"""Most warm-up or timed runs per layer: a median of more moves nothing, and far more ran
(every layer, forward and backward) for longer than anyone would wait."""


def check_repetitions(warmup: int, repeats: int) -> None:
    """Reject a ``warmup`` outside 0..:data:`MAX_REPETITIONS` or ``repeats`` outside
    1..:data:`MAX_REPETITIONS` with a message naming the option."""
    if not 0 <= warmup <= MAX_REPETITIONS:
        raise ProfilerError(f"warmup (--warmup) must be 0 to {MAX_REPETITIONS}, got {warmup}")
    if not 1 <= repeats <= MAX_REPETITIONS:
        raise ProfilerError(f"repeats (--repeats) must be 1 to {MAX_REPETITIONS}, got {repeats}")


def describe_layer(
    name: str,
    layer: nn.Module,
    x: Any,
    *,
    warmup: int = 3,
    repeats: int = 10,
    optimizer: OptimizerFactory | None = None,
    counted: set[int] | None = None,
    precision: str = "fp32",
) -> LayerProfile:
    """Everything about one layer on input ``x`` in ``precision`` except its compute times (0
    here; they come from whole passes, :func:`pipedream.profiler.chain.time_chain`).

    ``counted`` holds the ``id`` of every parameter and buffer an earlier layer counted: the
    layer's bytes leave them out, and its own are added to it (tied weights count once).
    """
    check_repetitions(warmup, repeats)
    with torch.enable_grad():
        with autocast(precision, _device_of(layer, x)):
            output = tensors_in(layer(_fresh_input(x)))
        saved = _saved_bytes(layer, x, precision)
    skip = set() if counted is None else set(counted)
    state_bytes = None if optimizer is None else _optimizer_state_bytes(layer, optimizer, skip)
    own = [t for t in (*layer.parameters(), *layer.buffers()) if id(t) not in skip]
    if counted is not None:
        counted.update(id(t) for t in own)
    return LayerProfile(
        name=name,
        type=_describe(layer, output),
        forward_ms=0.0,
        backward_ms=0.0,
        output_bytes=_nbytes(output),
        parameter_bytes=_nbytes(own),
        saved_bytes=saved,
        optimizer_state_bytes=state_bytes,
    )


def tied_parameters(
    layers: Sequence[tuple[str, Iterable[tuple[str, Tensor]]]],
) -> list[TiedParameter]:
    """The parameters that several layers use, from each layer's (name, named parameters).

    A parameter is named by the first name it has (that of the first layer using it, as
    ``named_parameters()`` of the whole model names it).
    """
    users: dict[int, tuple[str, list[str], int]] = {}
    for layer, params in layers:
        for name, param in params:
            known = users.setdefault(id(param), (name, [], param.numel() * param.element_size()))
            if layer not in known[1]:
                known[1].append(layer)
    return [
        TiedParameter(name, tuple(used), size)
        for name, used, size in users.values()
        if len(used) > 1
    ]


def measure_sequential(
    model: nn.Module,
    example_input: Any,
    *,
    warmup: int = 3,
    repeats: int = 10,
    optimizer: OptimizerFactory | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    passes: list[tuple[float, float]] | None = None,
    precision: str = "fp32",
) -> list[LayerProfile]:
    """Measure every child of ``model`` (an ``nn.Sequential``) on the device of its parameters,
    in ``precision`` (:mod:`pipedream.precision`).

    ``example_input`` is moved to that device. ``progress(i, n, name)`` is called before each layer.
    Each timed whole pass's forward and backward milliseconds are appended to ``passes`` when
    given.
    """
    if not isinstance(model, nn.Sequential):
        raise ProfilerError(
            f"the model is a {type(model).__name__}, not an nn.Sequential: graph-based profiling "
            "of non-Sequential models is not supported yet; wrap the layers in nn.Sequential "
            "(one child per layer, each taking one tensor and returning one tensor)"
        )
    if len(model) == 0:
        raise ProfilerError("the model is an empty nn.Sequential; give it at least one layer")
    check_repetitions(warmup, repeats)
    device = _device_of(model)
    if isinstance(example_input, Tensor):
        example_input = example_input.to(device)
    inputs = layer_inputs(model, example_input, precision)
    profiles = []
    counted: set[int] = set()
    for index, ((name, layer), x) in enumerate(zip(model.named_children(), inputs)):
        if progress is not None:
            progress(index, len(model), name)
        profiles.append(
            describe_layer(
                name,
                layer,
                x,
                warmup=warmup,
                repeats=repeats,
                optimizer=optimizer,
                counted=counted,
                precision=precision,
            )
        )
    chain = [
        ChainLayer(_single(layer), (str(index),), (str(index + 1),))
        for index, layer in enumerate(model)
    ]
    timer = UpdateTimer(list(model), optimizer) if optimizer is not None else None
    times = time_chain(
        chain,
        {"0": example_input},
        model.parameters(),
        device=device,
        warmup=warmup,
        repeats=repeats,
        after_backward=timer,
        passes=passes,
        precision=precision,
    )
    updates: list[float | None] = [None] * len(profiles)
    if timer is not None:
        updates = list(timer.shares(skip=warmup))
    return [
        dataclasses.replace(profile, forward_ms=forward, backward_ms=backward, update_ms=update)
        for profile, (forward, backward), update in zip(profiles, times, updates)
    ]


def _single(layer: nn.Module) -> Callable[[Any], tuple[Any]]:
    """A Sequential child as a chain step: one value in, one value out."""
    return lambda x: (layer(x),)
