"""The replicas' allreduce in buckets starts during the backward, in order, and leaves the mean.

A stage worker reports each accumulation into a live parameter's gradient (autograd's hooks
on the live path, the worker itself on a stashed version's); a recording allreduce stands in
for the process group (one process, summing nothing), so the mean of two "replicas" is half
the local gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipedream.data import MicrobatchStream
from pipedream.runtime.grad_buckets import GradientBuckets
from pipedream.runtime.stage_worker import StageWorker, WorkerConfig
from pipedream.schedules import Op, PipelineSpec, build_tables


class Recorder:
    """A stand-in allreduce: records which bucket started when; waits record too."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.waited: list[int] = []

    def allreduce(self, flat: torch.Tensor, group: object) -> int:
        self.started.append(flat.numel())
        return flat.numel()

    def wait(self, work: int, what: str) -> None:
        self.waited.append(work)


def _worker(
    model: nn.Module, schedule: str, microbatches: int, steps: int = 1
) -> tuple[StageWorker, list]:
    table = build_tables(PipelineSpec(schedule, ((0,),), microbatches, steps))[0]
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 2))
    worker = StageWorker(
        WorkerConfig(stage=0, num_stages=1, microbatches=microbatches),
        model,
        table,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=nn.functional.mse_loss,
        data=MicrobatchStream(data, 4, 0),
    )
    return worker, table


def _buckets(worker: StageWorker, recorder: Recorder, **sizes: int) -> GradientBuckets:
    """The worker's trained parameters averaged over two "replicas" through ``recorder``."""
    buckets = GradientBuckets(
        worker.accumulations(),
        None,
        num_replicas=2,
        wait=recorder.wait,
        allreduce=recorder.allreduce,
        **sizes,
    )
    worker.watch_gradients(buckets.accumulated)
    return buckets


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))  # 32 + 8, 16 + 2 numbers


def test_buckets_start_when_their_gradients_are_final_and_leave_the_mean() -> None:
    model = _model()
    worker, table = _worker(model, "1f1b", microbatches=2)
    recorder = Recorder()
    # 100 bytes per bucket, from the last parameter: 2.bias, 2.weight, 0.bias (104 B, 26
    # numbers) fill one; 0.weight (32 numbers) the next
    buckets = _buckets(worker, recorder, bucket_bytes=100, first_bucket_bytes=100)
    assert buckets.num_buckets == 2
    for action in table:
        if action.op is Op.FORWARD:
            worker.forward(action, None)
        elif action.op is Op.BACKWARD:
            worker.backward(action, None)
            # the first microbatch's gradients are not final; the second's start both buckets
            assert recorder.started == ([] if action.index == 0 else [26, 32])
    local = [p.grad.clone() for p in model.parameters()]
    buckets.finish("the test's allreduce")
    assert recorder.waited == [26, 32]
    for param, grad in zip(model.parameters(), local):
        torch.testing.assert_close(param.grad, grad / 2, rtol=0, atol=0)


def test_updates_drop_the_gradients_and_buckets_copy_the_next_ones_in() -> None:
    """Between updates the gradients are None (no zeroing in place, no adding to zeros): the
    next minibatch's first backward leaves autograd's tensor, which its bucket copies in."""
    model = _model()
    worker, table = _worker(model, "1f1b", microbatches=1, steps=2)  # F0 B0 U0 F1 B1 U1
    recorder = Recorder()
    buckets = _buckets(worker, recorder)  # one bucket: 58 numbers
    flat = buckets._buckets[0].flat
    for position, action in enumerate(table):
        if action.op is Op.FORWARD:
            worker.forward(action, None)
        elif action.op is Op.BACKWARD:
            worker.backward(action, None)
            # the bucket started: every gradient is a view of its buffer again
            assert all(p.grad._base is flat for p in model.parameters())
            local = [p.grad.clone() for p in model.parameters()]
            buckets.finish("the test's allreduce")
            for param, grad in zip(model.parameters(), local):
                torch.testing.assert_close(param.grad, grad / 2, rtol=0, atol=0)
        else:
            worker.update(position)
            assert all(p.grad is None for p in model.parameters())
    assert recorder.started == [58, 58]


def test_buckets_start_in_order_and_finish_what_never_became_final() -> None:
    model = _model()
    params = list(model.parameters())  # 0.weight, 0.bias, 2.weight, 2.bias
    recorder = Recorder()
    buckets = GradientBuckets(
        [(p, 1) for p in params],
        None,
        num_replicas=1,
        wait=recorder.wait,
        bucket_bytes=1,  # one parameter per bucket, the last parameter first
        first_bucket_bytes=1,
        allreduce=recorder.allreduce,
    )
    for param in params:
        param.grad = torch.ones_like(param)
    buckets.accumulated(params[1])  # bucket 2 is ready, buckets 0 and 1 are not
    assert recorder.started == []
    buckets.accumulated(params[3])  # bucket 0
    assert recorder.started == [2]
    buckets.accumulated(params[2])  # bucket 1, then bucket 2 follows at once
    assert recorder.started == [2, 16, 8]
    buckets.finish("the test's allreduce")  # 0.weight never became final: started here
    assert recorder.started == [2, 16, 8, 32] and recorder.waited == [2, 16, 8, 32]
    buckets.accumulated(params[3])  # a new minibatch counts from zero
    assert recorder.started == [2, 16, 8, 32, 2]


def test_a_stashed_version_s_gradients_are_reported_too() -> None:
    """PipeDream's first stage of two runs on stashed versions: the worker adds their
    gradients itself and reports each; a frozen parameter is not averaged."""
    model = _model()
    model[0].bias.requires_grad_(False)
    stage0 = model[:2]
    table = build_tables(PipelineSpec("pipedream", ((0,), (1,)), 1, 4))[0]
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 2))
    worker = StageWorker(
        WorkerConfig(stage=0, num_stages=2, microbatches=1),
        stage0,
        table,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=nn.functional.mse_loss,
        data=MicrobatchStream(data, 4, 0),
    )
    assert [p for p, _ in worker.accumulations()] == [model[0].weight]
    reported: list[nn.Parameter] = []
    worker.watch_gradients(reported.append)
    forward = next(a for a in table if a.op is Op.FORWARD and a.index == 1)
    assert not worker._runs_live(forward.version)
    worker.forward(next(a for a in table if a.op is Op.FORWARD and a.index == 0), None)
    worker.forward(forward, None)
    grads = [torch.ones(4, 8)]
    backward = next(a for a in table if a.op is Op.BACKWARD and a.index == 0)
    worker.backward(backward, grads)
    assert reported == [model[0].weight]


def test_the_first_bucket_is_small_so_that_it_starts_early() -> None:
    params = list(_model().parameters())  # 128, 32, 64 and 8 bytes
    kept = GradientBuckets(
        [(p, 1) for p in params],
        None,
        num_replicas=1,
        wait=Recorder().wait,
        bucket_bytes=1000,
        first_bucket_bytes=50,
    )
    assert kept.num_buckets == 2  # [2.bias, 2.weight] (72 B), then the rest (160 B)


def test_a_bucket_holds_one_dtype() -> None:
    """Parameters of two dtypes (fp32 norms beside bf16 weights) go to separate buckets: a
    gradient view must have its parameter's dtype."""
    fp32 = nn.Parameter(torch.zeros(3))
    bf16 = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    buckets = GradientBuckets(
        [(fp32, 1), (bf16, 1), (nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)), 1)],
        None,
        num_replicas=1,
        wait=Recorder().wait,
    )
    assert buckets.num_buckets == 2
    assert fp32.grad is not None and fp32.grad.dtype == torch.float32
    assert bf16.grad is not None and bf16.grad.dtype == torch.bfloat16
