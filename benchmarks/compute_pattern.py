"""Do two CPU ranks compute slower as a pipeline than side by side? The mlp's halves, paired.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/compute_pattern.py

``pipedream profile --concurrent 2`` measures the layers while a co-runner trains beside the
profiler, both always busy. A 2-stage pipeline's ranks instead wait for each other's messages.
This script times the same two halves of ``real_compute.py``'s ``mlp`` (rank 0: blocks 0-3,
rank 1: blocks 4-7 and the head) in five ways, in alternating blocks so that the host's drift
over seconds hits all five alike:

- ``free``: each rank trains the whole model, one microbatch after another (forward, backward,
  optimizer step), as the profiler and its co-runner do; each times its own half inside the
  whole passes (the forward from its first block to its last, the backward between the gradient
  hooks at the half's boundaries);
- ``lockstep``: the same, but the two ranks meet (a one-element exchange) after every forward
  and every backward, so that the faster one waits;
- ``pipeline``: the halves as a 2-stage 1F1B pipeline of 8 microbatches per minibatch, with
  the activations and gradients sent over gloo; the backward is taken from the first microbatch
  of each minibatch only (the later ones add into ``.grad``, which the profile does not time
  and the simulator charges apart);
- ``paired``: each rank runs only its half, forward and backward in turn, meeting the other
  before every action and sending no data, rank 1 one action ahead: stage 0's backward runs
  beside stage 1's forward and stage 0's forward beside stage 1's backward, as 1F1B pairs them;
- ``crossed``: the same with the ranks in step: forward beside forward, backward beside
  backward. Against ``paired``, it tells whether the action on the other core matters.

It prints each way's median forward and backward per rank and, per round, the other ways'
medians over the free ones (no results file).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from real_compute import ARGS, MICROBATCH_SIZE
from torch import Tensor

from pipedream.data import MicrobatchStream
from pipedream.host_memory import configure_host_memory
from pipedream.workload import load_workload

__all__ = ["main"]

CUT = 4
"""Rank 0 holds children ``[0, CUT)``, rank 1 the rest."""
MICROBATCHES = 8
"""Per pipeline minibatch."""
PASSES = 12
"""Whole passes per block of ``free`` and ``lockstep``."""
PIPELINE_MINIBATCHES = 2
"""Minibatches per block of ``pipeline``."""
ROUNDS = 12
WAYS = ("free", "lockstep", "pipeline", "paired", "crossed")

Times = dict[tuple[str, str], list[float]]


class Rank:
    """One rank's half of the model, the whole model, and the times it records."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.peer = 1 - self.rank
        args = {name: str(value) for name, value in ARGS.items()}  # real_compute.py's mlp
        workload = load_workload("mlp", args, microbatch_size=MICROBATCH_SIZE)
        self.model = workload.model
        self.loss_fn = workload.loss_fn
        self.optimizer = workload.optimizer(self.model.parameters())
        self.inputs, self.targets = MicrobatchStream(
            workload.dataset, MICROBATCH_SIZE, seed=0
        ).microbatch(0)
        self.half = self.model[:CUT] if self.rank == 0 else self.model[CUT:]
        self.times: Times = {}

    def record(self, what: str, way: str, seconds: float) -> None:
        self.times.setdefault((what, way), []).append(seconds * 1000)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def meet(self) -> None:
        works = [dist.isend(torch.zeros(1), self.peer), dist.irecv(torch.empty(1), self.peer)]
        for work in works:
            work.wait()

    def whole_pass(self, way: str) -> None:
        """Forward and backward of the whole model, this rank's half timed inside them."""
        start = time.perf_counter()
        middle = self.model[:CUT](self.inputs)
        cut = time.perf_counter()
        loss = self.loss_fn(self.model[CUT:](middle), self.targets)
        end = time.perf_counter()
        self.record("forward", way, cut - start if self.rank == 0 else end - cut)
        if way == "lockstep":
            self.meet()
        marks: list[float] = []
        middle.register_hook(lambda _grad: marks.append(time.perf_counter()))
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        self.record("backward", way, end - marks[0] if self.rank == 0 else marks[0] - start)
        self.step()
        if way == "lockstep":
            self.meet()

    def pipeline_minibatch(self) -> None:
        """1F1B over the two ranks: rank 0 runs one forward ahead, rank 1 alternates."""
        sends: list[dist.Work] = []
        held: dict[int, tuple[Tensor, Tensor]] = {}

        def forward(index: int) -> None:
            if self.rank == 0:
                start = time.perf_counter()
                output = self.half(self.inputs)
                self.record("forward", "pipeline", time.perf_counter() - start)
                sends.append(dist.isend(output.detach(), 1))
                held[index] = (self.inputs, output)
                return
            received = torch.empty(MICROBATCH_SIZE, ARGS["width"])
            dist.recv(received, 0)
            received.requires_grad_(True)
            start = time.perf_counter()
            loss = self.loss_fn(self.half(received), self.targets)
            self.record("forward", "pipeline", time.perf_counter() - start)
            held[index] = (received, loss)

        def backward(index: int) -> None:
            received, output = held.pop(index)
            if self.rank == 0:
                gradient = torch.empty_like(output)
                dist.recv(gradient, 1)
                start = time.perf_counter()
                torch.autograd.backward(output, gradient)
            else:
                start = time.perf_counter()
                output.backward()
            if index == 0:
                self.record("backward", "pipeline", time.perf_counter() - start)
            if self.rank == 1:
                assert received.grad is not None
                sends.append(dist.isend(received.grad, 0))

        if self.rank == 0:
            forward(0)
            for index in range(MICROBATCHES):
                if index + 1 < MICROBATCHES:
                    forward(index + 1)
                backward(index)
        else:
            for index in range(MICROBATCHES):
                forward(index)
                backward(index)
        self.step()
        for work in sends:
            work.wait()

    def half_forward(self, way: str) -> Tensor:
        """This rank's half alone, on a fresh input (rank 1: and the loss); returns its output."""
        if self.rank == 0:
            start = time.perf_counter()
            output = self.half(self.inputs)
        else:
            received = torch.randn(MICROBATCH_SIZE, ARGS["width"], requires_grad=True)
            start = time.perf_counter()
            output = self.loss_fn(self.half(received), self.targets)
        self.record("forward", way, time.perf_counter() - start)
        return output

    def half_backward(self, way: str, output: Tensor) -> None:
        """The half's backward from ``output`` (rank 0: with a random gradient), into no
        ``.grad`` held before, as the pipeline's timed backward."""
        gradient = torch.randn_like(output) if self.rank == 0 else None
        start = time.perf_counter()
        torch.autograd.backward(output, gradient)
        self.record("backward", way, time.perf_counter() - start)
        self.optimizer.zero_grad(set_to_none=True)

    def half_actions(self, way: str) -> None:
        """:data:`PASSES` forwards and backwards of the half, meeting before each action;
        ``paired``: rank 1 a forward ahead of rank 0, ``crossed``: in step."""
        pending = self.half_forward(way) if way == "paired" and self.rank == 1 else None
        for _ in range(PASSES):
            if pending is None:
                self.meet()
                output = self.half_forward(way)
                self.meet()
                self.half_backward(way, output)
            else:
                self.meet()
                self.half_backward(way, pending)
                self.meet()
                pending = self.half_forward(way)
        if pending is not None:
            self.half_backward(way, pending)

    def run_block(self, way: str) -> None:
        """One block of ``way``: :data:`PASSES` whole passes or half actions, or
        :data:`PIPELINE_MINIBATCHES` pipeline minibatches."""
        if way in ("paired", "crossed"):
            self.half_actions(way)
        elif way == "pipeline":
            for _ in range(PIPELINE_MINIBATCHES):
                self.pipeline_minibatch()
        else:
            for _ in range(PASSES):
                self.whole_pass(way)


def _median_since(values: list[float], start: int) -> float:
    return statistics.median(values[start:])


def main() -> int:
    configure_host_memory()  # as every rank and the profiler
    torch.set_num_threads(1)  # as torchrun gives each of several ranks
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("compute_pattern.py needs exactly 2 processes (--nproc-per-node 2)")
    torch.manual_seed(0)
    me = Rank()
    for way in WAYS:  # warm-up: first calls, allocator
        me.run_block(way)
    me.times.clear()
    rounds: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    for _ in range(ROUNDS):
        for way in WAYS:
            dist.barrier()
            seen = {what: len(me.times.get((what, way), [])) for what in ("forward", "backward")}
            me.run_block(way)
            rounds[way].append(
                (
                    _median_since(me.times[("forward", way)], seen["forward"]),
                    _median_since(me.times[("backward", way)], seen["backward"]),
                )
            )
    for rank in range(2):
        dist.barrier()
        if rank != me.rank:
            continue
        medians = ", ".join(
            f"{way} {statistics.median(me.times[('forward', way)]):.2f} / "
            f"{statistics.median(me.times[('backward', way)]):.2f}"
            for way in WAYS
        )
        print(f"rank {rank}: median ms forward / backward: {medians}")
        for way in WAYS[1:]:
            pairs = [(w[0] / f[0], w[1] / f[1]) for w, f in zip(rounds[way], rounds["free"])]
            each = " ".join(f"{a:.2f}/{b:.2f}" for a, b in pairs)
            print(
                f"  {way} / free per round (forward/backward): {each}; median "
                f"{statistics.median(a for a, _ in pairs):.3f} / "
                f"{statistics.median(b for _, b in pairs):.3f}",
                flush=True,
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
