"""The distributed interpreter of one rank's action table.

It walks the table in order: receives and sends go through :class:`~pipedream.runtime.comm.P2P`
(receives posted ahead, :mod:`~pipedream.schedules.posting`), compute goes to the
:class:`~pipedream.runtime.stage_worker.StageWorker`, allreduces average the gradients of a stage's
replicas in the stage's own process group. Any wait that outlasts the timeout raises an error
naming the rank, the stage and the action that was waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipedream.formats.trace import TracedAction
from pipedream.graph.layers import StageIO
from pipedream.runtime.comm import P2P, PeerTimeoutError
from pipedream.runtime.compute_clock import ComputeClock
from pipedream.runtime.routing import (
    gather_inputs,
    gather_output_grads,
    scatter_input_grads,
    scatter_outputs,
)
from pipedream.runtime.stage_worker import StageWorker
from pipedream.schedules import MESSAGE_KIND, RECEIVE_WINDOW, Action, Op, receives_posted_before

__all__ = ["SKIP_TAG", "Executor"]

_RECVS = {Op.RECV_ACT: "act", Op.RECV_GRAD: "grad"}
_SENDS = {Op.SEND_ACT: "act", Op.SEND_GRAD: "grad"}
_TIED = (Op.SEND_TIED_GRAD, Op.RECV_TIED_GRAD, Op.SEND_WEIGHTS, Op.RECV_WEIGHTS)

SKIP_TAG = -1
"""Version tag of the gradient message of a microbatch whose non-finite loss was skipped."""


class Executor:
    """Runs one rank's table against peers over torch.distributed."""

    def __init__(
        self,
        worker: StageWorker,
        table: Sequence[Action],
        p2p: P2P,
        *,
        rank: int,
        io: StageIO,
        stage_of_rank: dict[int, int],
        replica_group: Any = None,
        num_replicas: int = 1,
        check_versions: bool = False,
        receive_window: int = RECEIVE_WINDOW,
        timeout: float = 300.0,
        on_update: Callable[[Action, list[int]], None] | None = None,
        trace: list[TracedAction] | None = None,
    ) -> None:
        self.worker = worker
        self.table = table
        self.p2p = p2p
        self.rank = rank
        self.io = io
        self.stage_of_rank = stage_of_rank
        self.replica_group = replica_group
        self.num_replicas = num_replicas
        self.check_versions = check_versions
        self.receive_window = receive_window
        self.timeout = timeout
        self.on_update = on_update
        self.trace = trace
        # (kind, microbatch) -> peer stage -> tensors, and the version tag of the messages
        self._inbox: dict[tuple[str, int], dict[int, list[Tensor]]] = {}
        self._inbox_tags: dict[tuple[str, int], int] = {}
        self._outbox: dict[tuple[str, int], dict[int, list[Tensor]]] = {}
        self._outbox_tags: dict[tuple[str, int], int] = {}
        self._since_update: list[int] = []
        self._clock = ComputeClock(worker.config.device)

    @property
    def compute_s(self) -> float:
        """Seconds spent in forward, backward and update actions (GPU time on a GPU)."""
        return self._clock.seconds

    def run(self) -> None:
        posts = receives_posted_before(self.table, self.receive_window)
        for position, action in enumerate(self.table):
            posting = time.perf_counter()
            for ahead in (self.table[p] for p in posts[position]):
                assert ahead.peer is not None
                self.p2p.post_recv(MESSAGE_KIND[ahead.op], ahead.index, ahead.peer)
            reclaiming = time.perf_counter()
            self.p2p.poll()
            computes = action.op.is_compute or action.op is Op.UPDATE
            start = time.perf_counter()
            if computes:
                self._clock.start()
            self._execute(position, action)
            if computes:
                self._clock.stop()
            end = time.perf_counter()
            if self.trace is not None:
                spent = (reclaiming - posting, start - reclaiming)
                self.trace.append((str(action), start, end, *spent))
        self.p2p.drain(what=f"the last sends of stage {self.worker.config.stage}")

    def _execute(self, position: int, action: Action) -> None:
        op = action.op
        what = f"the {action.describe()}"
        if op in _RECVS:
            assert action.peer is not None
            kind = _RECVS[op]
            tensors, tag = self.p2p.recv(kind, action.index, action.peer, what=what)
            key = (kind, action.index)
            self._inbox.setdefault(key, {})[self.stage_of_rank[action.peer]] = tensors
            if kind == "act" or tag == SKIP_TAG:  # one skipping consumer skips the microbatch
                self._inbox_tags[key] = tag
        elif op in _SENDS:
            assert action.peer is not None
            key = (_SENDS[op], action.index)
            messages = self._outbox[key]
            tensors = messages.pop(self.stage_of_rank[action.peer])
            if not messages:
                del self._outbox[key]
            self.p2p.send(key[0], action.index, action.peer, tensors, self._outbox_tags[key])
        elif op is Op.FORWARD:
            assert action.version is not None
            key = ("act", action.index)
            received = self._inbox.pop(key, None)
            # The tag of activations is the number of minibatches covered by the weights stage 0
            # used for them; every stage forwards it unchanged. Under vertical sync each stage
            # must use its version covering the same minibatches.
            tag = self._inbox_tags.pop(key, action.version * self.num_replicas)
            if self.check_versions and action.version != tag // self.num_replicas:
                raise AssertionError(
                    f"rank {self.rank}: {what} uses version {action.version} but the activations "
                    f"carry weights covering {tag} minibatches (vertical sync broken)"
                )
            inputs = gather_inputs(self.io, received) if received is not None else None
            outputs = self.worker.forward(action, inputs)
            if outputs:
                self._outbox[key] = scatter_outputs(self.io, outputs)
                self._outbox_tags[key] = tag
        elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            assert action.version is not None
            key = ("grad", action.index)
            received = self._inbox.pop(key, None)
            # a microbatch with a skipped non-finite loss travels back as "skip", not as zeros
            # pushed through autograd (0 * inf would be NaN in the weight gradients)
            skip = action.index in self.worker.skipped or self._inbox_tags.pop(key, 0) == SKIP_TAG
            if skip:
                grads = self.worker.skip_backward(action)
            else:
                output_grads = gather_output_grads(self.io, received) if received else None
                backward = self.worker.backward if op is Op.BACKWARD else self.worker.backward_input
                grads = backward(action, output_grads)
            if grads:
                self._outbox[key] = scatter_input_grads(self.io, grads)
                self._outbox_tags[key] = SKIP_TAG if skip else action.version
            self._since_update.append(action.index)
            if op is Op.BACKWARD:  # a split backward uses its version until its W
                self.worker.release(position + 1)
        elif op is Op.BACKWARD_WEIGHT:
            self.worker.backward_weight(action)
            self.worker.release(position + 1)
        elif op in _TIED:
            self._tied(action, what)
        elif op is Op.ALLREDUCE:
            self._allreduce(what)
        elif op is Op.UPDATE:
            self.worker.update(position)
            done, self._since_update = self._since_update, []
            if self.on_update is not None:
                self.on_update(action, done)
        else:  # pragma: no cover - every Op is handled above
            raise AssertionError(f"unknown action {action}")

    def _tied(self, action: Action, what: str) -> None:
        """The exchanges of tied parameters between an owner stage and a copy's stage."""
        assert action.peer is not None
        kind, peer_stage = MESSAGE_KIND[action.op], self.stage_of_rank[action.peer]
        if action.op is Op.SEND_TIED_GRAD:
            tensors = self.worker.copy_gradients(peer_stage)
            self.p2p.send(kind, action.index, action.peer, tensors, action.index)
        elif action.op is Op.SEND_WEIGHTS:
            tensors = self.worker.owned_tensors(peer_stage)
            self.p2p.send(kind, action.index, action.peer, tensors, action.index)
        else:
            tensors, _ = self.p2p.recv(kind, action.index, action.peer, what=what)
            if action.op is Op.RECV_TIED_GRAD:
                self.worker.add_copy_gradients(peer_stage, tensors)
            else:
                self.worker.set_copies(peer_stage, tensors)

    def _allreduce(self, what: str) -> None:
        grads = self.worker.gradients()
        flat = (
            torch.cat([g.reshape(-1) for g in grads])
            if grads
            else torch.zeros(0, device=self.worker.config.device)
        )
        work = dist.all_reduce(flat, group=self.replica_group, async_op=True)
        try:  # on NCCL a stream wait (a timeout would block the host until the GPU is done)
            finished = (
                work.wait() if self.p2p.nccl else work.wait(timeout=timedelta(seconds=self.timeout))
            )
        except RuntimeError as exc:
            raise PeerTimeoutError(f"rank {self.rank}: {what} failed: {exc}") from None
        if finished is False:
            raise PeerTimeoutError(f"rank {self.rank}: timed out waiting for {what}")
        flat /= self.num_replicas
        offset = 0
        with torch.no_grad():
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
