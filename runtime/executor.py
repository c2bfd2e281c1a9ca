"""The distributed interpreter of one rank's action table.

It walks the table in order: receives and sends go through :class:`~pipedream.runtime.comm.P2P`
(receives posted ahead, :mod:`~pipedream.schedules.posting`), compute goes to the
:class:`~pipedream.runtime.stage_worker.StageWorker`, an allreduce waits for the bucketed
averaging of a stage's replicas' gradients (:mod:`~pipedream.runtime.grad_buckets`), a clip
takes the whole model's gradient norm (:mod:`~pipedream.runtime.global_norm`). Any wait
that outlasts the timeout raises an error naming the rank, the stage and the action that was
waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from pipedream.formats.trace import TracedAction
from pipedream.graph.layers import StageIO
from pipedream.runtime.comm import P2P, PeerTimeoutError, channel_kind, stage_lane
from pipedream.runtime.compute_clock import ComputeClock
from pipedream.runtime.global_norm import GlobalNorm
from pipedream.runtime.grad_buckets import GradientBuckets
from pipedream.runtime.out_of_memory import DeviceOutOfMemory, torch_summary
from pipedream.runtime.routing import (
    gather_inputs,
    gather_output_grads,
    scatter_input_grads,
    scatter_outputs,
)
from pipedream.runtime.stage_worker import StageWorker
from pipedream.schedules import MESSAGE_KIND, RECEIVE_WINDOW, Action, Op, receives_posted_before

__all__ = ["SKIP_TAG", "Executor", "LocalStage", "wait_collective"]

_RECVS = {Op.RECV_ACT: "act", Op.RECV_GRAD: "grad"}
_SENDS = {Op.SEND_ACT: "act", Op.SEND_GRAD: "grad"}
_TIED = (Op.SEND_TIED_GRAD, Op.RECV_TIED_GRAD, Op.SEND_WEIGHTS, Op.RECV_WEIGHTS)

SKIP_TAG = -1
"""Version tag of the gradient message of a microbatch whose non-finite loss was skipped."""


@dataclass(frozen=True)
class LocalStage:
    """One stage this rank runs: its worker, its wiring, its replicas."""

    worker: StageWorker
    io: StageIO
    num_replicas: int = 1
    buckets: GradientBuckets | None = None
    """The replicas' allreduce in buckets, started during the backward and finished at the
    allreduce action (None: not replicated)."""


def _what(action: Action) -> str:
    """An action in words, for what a wait names when it times out or fails."""
    return f"the {action.describe()}"


def wait_collective(work: Any, what: str, *, rank: int, nccl: bool, timeout: float) -> None:
    """Wait for an asynchronous collective: on NCCL a stream wait (a host wait with a timeout
    would block until the GPU is done), on gloo a host wait of at most ``timeout`` seconds."""
    try:
        finished = work.wait() if nccl else work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise PeerTimeoutError(f"rank {rank}: {what} failed: {exc}") from None
    if finished is False:
        raise PeerTimeoutError(f"rank {rank}: timed out waiting for {what}")


class Executor:
    """Runs one rank's table against peers over torch.distributed.

    A rank runs one stage, or several under interleaved and V schedules: every action names
    its stage, and the messages between two stages of this rank are handed over in memory.
    The messages between two stages travel on the lane of that stage pair
    (:func:`~pipedream.runtime.comm.stage_lane`), so two stage pairs between the same two ranks
    never mix.
    """

    def __init__(
        self,
        stages: Mapping[int, LocalStage],
        table: Sequence[Action],
        p2p: P2P,
        *,
        rank: int,
        places: Mapping[int, int] | None = None,
        check_versions: bool = False,
        receive_window: int = RECEIVE_WINDOW,
        timeout: float = 300.0,
        on_update: Callable[[Action, list[int]], None] | None = None,
        trace: list[TracedAction] | None = None,
        global_norm: GlobalNorm | None = None,
    ) -> None:
        self.stages = stages
        self.table = table
        self.p2p = p2p
        self.rank = rank
        self.places = places or {}
        """Stage -> its place among its rank's stages (absent: 0, one stage per rank)."""
        self.check_versions = check_versions
        self.receive_window = receive_window
        self.timeout = timeout
        self.on_update = on_update
        self.trace = trace
        self.global_norm = global_norm
        """Takes the whole model's gradient norm at each ``C`` (``--clip-grad-norm``, fp16)."""
        # (stage, kind, microbatch) -> peer stage -> tensors, and the version tag of the messages
        self._inbox: dict[tuple[int, str, int], dict[int, list[Tensor]]] = {}
        self._inbox_tags: dict[tuple[int, str, int], int] = {}
        self._outbox: dict[tuple[int, str, int], dict[int, list[Tensor]]] = {}
        self._outbox_tags: dict[tuple[int, str, int], int] = {}
        self._since_update: dict[int, list[int]] = {stage: [] for stage in stages}
        # (kind, receiving stage, sending stage, index) -> the tied tensors a stage of this rank
        # handed over to another of its stages
        self._tied_box: dict[tuple[str, int, int, int], list[Tensor]] = {}
        first = next(iter(stages.values()))
        self._clock = ComputeClock(first.worker.config.device)

    def _lane(self, kind: str, receiver: int, sender: int) -> str:
        """The channel of ``kind`` messages to stage ``receiver`` from stage ``sender``."""
        lane = stage_lane(self.places.get(receiver, 0), self.places.get(sender, 0))
        return channel_kind(kind, lane)

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
                if ahead.peer != self.rank:  # a local message is handed over, not received
                    assert ahead.peer_stage is not None
                    kind = self._lane(MESSAGE_KIND[ahead.op], ahead.stage, ahead.peer_stage)
                    self.p2p.post_recv(kind, ahead.index, ahead.peer)
            reclaiming = time.perf_counter()
            self.p2p.poll()
            computes = action.op.is_compute or action.op is Op.UPDATE
            start = time.perf_counter()
            if computes:
                self._clock.start()
            try:
                self._execute(position, action)
            except torch.OutOfMemoryError as exc:  # one line naming the action, not a traceback
                device = self.stages[action.stage].worker.config.device
                raise DeviceOutOfMemory(
                    f"rank {self.rank} ran out of memory on {device} in {_what(action)} "
                    f"({torch_summary(str(exc))})",
                    stage=action.stage,
                ) from None
            if computes:
                self._clock.stop()
            end = time.perf_counter()
            if self.trace is not None:
                spent = (reclaiming - posting, start - reclaiming)
                self.trace.append((str(action), start, end, *spent))
        self.p2p.drain(what=f"the last sends of rank {self.rank}")
        assert not self._tied_box, f"rank {self.rank}: tied tensors handed over, never taken"

    def _execute(self, position: int, action: Action) -> None:
        op = action.op
        local = self.stages[action.stage]
        worker, io = local.worker, local.io
        if op in _RECVS:
            assert action.peer is not None and action.peer_stage is not None
            if action.peer == self.rank:  # handed over by the send of the producing stage
                return
            kind = _RECVS[op]
            tensors, tag = self.p2p.recv(
                self._lane(kind, action.stage, action.peer_stage),
                action.index,
                action.peer,
                what=_what(action),
            )
            self._deliver((action.stage, kind, action.index), action.peer_stage, tensors, tag)
        elif op in _SENDS:
            assert action.peer is not None and action.peer_stage is not None
            key = (action.stage, _SENDS[op], action.index)
            messages = self._outbox[key]
            tensors = messages.pop(action.peer_stage)
            tag = self._outbox_tags[key]
            if not messages:
                del self._outbox[key], self._outbox_tags[key]
            if action.peer == self.rank:
                receiver = (action.peer_stage, key[1], action.index)
                self._deliver(receiver, action.stage, tensors, tag)
            else:
                kind = self._lane(key[1], action.peer_stage, action.stage)
                self.p2p.send(kind, action.index, action.peer, tensors, tag)
        elif op is Op.FORWARD:
            assert action.version is not None
            key = (action.stage, "act", action.index)
            received = self._inbox.pop(key, None)
            # The tag of activations is the number of minibatches covered by the weights stage 0
            # used for them; every stage forwards it unchanged. Under vertical sync each stage
            # must use its version covering the same minibatches.
            tag = self._inbox_tags.pop(key, action.version * local.num_replicas)
            if self.check_versions and action.version != tag // local.num_replicas:
                raise AssertionError(
                    f"rank {self.rank}: {_what(action)} uses version {action.version} but the "
                    f"activations carry weights covering {tag} minibatches (vertical sync broken)"
                )
            inputs = gather_inputs(io, received) if received is not None else None
            outputs = worker.forward(action, inputs)
            if outputs:
                self._outbox[key] = scatter_outputs(io, outputs)
                self._outbox_tags[key] = tag
        elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            assert action.version is not None
            key = (action.stage, "grad", action.index)
            received = self._inbox.pop(key, None)
            # a microbatch with a skipped non-finite loss travels back as "skip", not as zeros
            # pushed through autograd (0 * inf would be NaN in the weight gradients)
            skip = action.index in worker.skipped or self._inbox_tags.pop(key, 0) == SKIP_TAG
            if skip:
                grads = worker.skip_backward(action)
            else:
                output_grads = gather_output_grads(io, received) if received else None
                backward = worker.backward if op is Op.BACKWARD else worker.backward_input
                grads = backward(action, output_grads)
            if grads:
                self._outbox[key] = scatter_input_grads(io, grads)
                self._outbox_tags[key] = SKIP_TAG if skip else action.version
            self._since_update[action.stage].append(action.index)
            if op is Op.BACKWARD:  # a split backward uses its version until its W
                worker.release(position + 1)
        elif op is Op.BACKWARD_WEIGHT:
            worker.backward_weight(action)
            worker.release(position + 1)
        elif op in _TIED:
            self._tied(action, _what(action))
        elif op is Op.ALLREDUCE:
            self._allreduce(local, _what(action))
        elif op is Op.CLIP:
            assert self.global_norm is not None, "a C in the table of a run without a norm"
            self.global_norm.check(action.index, _what(action))
        elif op is Op.UPDATE:
            if self.global_norm is not None and self.global_norm.skips(action.index):
                worker.update(position, skip=True)  # fp16: an overflow somewhere
            else:
                worker.update(position)
            done, self._since_update[action.stage] = self._since_update[action.stage], []
            if self.on_update is not None:
                self.on_update(action, done)
        else:  # pragma: no cover - every Op is handled above
            raise AssertionError(f"unknown action {action}")

    def _deliver(
        self, key: tuple[int, str, int], sender: int, tensors: list[Tensor], tag: int
    ) -> None:
        """Messages for stage ``key[0]`` from stage ``sender``, with their version tag."""
        self._inbox.setdefault(key, {})[sender] = tensors
        if key[1] == "act" or tag == SKIP_TAG:  # one skipping consumer skips the microbatch
            self._inbox_tags[key] = tag

    def _tied(self, action: Action, what: str) -> None:
        """The exchanges of tied parameters between an owner stage and a copy's stage (handed
        over in memory where both are on this rank: the V's first and last stage)."""
        assert action.peer is not None and action.peer_stage is not None
        kind, peer_stage = MESSAGE_KIND[action.op], action.peer_stage
        worker = self.stages[action.stage].worker
        if action.op in (Op.SEND_TIED_GRAD, Op.SEND_WEIGHTS):
            if action.op is Op.SEND_TIED_GRAD:
                tensors = worker.copy_gradients(peer_stage)
            else:
                tensors = worker.owned_tensors(peer_stage)
            if action.peer == self.rank:
                self._tied_box[kind, peer_stage, action.stage, action.index] = tensors
            else:
                lane = self._lane(kind, peer_stage, action.stage)
                self.p2p.send(lane, action.index, action.peer, tensors, action.index)
            return
        if action.peer == self.rank:  # the send came earlier in this table
            tensors = self._tied_box.pop((kind, action.stage, peer_stage, action.index))
        else:
            lane = self._lane(kind, action.stage, peer_stage)
            tensors, _ = self.p2p.recv(lane, action.index, action.peer, what=what)
        if action.op is Op.RECV_TIED_GRAD:
            worker.add_copy_gradients(peer_stage, tensors)
        else:
            worker.set_copies(peer_stage, tensors)

    def _allreduce(self, local: LocalStage, what: str) -> None:
        assert local.buckets is not None, "an allreduce action of an unreplicated stage"
        local.buckets.finish(what)
