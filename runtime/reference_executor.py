"""The single-process reference executor: all ranks' tables in one process.

It interprets exactly the same action tables with the same :class:`StageWorker` and the same
routing as the distributed runtime, but "sends" are entries in a dictionary and an allreduce
averages the replicas' gradients in place. Tests compare the distributed runtime with it, and it
is the easiest place to debug a schedule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from pipedream.graph.layers import StageIO
from pipedream.runtime.routing import (
    gather_inputs,
    gather_output_grads,
    scatter_input_grads,
    scatter_outputs,
)
from pipedream.runtime.stage_worker import StageWorker
from pipedream.schedules import MATCHING_RECEIVE, Action, Op

__all__ = ["run_reference"]


def run_reference(
    tables: Mapping[int, Sequence[Action]],
    workers: Mapping[int, StageWorker],
    ios: Sequence[StageIO],
) -> None:
    """Run every rank's table to completion (round-robin, each rank until it must wait)."""
    position = {rank: 0 for rank in tables}
    stage_of = {rank: workers[rank].config.stage for rank in tables}
    mail: dict[tuple[Op, int, int, int], list[Tensor]] = {}
    inbox: dict[tuple[int, str, int], dict[int, list[Tensor]]] = {}
    outbox: dict[tuple[int, str, int], dict[int, list[Tensor]]] = {}
    arrived: dict[tuple[int, int], set[int]] = {}
    averaged: set[tuple[int, int]] = set()
    stage_ranks: dict[int, set[int]] = {}
    for rank in tables:
        stage_ranks.setdefault(stage_of[rank], set()).add(rank)

    progress = True
    while progress:
        progress = False
        for rank, table in tables.items():
            worker, io = workers[rank], ios[stage_of[rank]]
            while position[rank] < len(table):
                pos = position[rank]
                action = table[pos]
                op = action.op
                peer = action.peer if action.peer is not None else -1
                if op.is_receive:
                    key = (op, action.index, peer, rank)
                    if key not in mail:
                        break
                    tensors = mail.pop(key)
                    if op is Op.RECV_TIED_GRAD:
                        worker.add_copy_gradients(stage_of[peer], tensors)
                    elif op is Op.RECV_WEIGHTS:
                        worker.set_copies(stage_of[peer], tensors)
                    else:
                        kind = "act" if op is Op.RECV_ACT else "grad"
                        inbox.setdefault((rank, kind, action.index), {})[stage_of[peer]] = tensors
                elif op.is_send:
                    if op is Op.SEND_TIED_GRAD:
                        tensors = worker.copy_gradients(stage_of[peer])
                    elif op is Op.SEND_WEIGHTS:
                        tensors = worker.owned_tensors(stage_of[peer])
                    else:
                        kind = "act" if op is Op.SEND_ACT else "grad"
                        tensors = outbox[(rank, kind, action.index)].pop(stage_of[peer])
                    key = (MATCHING_RECEIVE[op], action.index, rank, peer)
                    mail[key] = [t.detach().clone() for t in tensors]
                elif op is Op.FORWARD:
                    received = inbox.pop((rank, "act", action.index), None)
                    inputs = gather_inputs(io, received) if received is not None else None
                    out = worker.forward(action, inputs)
                    if out:
                        outbox[(rank, "act", action.index)] = scatter_outputs(io, out)
                elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                    received = inbox.pop((rank, "grad", action.index), None)
                    grads = gather_output_grads(io, received) if received is not None else None
                    backward = worker.backward if op is Op.BACKWARD else worker.backward_input
                    out = backward(action, grads)
                    if out:
                        outbox[(rank, "grad", action.index)] = scatter_input_grads(io, out)
                    if op is Op.BACKWARD:
                        worker.release(pos + 1)
                elif op is Op.BACKWARD_WEIGHT:
                    worker.backward_weight(action)
                    worker.release(pos + 1)
                elif op is Op.ALLREDUCE:
                    group = arrived.setdefault((action.stage, action.index), set())
                    group.add(rank)
                    if group != stage_ranks[action.stage]:
                        break
                    if (action.stage, action.index) not in averaged:
                        averaged.add((action.stage, action.index))
                        _average([workers[r] for r in sorted(group)])
                elif op is Op.UPDATE:
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
