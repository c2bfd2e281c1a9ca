"""The runtime's own cost per action on this machine: what the simulator adds to every action.

The layers' times (:mod:`pipedream.profiler.chain`) are plain module calls. A pipeline stage
runs them through the runtime's :class:`~pipedream.runtime.stage_worker.StageWorker`, which pays a
fixed cost per action on top: leaf copies of the weights for stashing, the swap of the version
into the module (:class:`~pipedream.runtime.parameter_swap.ParameterSwap`),
``autograd.grad`` over inputs and weights, the weight-version bookkeeping around an update. It
is a fixed cost per action, small next to real layers but not next to small ones.

It is measured here on a stage with a single scalar weight (a middle stage of a 3-stage
``pipedream`` pipeline, so weight versions are stashed), as the time of each worker action
minus the same plain computation (the module call, its backward, the optimizer step), median
over repeats, never below 0. Stashing a version copies the stage's weights (into the memory of
a released copy), and a minibatch of several microbatches adds each gradient into ``.grad``;
both costs per MiB are measured on 16 MiB tensors. The first stage reads every microbatch's
inputs from the workload's dataset and the last stage its targets (``pipedream/data.py``):
:func:`measure_data_reads` times both on the workload's own dataset. No layer's time contains
the loss, which the last stage computes on every forward (with the runtime's check for a
non-finite value) and differentiates on every backward: :func:`measure_loss` times it on the
model's output and the dataset's targets. It is small for a mean squared error over a few
outputs (the ``mlp`` workload's is a few percent of its last stage's forward) and not for a
cross entropy over a large vocabulary.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pipedream.data import MicrobatchStream
from pipedream.formats.profile import ActionOverhead
from pipedream.model_io import map_tensors, to_device
from pipedream.precision import DEFAULT_PRECISION, autocast
from pipedream.profiler.measure import OptimizerFactory, sync_device
from pipedream.runtime.stage_worker import StageWorker, WorkerConfig
from pipedream.schedules import Op, PipelineSpec, build_tables

__all__ = [
    "cold_target_count",
    "last_level_cache_bytes",
    "measure_data_reads",
    "measure_loss",
    "measure_overhead",
]


class _Scale(nn.Module):
    """The smallest stage with a weight: ``x * w``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


_TARGET_MIB = 16
"""Size of every tensor the copy and add measurements write to."""
_DEFAULT_CACHE_BYTES = 32 * 2**20
"""Last-level cache assumed where the machine does not say."""
_MAX_TARGETS = 32
"""At most 512 MiB of targets, whatever the cache."""
_CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(device: torch.device) -> int:
    """The device's last-level cache: a GPU's L2, a Linux CPU's highest cache level in sysfs;
    :data:`_DEFAULT_CACHE_BYTES` where neither says."""
    if device.type == "cuda":
        size = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
        return size or _DEFAULT_CACHE_BYTES
    best = (0, 0)  # (level, bytes)
    for index in _CPU_CACHES.glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, (level, int(digits) * scale))
    return best[1] or _DEFAULT_CACHE_BYTES


def cold_target_count(device: torch.device) -> int:
    """Targets of :data:`_TARGET_MIB` MiB to rotate among: twice the last-level cache, at
    least 4 (64 MiB) and at most :data:`_MAX_TARGETS`."""
    cache = last_level_cache_bytes(device)
    return min(_MAX_TARGETS, max(4, math.ceil(2 * cache / (_TARGET_MIB * 2**20))))


def _ms(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    begin = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - begin) * 1000.0


def measure_overhead(
    optimizer: OptimizerFactory,
    *,
    device: torch.device,
    warmup: int = 3,
    repeats: int = 10,
    precision: str = DEFAULT_PRECISION,
) -> ActionOverhead:
    """The runtime's extra milliseconds per forward, backward and update action, its forwards
    and the plain ones it is set against in ``precision``.

    On CUDA the per-action cost is host work that overlaps the kernels already queued, so it is
    not charged (0; layers so small that their launches are the bottleneck are not modelled);
    only the copy of stashed weights, device work, is measured there.
    """

    sync = functools.partial(sync_device, device)
    copy, accumulate = _per_mib(device, sync, warmup=warmup, repeats=repeats)
    if device.type == "cuda":
        return ActionOverhead(0.0, 0.0, 0.0, copy_ms_per_mib=copy, accumulate_ms_per_mib=accumulate)
    count = warmup + max(repeats, 5)
    spec = PipelineSpec(
        schedule="pipedream",
        stage_ranks=((0,), (1,), (2,)),
        microbatches=1,
        num_minibatches=count + 2,
    )
    table = build_tables(spec, only_ranks={1})[1]
    config = WorkerConfig(stage=1, num_stages=3, microbatches=1, device=device, precision=precision)
    worker = StageWorker(
        config,
        _Scale(),
        table,
        optimizer_factory=optimizer,
        loss_fn=nn.functional.mse_loss,
        data=None,
    )
    plain = _Scale().to(device)
    plain_optimizer = optimizer(list(plain.parameters()))
    x = torch.ones(1, device=device)

    def plain_forward() -> Tensor:
        with autocast(precision, device):
            return plain(x.detach().requires_grad_(True))

    def plain_backward_ms() -> float:
        out = plain_forward()
        return _ms(lambda: torch.autograd.backward([out], [torch.ones_like(out)]), sync)

    extra: dict[Op, list[float]] = {Op.FORWARD: [], Op.BACKWARD: [], Op.UPDATE: []}
    done = 0
    for position, action in enumerate(table):
        if action.op is Op.FORWARD:
            spent = _ms(lambda a=action: worker.forward(a, [x]), sync)
            spent -= _ms(plain_forward, sync)
        elif action.op is Op.BACKWARD:
            spent = _ms(lambda a=action: worker.backward(a, [torch.ones_like(x)]), sync)
            spent -= plain_backward_ms()
        elif action.op is Op.UPDATE:
            spent = _ms(lambda p=position: worker.update(p), sync)
            spent -= _ms(plain_optimizer.step, sync)
            done += 1
        else:
            continue
        if done > warmup:
            extra[action.op].append(max(0.0, spent))
    return ActionOverhead(
        forward_ms=statistics.median(extra[Op.FORWARD]),
        backward_ms=statistics.median(extra[Op.BACKWARD]),
        update_ms=statistics.median(extra[Op.UPDATE]),
        copy_ms_per_mib=copy,
        accumulate_ms_per_mib=accumulate,
    )


def _per_mib(
    device: torch.device, sync: Callable[[], None], *, warmup: int, repeats: int
) -> tuple[float, float]:
    """Milliseconds per MiB of ``copy_`` and of ``add_`` between existing 16 MiB tensors (a
    stashed weight version, see ``runtime/weight_versions.py``; a gradient accumulated into
    ``.grad``).

    The runtime writes into memory it last touched a whole minibatch earlier (a released copy,
    the ``.grad`` of the previous backward), so the targets rotate among twice the device's
    last-level cache (:func:`cold_target_count`): one target written over and over would stay
    in the cache and measure a faster copy than the runtime gets.
    """
    source = torch.ones(_TARGET_MIB * 2**18, device=device)  # float32: 2**18 per MiB
    count_targets = cold_target_count(device)
    targets = [torch.zeros_like(source) for _ in range(count_targets)]
    count = warmup + max(repeats, 5)
    copies = [_ms(lambda i=i: targets[i % count_targets].copy_(source), sync) for i in range(count)]
    adds = [_ms(lambda i=i: targets[i % count_targets].add_(source), sync) for i in range(count)]
    return (
        statistics.median(copies[warmup:]) / _TARGET_MIB,
        statistics.median(adds[warmup:]) / _TARGET_MIB,
    )


def measure_data_reads(
    stream: MicrobatchStream, *, device: torch.device, warmup: int = 3, repeats: int = 10
) -> tuple[float, float]:
    """Milliseconds to read one microbatch's inputs and its targets onto ``device`` (medians),
    as the first and the last stage do on every forward (on a GPU through pinned memory, as
    they do); a different microbatch each time."""
    sync = functools.partial(sync_device, device)
    count = warmup + max(repeats, 5)
    inputs = [_ms(lambda i=i: to_device(stream.inputs(i), device), sync) for i in range(count)]
    targets = [_ms(lambda i=i: to_device(stream.targets(i), device), sync) for i in range(count)]
    return statistics.median(inputs[warmup:]), statistics.median(targets[warmup:])


def measure_loss(
    loss_fn: Callable[[Any, Any], Tensor],
    output: Any,
    stream: MicrobatchStream,
    *,
    device: torch.device,
    warmup: int = 3,
    repeats: int = 10,
) -> tuple[float, float]:
    """Milliseconds of the workload's loss on ``output`` (one microbatch's output of the model)
    and the targets of a different microbatch each time, with the check for a non-finite loss
    that the runtime's last stage makes on the CPU (on a GPU it reads the losses in batches,
    ``runtime/loss_log.py``), and of the loss's gradient with respect to ``output`` (medians; 0
    for the gradient of a loss that does not depend on the output)."""
    sync = functools.partial(sync_device, device)
    count = warmup + max(repeats, 5)
    check = device.type == "cpu"
    times = [
        _loss_ms(loss_fn, output, to_device(stream.targets(index), device), sync, check=check)
        for index in range(count)
    ]
    forward = statistics.median(f for f, _ in times[warmup:])
    return forward, statistics.median(b for _, b in times[warmup:])


def _loss_ms(
    loss_fn: Callable[[Any, Any], Tensor],
    output: Any,
    targets: Any,
    sync: Callable[[], None],
    *,
    check: bool,
) -> tuple[float, float]:
    """One timed loss (read on the host to ``check`` that it is finite) and its gradient (see
    :func:`measure_loss`); ``output`` is the model's output, one tensor or a structure of
    them."""
    leaves: list[Tensor] = []

    def fresh(tensor: Tensor) -> Tensor:
        leaf = tensor.detach().requires_grad_(tensor.is_floating_point())
        if leaf.requires_grad:
            leaves.append(leaf)
        return leaf

    value = map_tensors(fresh, output)
    losses: list[Tensor] = []

    def loss() -> None:
        computed = loss_fn(value, targets)
        if check:
            bool(torch.isfinite(computed.detach()))
        losses.append(computed)

    forward = _ms(loss, sync)
    if not losses[0].requires_grad or not leaves:
        return forward, 0.0
    return forward, _ms(lambda: torch.autograd.grad(losses[0], leaves, allow_unused=True), sync)
