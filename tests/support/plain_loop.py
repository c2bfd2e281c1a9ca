"""Plain PyTorch training of a workload, the reference one stage of the runtime must equal."""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR

from pipedream.data import MicrobatchStream
from pipedream.model_io import call_model, map_tensors
from pipedream.precision import loss_input
from pipedream.workload import load_workload

__all__ = ["plain_loop"]


def plain_loop(
    workload: str,
    workload_args: dict[str, str],
    *,
    steps: int,
    microbatches: int,
    microbatch_size: int,
    device: str = "cpu",
    precision: str = "fp32",
    seed: int = 0,
    clip: float | None = None,
    scales: list[float] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``steps`` optimizer steps over the runtime's microbatches (same seed, same order), each
    the mean of ``microbatches`` microbatches' losses (with ``clip``, ``clip_grad_norm_``
    before each step; with ``fp16``, ``GradScaler``, whose scale after each step goes to
    ``scales``): the weights (on the CPU) and each step's mean loss. On the CPU it
    computes with one thread, as every rank the tests launch does (another thread count sums
    in another order: Adam turns that into 1e-4 differences)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(
            workload,
            workload_args,
            steps,
            microbatches,
            microbatch_size,
            device,
            precision,
            seed,
            clip,
            scales,
        )
    finally:
        torch.set_num_threads(threads)


def _train(
    workload: str,
    workload_args: dict[str, str],
    steps: int,
    microbatches: int,
    microbatch_size: int,
    device: str,
    precision: str,
    seed: int,
    clip: float | None,
    scales: list[float] | None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    built = load_workload(workload, workload_args, microbatch_size=microbatch_size)
    model = built.model.to(device)
    data = MicrobatchStream(built.dataset, microbatch_size, seed)
    optimizer = built.optimizer(model.parameters())
    # the workload's schedule as a plain loop applies it: stepped once per minibatch
    schedule = LambdaLR(optimizer, built.lr_schedule) if built.lr_schedule else None
    scaler = torch.amp.GradScaler(torch.device(device).type) if precision == "fp16" else None
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(microbatches):
            inputs, targets = data.microbatch(step * microbatches + j)
            inputs = map_tensors(lambda t: t.to(device), inputs)
            targets = map_tensors(lambda t: t.to(device), targets)
            dtype = torch.float16 if precision == "fp16" else torch.bfloat16
            with torch.autocast(
                torch.device(device).type, dtype, enabled=precision in ("bf16", "fp16")
            ):
                output = call_model(model, inputs)
            output = map_tensors(lambda t: loss_input(precision, t), output)
            loss = built.loss_fn(output, targets)
            scaled = loss / microbatches
            (scaler.scale(scaled) if scaler else scaled).backward()
            total += float(loss.detach()) / microbatches
        if scaler is not None:
            scaler.unscale_(optimizer)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(optimizer)  # skipped where a gradient overflowed
            scaler.update()
            if scales is not None:
                scales.append(scaler.get_scale())
        else:
            optimizer.step()
        if schedule is not None:
            schedule.step()
        losses.append(total)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, losses
