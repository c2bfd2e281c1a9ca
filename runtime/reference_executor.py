"""The single-process reference executor: all ranks' tables in one process.

It interprets exactly the same action tables with the same :class:`StageWorker` and the same
routing as the distributed runtime, but "sends" are entries in a dictionary, an allreduce
averages the replicas' gradients in place and a clip scales every stage's by the whole model's
norm. Tests compare the distributed runtime with it, and it
is the easiest place to debug a schedule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from pipedream.graph.layers import StageIO
from pipedream.runtime.global_norm import clip_factor, sum_of_squares
from pipedream.runtime.loss_scale import LossScaler
from pipedream.runtime.routing import (
    gather_inputs,
    gather_output_grads,
    scatter_input_grads,
    scatter_outputs,
)
from pipedream.runtime.stage_worker import StageWorker
from pipedream.schedules import Action, Op
from pipedream.schedules.validate import Message, message_of

__all__ = ["run_reference"]


def run_reference(
    tables: Mapping[int, Sequence[Action]],
    workers: Mapping[int, StageWorker | Mapping[int, StageWorker]],
    ios: Sequence[StageIO],
    *,
    clip: float | None = None,
    scaler: LossScaler | None = None,
) -> None:
    """Run every rank's table to completion (round-robin, each rank until it must wait).

    ``workers``: each rank's worker, or its workers by stage where it runs several stages;
    ``clip``: the global gradient norm the tables' ``C`` actions clip to; ``scaler``: fp16's
    loss scale (the last stage's worker scales its losses by its ``scale``), which the ``C``
    actions unscale and check.
    """
    local = {
        rank: {w.config.stage: w} if isinstance(w, StageWorker) else dict(w)
        for rank, w in workers.items()
    }
    position = {rank: 0 for rank in tables}
    mail: dict[Message, list[Tensor]] = {}
    inbox: dict[tuple[int, str, int], dict[int, list[Tensor]]] = {}
    outbox: dict[tuple[int, str, int], dict[int, list[Tensor]]] = {}
    arrived: dict[tuple[int, int], set[int]] = {}
    averaged: set[tuple[int, int]] = set()
    skipped: set[int] = set()  # updates an fp16 overflow skips
    stage_ranks: dict[int, set[int]] = {}
    for rank, stages in local.items():
        for stage in stages:
            stage_ranks.setdefault(stage, set()).add(rank)

    progress = True
    while progress:
        progress = False
        for rank, table in tables.items():
            while position[rank] < len(table):
                pos = position[rank]
                action = table[pos]
                op, stage = action.op, action.stage
                worker, io = local[rank][stage], ios[stage]
                peer_stage = action.peer_stage if action.peer_stage is not None else -1
                if op.is_receive:
                    key = message_of(rank, action)
                    if key not in mail:
                        break
                    tensors = mail.pop(key)
                    if op is Op.RECV_TIED_GRAD:
                        worker.add_copy_gradients(peer_stage, tensors)
                    elif op is Op.RECV_WEIGHTS:
                        worker.set_copies(peer_stage, tensors)
                    else:
                        kind = "act" if op is Op.RECV_ACT else "grad"
                        inbox.setdefault((stage, kind, action.index), {})[peer_stage] = tensors
                elif op.is_send:
                    if op is Op.SEND_TIED_GRAD:
                        tensors = worker.copy_gradients(peer_stage)
                    elif op is Op.SEND_WEIGHTS:
                        tensors = worker.owned_tensors(peer_stage)
                    else:
                        kind = "act" if op is Op.SEND_ACT else "grad"
                        tensors = outbox[(stage, kind, action.index)].pop(peer_stage)
                    mail[message_of(rank, action)] = [t.detach().clone() for t in tensors]
                elif op is Op.FORWARD:
                    received = inbox.pop((stage, "act", action.index), None)
                    inputs = gather_inputs(io, received) if received is not None else None
                    out = worker.forward(action, inputs)
                    if out:
                        outbox[(stage, "act", action.index)] = scatter_outputs(io, out)
                elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                    received = inbox.pop((stage, "grad", action.index), None)
                    grads = gather_output_grads(io, received) if received is not None else None
                    backward = worker.backward if op is Op.BACKWARD else worker.backward_input
                    out = backward(action, grads)
                    if out:
                        outbox[(stage, "grad", action.index)] = scatter_input_grads(io, out)
                    if op is Op.BACKWARD:
                        worker.release(pos + 1)
                elif op is Op.BACKWARD_WEIGHT:
                    worker.backward_weight(action)
                    worker.release(pos + 1)
                elif op is Op.ALLREDUCE:
                    group = arrived.setdefault((stage, action.index), set())
                    group.add(rank)
                    if group != stage_ranks[stage]:
                        break
                    if (stage, action.index) not in averaged:
                        averaged.add((stage, action.index))
                        _average([local[r][stage] for r in sorted(group)])
                elif op is Op.CLIP:
                    group = arrived.setdefault((-1, action.index), set())
                    group.add(rank)
                    if group != set(tables):
                        break
                    if (-1, action.index) not in averaged:
                        averaged.add((-1, action.index))
                        assert clip is not None or scaler is not None, "a C without a norm"
                        if _check(local, stage_ranks, clip, scaler):
                            skipped.add(action.index)
                elif op is Op.UPDATE:
                    if action.index in skipped:
                        worker.update(pos, skip=True)
                    else:
                        worker.update(pos)
                position[rank] = pos + 1
                progress = True
    stuck = {r: p for r, p in position.items() if p < len(tables[r])}
    assert not stuck, f"reference executor deadlocked at {stuck}"


@torch.no_grad()
def _average(workers: Sequence[StageWorker]) -> None:
    grads = [w.gradients() for w in workers]
    for parts in zip(*grads):
        mean = torch.stack(list(parts)).sum(0) / len(parts)
        for part in parts:
            part.copy_(mean)


@torch.no_grad()
def _check(
    local: Mapping[int, Mapping[int, StageWorker]],
    stage_ranks: Mapping[int, set[int]],
    max_norm: float | None,
    scaler: LossScaler | None,
) -> bool:
    """An update's global norm: unscale every worker's gradients and find overflows (fp16),
    then scale them by the clipping factor of the whole model's norm, where each stage counts
    once (its replicas hold the same average); returns whether the update is skipped."""
    workers = [w for stages in local.values() for w in stages.values()]
    if scaler is not None:
        found = scaler.unscale([g for worker in workers for g in worker.present_gradients()])
        scaler.update(found)
        if bool(found > 0):
            scaler.skipped += 1
            return True
    if max_norm is not None:
        counted = [local[min(ranks)][stage] for stage, ranks in stage_ranks.items()]
        device = workers[0].config.device
        grads = [g for worker in counted for g in worker.present_gradients()]
        _, factor = clip_factor(sum_of_squares(grads, device), max_norm)
        for worker in workers:
            present = worker.present_gradients()
            if present:
                torch._foreach_mul_(present, factor)
    return False
