"""The built-in workloads: deterministic builds, data shapes, and that they actually learn."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.func import functional_call

from pipedream.data import MicrobatchStream
from pipedream.errors import WorkloadError
from pipedream.workload import Workload, load_workload


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI box is shared; these are tiny models anyway
    yield
    torch.set_num_threads(threads)


def _train(workload: Workload, steps: int, batch: int, *, stale_stages: int = 1) -> float:
    """Train in one process; return the mean loss of the last 10 steps.

    With ``stale_stages = S > 1`` it simulates PipeDream's asynchronous pipeline of S stages
    (contiguous, equal-ish groups of children): at step t, stage s computes forward and backward
    with its weights after max(0, t - (S-1-s)) updates, and the gradient updates the live weights.
    """
    model = workload.model
    names = [name for name, _ in model.named_children()]
    bounds = [round(i * len(names) / stale_stages) for i in range(stale_stages + 1)]
    stage_of = {name: s for s in range(stale_stages) for name in names[bounds[s] : bounds[s + 1]]}
    optimizer = workload.optimizer(model.parameters())
    stream = MicrobatchStream(workload.dataset, batch, seed=0)
    history: list[dict[str, Tensor]] = []  # the last S versions, oldest first
    losses = []
    for t in range(steps):
        history.append({k: v.detach().clone() for k, v in model.named_parameters()})
        del history[:-stale_stages]
        params = {}
        for key in history[-1]:
            lag = min(stale_stages - 1 - stage_of[key.split(".")[0]], t)
            params[key] = history[-1 - lag][key].clone().requires_grad_(True)
        inputs, targets = stream.microbatch(t)
        loss = workload.loss_fn(functional_call(model, params, (inputs,)), targets)
        grads = torch.autograd.grad(loss, list(params.values()))
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad
        optimizer.step()
        losses.append(float(loss.detach()))
    return sum(losses[-10:]) / 10


@pytest.mark.parametrize("name", ["mlp", "gpt", "digits"])
def test_two_builds_are_identical(name: str) -> None:
    first, second = load_workload(name), load_workload(name)
    state_a, state_b = first.model.state_dict(), second.model.state_dict()
    assert list(state_a) == list(state_b)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert torch.equal(first.example_input, second.example_input)
    for index in (0, len(first.dataset) - 1):  # type: ignore[arg-type]
        for a, b in zip(first.dataset[index], second.dataset[index]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["gpt", "digits"])
def test_children_map_one_tensor_to_one_tensor(name: str) -> None:
    workload = load_workload(name, microbatch_size=4)
    x = workload.example_input
    assert x.shape[0] == 4
    for child in workload.model:
        x = child(x)
        assert isinstance(x, Tensor)
    assert torch.allclose(x, workload.model(workload.example_input))


def test_gpt_layout_and_data() -> None:
    workload = load_workload("gpt")
    names = [name for name, _ in workload.model.named_children()]
    assert names == ["embed", "h0", "h1", "h2", "h3", "norm", "head"]
    inputs, targets = workload.dataset[0]
    assert inputs.shape == targets.shape == (32,)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[1:], targets[:-1])  # targets are the next tokens
    assert int(inputs.max()) < 64 and int(inputs.min()) >= 0
    assert workload.example_input.shape == (16, 32)
    assert workload.model(workload.example_input).shape == (16, 32, 64)


def test_gpt_seeds_are_independent() -> None:
    base = load_workload("gpt")
    reseeded = load_workload("gpt", {"seed": "1"})
    head = "head.weight"
    assert not torch.equal(base.model.state_dict()[head], reseeded.model.state_dict()[head])
    assert torch.equal(base.dataset[5][0], reseeded.dataset[5][0])  # same data
    other_data = load_workload("gpt", {"data_seed": "1"})
    assert torch.equal(base.model.state_dict()[head], other_data.model.state_dict()[head])
    assert not torch.equal(base.dataset[5][0], other_data.dataset[5][0])


def test_gpt_is_causal() -> None:
    workload = load_workload("gpt", {"layers": "2"}, microbatch_size=2)
    tokens = workload.example_input.clone()
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 64
    with torch.no_grad():
        before, after = workload.model(tokens), workload.model(changed)
    assert torch.equal(before[:, :20], after[:, :20])
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_gpt_rejects_bad_shapes() -> None:
    with pytest.raises(WorkloadError, match="divisible"):
        load_workload("gpt", {"heads": "3"})
    with pytest.raises(WorkloadError, match="branching"):
        load_workload("gpt", {"branching": "100"})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"in_features": "-1"}, "mlp: in_features must be >= 1, got -1"),  # negative dimension
        ({"out_features": "0"}, "mlp: out_features must be >= 1, got 0"),  # NaN loss
        ({"microbatch_size": "0"}, "mlp: microbatch_size must be >= 1, got 0"),  # empty example
        ({"width": "0"}, "mlp: width must be >= 1, got 0"),
    ],
    ids=["in_features", "out_features", "microbatch_size", "width"],
)
def test_mlp_refuses_sizes_below_one(args: dict[str, str], message: str) -> None:
    with pytest.raises(WorkloadError, match=f"^{re.escape(message)}$"):
        load_workload("mlp", args)


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        # these said which options had to be >= 1, not which one was not
        ("gpt", {"test_samples": "0"}, "gpt: test_samples must be >= 1, got 0"),
        ("digits", {"width": "-4"}, "digits: width must be >= 1, got -4"),
        ("resnet", {"microbatch_size": "0"}, "resnet: microbatch_size must be >= 1, got 0"),
        # these trained on a loss of 0 (one class, one token), learning nothing
        (
            "resnet",
            {"classes": "1"},
            "resnet: classes must be >= 2, got 1; with one class the loss is always 0",
        ),
        (
            "gpt",
            {"vocab": "1", "branching": "1"},
            "gpt: vocab must be >= 2, got 1; a model with one token has nothing to predict",
        ),
    ],
    ids=[
        "gpt-test_samples",
        "digits-width",
        "resnet-microbatch_size",
        "resnet-classes",
        "gpt-vocab",
    ],
)
def test_workloads_name_the_size_they_refuse(name: str, args: dict[str, str], message: str) -> None:
    with pytest.raises(WorkloadError, match=f"^{re.escape(message)}$"):
        load_workload(name, args)


def test_resnet_example_has_the_microbatch_size_with_fewer_samples() -> None:
    """The example (and so the profile's microbatch size) had only ``samples`` images."""
    workload = load_workload("resnet", {"samples": "4", "width": "2"}, microbatch_size=6)
    assert workload.example_input.shape == (6, 3, 16, 16)
    images = workload.dataset.tensors[0]  # type: ignore[attr-defined]
    assert torch.equal(workload.example_input, images[[0, 1, 2, 3, 0, 1]])


def test_gpt_learns_the_chain() -> None:
    workload = load_workload("gpt")
    assert workload.evaluate is not None
    initial = workload.evaluate(workload.model)
    assert initial["test_loss"] == pytest.approx(math.log(64), abs=0.1)
    assert initial["best_loss"] < 0.5 * math.log(64)
    final_train = _train(workload, steps=100, batch=16)
    final = workload.evaluate(workload.model)
    assert final_train < 0.7 * math.log(64)
    assert final["test_loss"] < 0.7 * math.log(64)


def test_digits_split_and_data() -> None:
    workload = load_workload("digits")
    inputs, target = workload.dataset[0]
    assert inputs.shape == (64,) and inputs.dtype == torch.float32
    assert target.dtype == torch.long and 0 <= int(target) < 10
    num_train = len(workload.dataset)  # type: ignore[arg-type]
    assert 1797 * 0.79 < num_train < 1797 * 0.81
    all_inputs = workload.dataset.tensors[0]  # type: ignore[attr-defined]
    assert all_inputs.mean(dim=0).abs().max() < 1e-4  # standardized with training statistics
    assert len(list(workload.model.children())) >= 4


@pytest.mark.parametrize(
    ("fraction", "empty"),
    [
        ("1e-9", "no test samples"),  # trained on, then reported a NaN test accuracy
        ("0.9999999", "no training samples"),  # ZeroDivisionError while building
    ],
)
def test_digits_refuses_a_test_fraction_that_empties_a_split(fraction: str, empty: str) -> None:
    message = (
        f"digits: test_fraction={float(fraction)} leaves {empty} of the 1797 (split per class, "
        "rounded); use a test_fraction from 0.006 to 0.994"
    )
    with pytest.raises(WorkloadError, match=f"^{re.escape(message)}$"):
        load_workload("digits", {"test_fraction": fraction})
    for edge in ("0.006", "0.994"):  # the ends of the range leave every digit in both splits
        assert load_workload("digits", {"test_fraction": edge}).evaluate is not None


@pytest.mark.parametrize("stale_stages", [1, 4], ids=["sync", "pipedream-4-stages"])
def test_digits_reaches_90_percent(stale_stages: int) -> None:
    workload = load_workload("digits")
    assert workload.evaluate is not None
    assert workload.evaluate(workload.model)["test_accuracy"] < 0.3
    _train(workload, steps=300, batch=32, stale_stages=stale_stages)
    assert workload.evaluate(workload.model)["test_accuracy"] >= 0.9


@pytest.mark.parametrize(
    ("args", "lr"),
    [
        ({"dim": "64"}, 1e-3),
        ({"dim": "256", "heads": "4"}, 1e-3),
        ({"dim": "512", "heads": "8"}, 5e-4),  # wider: 1e-3 * 256 / dim
        ({"dim": "512", "heads": "8", "lr": "0.01"}, 0.01),  # a given lr is kept
    ],
)
def test_gpt_learning_rate_falls_with_width_unless_given(args: dict[str, str], lr: float) -> None:
    workload = load_workload("gpt", {"layers": "1", "samples": "16", **args})
    optimizer = workload.optimizer(workload.model.parameters())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr)


def test_an_optional_float_argument_rejects_a_non_number() -> None:
    with pytest.raises(WorkloadError, match="lr='fast' is not a valid float"):
        load_workload("gpt", {"lr": "fast"})


def test_weight_decay_is_what_the_option_says() -> None:
    """``weight_decay`` for gpt and hf-lm; AdamW's default 0.01 where it is not given, and 0
    when it is 0 (which used to mean the default)."""
    from torch import nn

    from pipedream.workloads.common import optimizer_factory

    params = [nn.Parameter(torch.zeros(2, 2))]

    def decay(name: str, **given: float) -> float:
        groups = optimizer_factory(name, lr=0.1, **given)(params).param_groups
        return groups[0]["weight_decay"]

    assert (decay("adamw"), decay("adamw", weight_decay=0.0), decay("adamw", weight_decay=0.1)) == (
        0.01,
        0.0,
        0.1,
    )
    assert (decay("adam"), decay("sgd"), decay("sgd", weight_decay=0.2)) == (0.0, 0.0, 0.2)
    gpt = load_workload("gpt", {"optimizer": "adamw", "weight_decay": "0.05", "samples": "32"})
    assert gpt.optimizer(params).param_groups[0]["weight_decay"] == 0.05
    with pytest.raises(WorkloadError, match=r"weight_decay=-1.0; e.g. 0.1"):
        load_workload("gpt", {"weight_decay": "-1"})


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_weight_decay_shrinks_matrices_not_biases_or_norms(optimizer: str) -> None:
    """One step with zero gradients: a linear layer's weight shrinks by ``lr * weight_decay``
    (AdamW's decoupled decay; Adam's and SGD's L2 term moves it the same first step), its bias
    and a LayerNorm's gain and shift stay where they are."""
    from torch import nn

    from pipedream.workloads.common import optimizer_factory

    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    for p in model.parameters():
        nn.init.constant_(p, 2.0)
        p.grad = torch.zeros_like(p)

    def decays(decay: float, params: Any) -> list[float]:
        return [
            g["weight_decay"]
            for g in optimizer_factory(optimizer, lr=0.1, weight_decay=decay)(params).param_groups
        ]

    step = optimizer_factory(optimizer, lr=0.1, weight_decay=0.5)(model.parameters())
    step.step()
    after = {name: float(p.detach().flatten()[0]) for name, p in model.named_parameters()}
    # AdamW: 2 * (1 - 0.1 * 0.5); Adam: the L2 gradient 2 * 0.5, normalized, makes a step of
    # lr; SGD: lr times that gradient. All three: 1.9
    assert after == pytest.approx({"0.weight": 1.9, "0.bias": 2.0, "1.weight": 2.0, "1.bias": 2.0})
    assert decays(0.5, model.parameters()) == [0.5, 0.0]
    assert decays(0.0, model.parameters()) == [0.0]  # without decay: one group of them all
    assert decays(0.5, model[1].parameters()) == [0.0]  # a stage of norms only: no empty group


def test_the_language_models_decay_their_matrices_only() -> None:
    """gpt and hf-lm under AdamW: every parameter of one dimension (biases, norms) in the group
    without decay, every matrix (embeddings included) in the decayed one."""
    for name, args in (("gpt", {"samples": "32"}), ("hf-lm", {"config": "gpt2", "layers": "1"})):
        if name == "hf-lm":
            pytest.importorskip("transformers")
        workload = load_workload(name, {**args, "optimizer": "adamw", "weight_decay": "0.1"})
        groups = workload.optimizer(workload.model.parameters()).param_groups
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0], name
        assert {p.ndim >= 2 for p in groups[0]["params"]} == {True}, name
        assert {p.ndim for p in groups[1]["params"]} == {1}, name
        assert sum(len(g["params"]) for g in groups) == len(list(workload.model.parameters()))
