"""A backward split into I and W computes the whole backward's gradients, W the deferred ones.

Through the runtime's own StageWorker on a one-stage zb-h1 table (F0 I0 W0 U0): after I the
weights of modules called once hold no gradient yet, after W every gradient equals the plain
backward's; weights reached through two module outputs (shared by two modules, or of a module
called twice) get theirs in I, since W's module-by-module gradients would count a path twice.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from pipedream.data import MicrobatchStream
from pipedream.runtime.stage_worker import StageWorker, WorkerConfig
from pipedream.schedules import Op, PipelineSpec, build_tables


class Twice(nn.Module):
    """One Linear applied twice, then another: ``b(relu(a(relu(a(x)))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.a(torch.relu(self.a(x)))))


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[2].weight = model[0].weight  # one weight, two modules
    return model


def _worker(model: nn.Module) -> tuple[StageWorker, list]:
    table = build_tables(PipelineSpec("zb-h1", ((0,),), 1, 1))[0]
    assert [a.op for a in table] == [Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.UPDATE]
    data = TensorDataset(
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.randn(8, 2)
    )
    worker = StageWorker(
        WorkerConfig(stage=0, num_stages=1, microbatches=1),
        model,
        table,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=nn.functional.mse_loss,
        data=MicrobatchStream(data, 8, 0),
    )
    return worker, table


def _plain_grads(model: nn.Module, worker: StageWorker) -> dict[str, Tensor]:
    inputs, targets = worker.data.microbatch(0)
    model.zero_grad()
    nn.functional.mse_loss(model(inputs), targets).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return grads


def _split_grads(model: nn.Module) -> tuple[set[str], dict[str, Tensor]]:
    """(the weights with a gradient after I, every gradient after W)."""
    worker, table = _worker(model)
    want = _plain_grads(model, worker)
    forward, input_half, weight_half, _ = table
    worker.forward(forward, None)
    worker.backward_input(input_half, None)
    early = {name for name, p in model.named_parameters() if p.grad is not None}
    worker.backward_weight(weight_half)
    got = {name: p.grad for name, p in model.named_parameters()}
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7)
    return early, got


def test_weights_of_modules_called_once_wait_for_w() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    early, _ = _split_grads(model)
    assert early == set()


def test_a_weight_shared_by_two_modules_gets_its_gradient_in_i() -> None:
    early, _ = _split_grads(_tied())
    assert early == {"0.weight"}  # 2.weight is the same tensor, listed once


def test_a_module_called_twice_gets_its_gradients_in_i() -> None:
    early, _ = _split_grads(Twice())
    assert early == {"a.weight", "a.bias"}


def test_the_sleep_workload_sleeps_each_half_of_a_split_backward(monkeypatch) -> None:
    """Two sleep layers of backward 40 ms, 30 of them the weight's: a whole backward sleeps
    both parts of both layers, I only the inputs' parts, W only the weights'. (Sleeps are
    recorded, not slept.)"""
    from pipedream.workload import load_workload
    from pipedream.workloads import sleep as sleep_workload

    slept: list[int] = []
    monkeypatch.setattr(sleep_workload.time, "sleep", lambda s: slept.append(round(s * 1000)))
    args = {"layers": "3", "forward_ms": "0", "backward_ms": "40", "weight_ms": "30"}
    workload = load_workload("sleep", args, microbatch_size=8)
    got: dict[str, list[int]] = {}
    for schedule in ("1f1b", "zb-h1"):
        table = build_tables(PipelineSpec(schedule, ((0,), (1,)), 1, 1))[1]
        worker = StageWorker(
            WorkerConfig(stage=1, num_stages=2, microbatches=1),
            workload.model[1:],
            table,
            optimizer_factory=workload.optimizer,
            loss_fn=workload.loss_fn,
            data=MicrobatchStream(workload.dataset, 8, 0),
        )
        for action in table:
            slept.clear()
            if action.op is Op.FORWARD:
                worker.forward(action, [torch.zeros(8, 1024, requires_grad=True)])
            elif action.op is Op.BACKWARD:
                worker.backward(action, None)
            elif action.op is Op.BACKWARD_INPUT:
                worker.backward_input(action, None)
            elif action.op is Op.BACKWARD_WEIGHT:
                worker.backward_weight(action)
            if action.op.is_backward:
                got[action.op.value] = sorted(slept)
    assert got == {"B": [10, 10, 30, 30], "I": [10, 10], "W": [30, 30]}
