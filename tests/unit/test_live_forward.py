"""Forwards on the live parameters, parameters the user froze, and a lone stage as a plain loop.

A forward whose weight version is the live weights themselves (nothing updates them before its
backward) runs on the module's own parameters, as a plain loop does, and its backward lets
autograd add the gradients to their ``.grad``. Forwards on a stashed version keep running on
that version's tensors. Either way a parameter with ``requires_grad=False`` gets no gradient
and never changes. A lone stage computes the operators a plain loop computes and reads each
sample once, as a plain loop does.
"""

from __future__ import annotations

import weakref
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import Dataset, TensorDataset

from pipedream.data import MicrobatchStream
from pipedream.runtime.reference_executor import run_reference
from pipedream.runtime.routing import sequential_ios
from pipedream.runtime.stage_worker import StageWorker, TiedLinks, WorkerConfig
from pipedream.schedules import Op, PipelineSpec, build_tables

LR = 0.1


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(64, 4, generator=generator), torch.randn(64, 2, generator=generator)
    )


def _model(*, frozen_bias: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if frozen_bias:
        model[0].bias.requires_grad_(False)
    return model


class _CountingReads(Dataset):
    """:func:`_dataset`'s samples, read through ``__getitem__`` as a user's dataset is, and
    counted."""

    def __init__(self) -> None:
        self.samples = _dataset()
        self.reads = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        self.reads += 1
        return self.samples[index]


def _workers(
    model: nn.Sequential,
    schedule: str,
    stages: list[nn.Module],
    microbatches: int,
    steps: int,
    *,
    dataset: Dataset | None = None,
    recompute: bool = False,
) -> tuple[dict[int, StageWorker], list]:
    spec = PipelineSpec(schedule, tuple((s,) for s in range(len(stages))), microbatches, steps)
    tables = build_tables(spec)
    workers = {
        s: StageWorker(
            WorkerConfig(
                stage=s, num_stages=len(stages), microbatches=microbatches, recompute=recompute
            ),
            module,
            tables[s],
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
            loss_fn=nn.functional.mse_loss,
            data=MicrobatchStream(_dataset() if dataset is None else dataset, 4, 0),
        )
        for s, module in enumerate(stages)
    }
    return workers, tables


def _forbid_swaps(worker: StageWorker) -> None:
    def swap(*_: object) -> None:
        raise AssertionError("this forward should run on the live parameters")

    worker._call = swap  # type: ignore[assignment]


def test_a_lone_stage_runs_on_its_live_parameters_and_equals_a_plain_loop() -> None:
    model = _model()
    want = _model()
    workers, tables = _workers(model, "pipedream", [model], microbatches=1, steps=3)
    _forbid_swaps(workers[0])
    run_reference(tables, workers, sequential_ios(1))

    data = MicrobatchStream(_dataset(), 4, 0)
    optimizer = torch.optim.SGD(want.parameters(), lr=LR)
    for step in range(3):
        inputs, targets = data.microbatch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(want(inputs), targets).backward()
        optimizer.step()
    for (name, got), expected in zip(model.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)


class _CountingOps(TorchDispatchMode):
    """Counts the operators that compute (not views): on a GPU, each launches a kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("schedule", "microbatches"), [("pipedream", 1), ("1f1b", 3)])
def test_a_lone_stage_computes_what_a_plain_loop_does_operator_for_operator(
    schedule: str, microbatches: int
) -> None:
    """A GPU step of a small model is paced by the host's kernel launches, so a lone stage
    computes no operator a plain loop does not: the same operators, as often (the stage once
    divided a one-microbatch loss by 1, two kernels a step)."""
    model, want = _model(), _model()
    workers, tables = _workers(model, schedule, [model], microbatches, steps=3)
    with _CountingOps() as stage:
        run_reference(tables, workers, sequential_ios(1))

    data = MicrobatchStream(_dataset(), 4, 0)
    optimizer = torch.optim.SGD(want.parameters(), lr=LR)
    with _CountingOps() as plain:
        for step in range(3):
            optimizer.zero_grad()
            for index in range(step * microbatches, (step + 1) * microbatches):
                inputs, targets = data.microbatch(index)
                loss = nn.functional.mse_loss(want(inputs), targets)
                (loss / microbatches if microbatches > 1 else loss).backward()
            optimizer.step()
    assert stage.ops == plain.ops
    assert plain.ops["aten.div.Tensor"] == (0 if microbatches == 1 else 2 * 3 * microbatches)
    for (name, got), expected in zip(model.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)


def _cut(model: nn.Sequential, at: int | None) -> list[nn.Module]:
    return [model] if at is None else [model[:at], model[at:]]


@pytest.mark.parametrize(
    ("schedule", "microbatches", "recompute", "cut"),
    [
        ("pipedream", 1, False, None),
        ("1f1b", 3, False, None),
        ("1f1b", 3, True, None),
        ("1f1b", 3, True, 2),
        ("pipedream", 1, True, 2),
    ],
)
def test_each_stage_reads_each_sample_once(
    schedule: str, microbatches: int, recompute: bool, cut: int | None
) -> None:
    """A stage reads a microbatch's samples once, as a plain loop does: a lone stage takes
    its inputs and targets from one read (it read them apart, twice the work of a plain loop on
    a user's dataset), and a last stage that recomputes its forward keeps the targets it read
    for the recomputed loss (it read them again). Training is unchanged."""
    model, want = _model(), _model()
    dataset = _CountingReads()  # read by the first stage (inputs) and the last (targets)
    workers, tables = _workers(
        model, schedule, _cut(model, cut), microbatches, 3, dataset=dataset, recompute=recompute
    )
    run_reference(tables, workers, sequential_ios(len(tables)))
    assert dataset.reads == len(tables) * 3 * microbatches * 4  # steps x microbatches x samples

    reference, _ = _workers(want, schedule, _cut(want, cut), microbatches, 3, recompute=recompute)
    run_reference(tables, reference, sequential_ios(len(tables)))
    for (name, got), expected in zip(model.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)


def test_a_stage_keeps_its_gradient_accumulators_from_one_step_to_the_next() -> None:
    """Autograd frees a parameter's gradient accumulator with the last graph that uses it; a
    plain loop's graph lives to its optimizer step, a stage's ends with its backward. The
    worker holds them, so no forward makes new ones and the optimizer never hands a parameter
    back to its Python object alone (host work a GPU step waits for)."""
    model = _model(frozen_bias=True)
    workers, tables = _workers(model, "pipedream", [model], microbatches=1, steps=3)
    edge = torch.autograd.graph.get_gradient_edge
    trained = [p for p in model.parameters() if p.requires_grad]
    for param in trained:
        edge(param).node.metadata["mark"] = "first"  # lost if the accumulator is made anew
    run_reference(tables, workers, sequential_ios(1))
    assert [edge(p).node.metadata.get("mark") for p in trained] == ["first"] * 3


def test_forwards_on_stashed_versions_run_on_the_stash() -> None:
    """PipeDream over two stages: the first stage has two microbatches in flight, so every
    backward of its comes after an update and every forward runs on a stashed version; the
    last stage's backward follows its forward at once, so it runs on the live weights."""
    model = _model()
    workers, tables = _workers(model, "pipedream", [model[:2], model[2:]], 1, steps=4)
    live: dict[int, list[bool]] = {0: [], 1: []}
    for stage, worker in workers.items():
        decide = worker._runs_live

        def record(version: int, stage: int = stage, decide=decide) -> bool:
            live[stage].append(decide(version))
            return live[stage][-1]

        worker._runs_live = record  # type: ignore[method-assign]
    _forbid_swaps(workers[1])
    run_reference(tables, workers, sequential_ios(2))
    assert live == {0: [False] * 4, 1: [True] * 4}


def test_a_stashed_backward_frees_each_fresh_gradient_as_soon_as_it_is_added() -> None:
    """On a stashed version, each weight gradient autograd computes is added to the live
    ``.grad`` right away and freed, so the next layer's gradient reuses memory still in cache.
    Taking them all with ``autograd.grad`` held every one of them (16 MiB on the mlp's stage)
    until the end of the backward: about 10% slower backwards there."""
    torch.manual_seed(0)
    stage0 = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
    spec = PipelineSpec("2bw", ((0,), (1,)), 2, 3)
    table = build_tables(spec)[0]
    worker = StageWorker(
        WorkerConfig(stage=0, num_stages=2, microbatches=2),
        stage0,
        table,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
        loss_fn=nn.functional.mse_loss,
        data=MicrobatchStream(_dataset(), 4, 0),
    )
    alive_at_next: list[bool] = []
    fresh: list[weakref.ref] = []

    def watch(grad: torch.Tensor) -> None:
        if fresh:  # the gradient autograd computed before this one: still held?
            alive_at_next.append(fresh[-1]() is not None)
        fresh.append(weakref.ref(grad))

    for position, action in enumerate(table):
        if action.op is Op.FORWARD:
            worker.forward(action, None)
            if action.index == 3:  # minibatch 1's second microbatch: .grad exists by then
                assert not worker._runs_live(action.version)
                for name in ("0.weight", "2.weight"):
                    worker._stash[3].params[name].register_hook(watch)
        elif action.op is Op.BACKWARD:
            worker.backward(action, [torch.ones(4, 8)])
            worker.release(position + 1)
        elif action.op is Op.UPDATE:
            worker.update(position)
    # 2.weight's gradient comes first; by the time 0.weight's is computed it is gone
    assert alive_at_next == [False]


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_a_frozen_parameter_gets_no_gradient_and_never_changes(schedule: str) -> None:
    model = _model(frozen_bias=True)
    frozen = model[0].bias.detach().clone()
    before = model[0].weight.detach().clone()
    workers, tables = _workers(model, schedule, [model[:2], model[2:]], 1, steps=4)
    run_reference(tables, workers, sequential_ios(2))
    assert torch.equal(model[0].bias, frozen)
    assert model[0].bias.grad is None
    assert not torch.equal(model[0].weight, before)  # the rest of the stage trained


def test_a_frozen_parameter_under_the_synchronous_rule_equals_a_plain_loop() -> None:
    model, want = _model(frozen_bias=True), _model(frozen_bias=True)
    workers, tables = _workers(model, "1f1b", [model[:2], model[2:]], 2, steps=3)
    run_reference(tables, workers, sequential_ios(2))

    data = MicrobatchStream(_dataset(), 4, 0)
    optimizer = torch.optim.SGD([p for p in want.parameters() if p.requires_grad], lr=LR)
    for step in range(3):
        optimizer.zero_grad()
        for index in (2 * step, 2 * step + 1):
            inputs, targets = data.microbatch(index)
            (nn.functional.mse_loss(want(inputs), targets) / 2).backward()
        optimizer.step()
    for (name, got), expected in zip(model.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7, msg=name)


def test_a_frozen_tied_parameter_takes_no_gradient_from_its_copies() -> None:
    """The owner of a tied tensor adds the copy stages' gradients to it, unless it is frozen."""
    model = _model(frozen_bias=True)
    workers, _ = _workers(model, "1f1b", [model[:2], model[2:]], 1, steps=1)
    owner = workers[0]
    owner.tied = TiedLinks(owned={1: ("0.weight", "0.bias")})
    owner.add_copy_gradients(1, [torch.ones(8, 4), torch.ones(8)])
    assert model[0].bias.grad is None
    assert torch.equal(model[0].weight.grad, torch.ones(8, 4))


def test_copies_that_took_no_gradient_give_their_owner_none() -> None:
    """Every microbatch of a minibatch skipped (non-finite losses): the copy stage sent zeros,
    which made the owner's tied tensor a zero gradient and Adam moved it, where a plain loop
    leaves a tensor without a gradient alone (found by a review: with a tied head, a skipped
    minibatch moved the embedding in a 2-stage plan and not in a 1-stage one)."""
    model = _model()
    workers, _ = _workers(model, "1f1b", [model[:2], model[2:]], 1, steps=1)
    owner, copy = workers[0], workers[1]
    owner.tied = TiedLinks(owned={1: ("0.weight",)})
    copy.tied = TiedLinks(copies={0: ("2.weight",)})
    copy._copies = {"2.weight": model[2].weight}
    assert copy.copy_gradients(0) == []
    owner.add_copy_gradients(1, copy.copy_gradients(0))
    assert model[0].weight.grad is None
    model[2].weight.grad = torch.ones_like(model[2].weight)
    (sent,) = copy.copy_gradients(0)
    assert torch.equal(sent, torch.ones_like(model[2].weight)) and model[2].weight.grad is None


def _recompute_model(layer: str) -> nn.Sequential:
    torch.manual_seed(0)
    middle = nn.Dropout(0.5) if layer == "dropout" else nn.BatchNorm1d(8)
    return nn.Sequential(nn.Linear(4, 8), middle, nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("layer", ["dropout", "batch norm"])
@pytest.mark.parametrize(
    ("schedule", "microbatches", "cut"), [("1f1b", 3, 2), ("pipedream", 1, None)]
)
def test_a_recomputed_forward_does_what_the_forward_did(
    layer: str, schedule: str, microbatches: int, cut: int | None
) -> None:
    """``--recompute`` runs each forward again for its backward. With dropout, the recomputed
    forward must draw the masks the forward drew (it drew new ones, so the gradients were those
    of another network than the one whose outputs were sent), and leave the generator where the
    forward left it. With batch norm, it must not step the running mean and variance a second
    time (it did: two steps per microbatch, and the count of batches doubled). Training then
    equals training without recomputation, bit for bit, buffers included."""
    states = {}
    for recompute in (False, True):
        model = _recompute_model(layer)
        workers, tables = _workers(
            model, schedule, _cut(model, cut), microbatches, 3, recompute=recompute
        )
        torch.manual_seed(7)
        run_reference(tables, workers, sequential_ios(len(tables)))
        states[recompute] = model.state_dict()
    assert not torch.equal(states[False]["0.weight"], _recompute_model(layer)[0].weight)
    if layer == "batch norm":
        assert int(states[False]["1.num_batches_tracked"]) == 3 * microbatches
    for name, expected in states[False].items():
        torch.testing.assert_close(states[True][name], expected, rtol=0, atol=0, msg=name)
