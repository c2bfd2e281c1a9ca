"""Time every layer inside whole forward and backward passes of the model.

A layer measured alone runs with its weights and input hot in the caches, which a pipeline
stage does not enjoy: between a layer's forward and its backward the stage runs the other
layers (and other microbatches). Measured alone, the layers add up to markedly less than the
whole model's forward+backward. So, as PipeDream's profiler did, the times come from
passes over the *whole* model, with a clock read at every layer boundary:

- forward: the clock is read before the first layer and after each layer;
- backward: each layer's first autograd node to run (the last one its forward created, found
  by autograd's sequence numbers) gets a pre-hook that reads the clock, so layer ``k``'s
  backward lasts from its first node to the next lower layer's first node (the last layer
  from the ``backward`` call, layer 0 until ``backward`` returns). Autograd runs the ready node
  with the highest sequence number first, so this splits the pass at the layer boundaries; the
  times add up to the whole pass by construction.

On CUDA the clock is a CUDA event recorded on the current stream (autograd runs a node's
hooks on the stream of its forward), so the times are GPU times. Under ``bf16`` the forwards
run in autocast, as the runtime's do (:mod:`pipedream.precision`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipedream.model_io import tensors_in
from pipedream.precision import autocast

__all__ = ["ChainLayer", "time_chain"]


@dataclass(frozen=True)
class ChainLayer:
    """One layer of the model as a step of the chain: named values in, named values out."""

    module: Callable[..., Sequence[Any]]
    """Called with the values named by ``inputs``; returns the values named by ``outputs``."""
    inputs: tuple[str, ...]
    """Names of the values the layer reads."""
    outputs: tuple[str, ...]
    """Names of the values the layer produces."""


class _Clock:
    """Marks on the host clock, or CUDA events on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return float(end - start) * 1000.0
        return float(start.elapsed_time(end))

    def finish(self, last: Any) -> None:
        if self.cuda:
            last.synchronize()


def _first_nodes(outputs: list[list[Any]]) -> list[Any]:
    """Per layer, the autograd node its backward starts with (None: the layer creates none),
    from the ``grad_fn`` of each layer's outputs as they were right after the layer ran (an
    in-place layer later replaces its input's ``grad_fn``, e.g. ``nn.ReLU(inplace=True)``)."""
    nodes: list[Any] = []
    highest = -1
    for candidates in outputs:
        node = max(candidates, key=lambda n: n._sequence_nr(), default=None)
        if node is not None and node._sequence_nr() > highest:
            highest = node._sequence_nr()
            nodes.append(node)
        else:  # only values passed through from earlier layers
            nodes.append(None)
    return nodes


def _one_pass(
    layers: Sequence[ChainLayer], inputs: dict[str, Any], clock: _Clock, precision: str
) -> tuple[list[float], list[float]]:
    values = dict(inputs)
    forward_marks = [clock.mark()]
    produced: list[list[Any]] = []  # the grad_fn of each layer's outputs, right after it ran
    last: list[Tensor] = []
    with autocast(precision, clock.device):
        for layer in layers:
            outputs = layer.module(*(values[name] for name in layer.inputs))
            forward_marks.append(clock.mark())
            values.update(zip(layer.outputs, outputs))
            last = [t for value in outputs for t in tensors_in(value)]
            produced.append([t.grad_fn for t in last if t.grad_fn is not None])
    roots = [t for t in last if t.requires_grad]
    starts: dict[int, Any] = {}
    handles = []
    for index, node in enumerate(_first_nodes(produced)):
        if node is not None and index < len(layers) - 1:

            def hook(_grads: Any, index: int = index) -> None:
                starts.setdefault(index, clock.mark())

            handles.append(node.register_prehook(hook))
    seeds = [torch.ones_like(t) for t in roots]  # not a layer's work: made before the clock
    begin = clock.mark()
    if roots:
        torch.autograd.backward(roots, seeds)
    end = clock.mark()
    for handle in handles:
        handle.remove()
    clock.finish(end)
    forward = [clock.elapsed_ms(a, b) for a, b in zip(forward_marks, forward_marks[1:])]
    return forward, _backward_ms(len(layers), starts, clock, begin, end)


def _backward_ms(
    count: int, starts: dict[int, Any], clock: _Clock, begin: Any, end: Any
) -> list[float]:
    """Split the backward pass at the layers' first nodes (see the module docstring).

    A layer without a mark (it created no node) gets 0; a mark that came earlier than the one of
    a higher layer (out of order) gives that higher layer 0 and does not move the boundary back,
    so the times stay >= 0 and add up to the whole pass.
    """
    at = {index: clock.elapsed_ms(begin, mark) for index, mark in starts.items()}
    backward = [0.0] * count
    upper, upper_ms = count - 1, 0.0
    for index in range(count - 2, -1, -1):
        if index not in at:
            continue
        backward[upper] = max(0.0, at[index] - upper_ms)
        upper, upper_ms = index, max(upper_ms, at[index])
    backward[upper] = max(0.0, clock.elapsed_ms(begin, end) - upper_ms)
    return backward


def time_chain(
    layers: Sequence[ChainLayer],
    inputs: dict[str, Any],
    parameters: Iterable[nn.Parameter],
    *,
    device: torch.device,
    warmup: int,
    repeats: int,
    after_backward: Callable[[], None] | None = None,
    passes: list[tuple[float, float]] | None = None,
    precision: str = "fp32",
) -> list[tuple[float, float]]:
    """Median forward and backward milliseconds of every layer over ``repeats`` whole passes
    (after ``warmup`` untimed ones). Gradients are reset to None before each pass, as after
    ``optimizer.zero_grad()``, and left None at the end. ``after_backward`` is called after every
    pass's backward, with the gradients in place (to time the optimizer step where training
    runs it). Each timed pass's whole forward and backward milliseconds are appended to
    ``passes`` when given (how much the passes varied: :class:`~pipedream.formats.PassSpread`).
    ``precision``: the forwards' (:mod:`pipedream.precision`)."""
    params = list(parameters)
    clock = _Clock(device)
    forward: list[list[float]] = [[] for _ in layers]
    backward: list[list[float]] = [[] for _ in layers]
    with torch.enable_grad():
        for iteration in range(warmup + repeats):
            for param in params:
                param.grad = None
            f, b = _one_pass(layers, inputs, clock, precision)
            if after_backward is not None:
                after_backward()
            if iteration >= warmup:
                for index in range(len(layers)):
                    forward[index].append(f[index])
                    backward[index].append(b[index])
                if passes is not None:
                    passes.append((sum(f), sum(b)))
    for param in params:
        param.grad = None
    return [(statistics.median(f), statistics.median(b)) for f, b in zip(forward, backward)]
