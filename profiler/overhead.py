"""The runtime's own cost per action on this machine: what the simulator adds to every action.

The layers' times (:mod:`pipedream.profiler.chain`) are plain module calls. A pipeline stage
runs them through the runtime's :class:`~pipedream.runtime.worker.StageWorker`, which pays a
fixed cost per action on top: leaf copies of the weights for stashing, ``functional_call``,
``autograd.grad`` over inputs and weights, the weight-version bookkeeping around an update. It
is about 0.2 ms per action on a CPU core, small next to real layers but not next to small ones.

It is measured here on a stage with a single scalar weight (a middle stage of a 3-stage
``pipedream`` pipeline, so weight versions are stashed), as the time of each worker action
minus the same plain computation (the module call, its backward, the optimizer step), median
over repeats, never below 0. Stashing a version copies the stage's weights (into the memory of
a released copy), and a minibatch of several microbatches adds each gradient into ``.grad``;
both costs per MiB are measured on 16 MiB tensors. The first stage reads every microbatch's
inputs from the workload's dataset and the last stage its targets (``pipedream/data.py``):
:func:`measure_data_reads` times both on the workload's own dataset.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from pipedream.data import MicrobatchStream
from pipedream.formats.profile import ActionOverhead
from pipedream.profiler.measure import OptimizerFactory, sync_device
from pipedream.runtime.actions import Op
from pipedream.runtime.schedule import PipelineSpec, build_tables
from pipedream.runtime.worker import StageWorker, WorkerConfig

__all__ = ["measure_data_reads", "measure_overhead"]


class _Scale(nn.Module):
    """The smallest stage with a weight: ``x * w``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


_COLD_TARGETS = 4
"""Tensors of 16 MiB the copy and add measurements write to in turn (64 MiB: colder than a
last-level cache of 32 MiB)."""


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
) -> ActionOverhead:
    """The runtime's extra milliseconds per forward, backward and update action.

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
    config = WorkerConfig(stage=1, num_stages=3, microbatches=1, device=device)
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

    def plain_backward_ms() -> float:
        out = plain(x.detach().requires_grad_(True))
        return _ms(lambda: torch.autograd.backward([out], [torch.ones_like(out)]), sync)

    extra: dict[Op, list[float]] = {Op.FORWARD: [], Op.BACKWARD: [], Op.UPDATE: []}
    done = 0
    for position, action in enumerate(table):
        if action.op is Op.FORWARD:
            spent = _ms(lambda a=action: worker.forward(a, [x]), sync)
            spent -= _ms(lambda: plain(x.detach().requires_grad_(True)), sync)
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
    stashed weight version, see ``runtime/weights.py``; a gradient accumulated into ``.grad``).

    The runtime writes into memory it last touched a whole minibatch earlier (a released copy,
    the ``.grad`` of the previous backward), so the targets rotate among
    :data:`_COLD_TARGETS` tensors, more than a CPU's last-level cache holds: one target written
    over and over stays in the cache and measured 0.087 ms/MiB on this project's test machine,
    rotating targets 0.107 ms/MiB.
    """
    mib = 16
    source = torch.ones(mib * 2**18, device=device)  # float32: 2**18 per MiB
    targets = [torch.zeros_like(source) for _ in range(_COLD_TARGETS)]
    count = warmup + max(repeats, 5)
    copies = [_ms(lambda i=i: targets[i % _COLD_TARGETS].copy_(source), sync) for i in range(count)]
    adds = [_ms(lambda i=i: targets[i % _COLD_TARGETS].add_(source), sync) for i in range(count)]
    return statistics.median(copies[warmup:]) / mib, statistics.median(adds[warmup:]) / mib


def measure_data_reads(
    stream: MicrobatchStream, *, device: torch.device, warmup: int = 3, repeats: int = 10
) -> tuple[float, float]:
    """Milliseconds to read one microbatch's inputs and its targets onto ``device`` (medians),
    as the first and the last stage do on every forward; a different microbatch each time."""
    sync = functools.partial(sync_device, device)
    count = warmup + max(repeats, 5)
    inputs = [_ms(lambda i=i: stream.inputs(i).to(device), sync) for i in range(count)]
    targets = [_ms(lambda i=i: stream.targets(i).to(device), sync) for i in range(count)]
    return statistics.median(inputs[warmup:]), statistics.median(targets[warmup:])
