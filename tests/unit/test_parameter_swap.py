"""Calling a stage module on a weight version (pipedream.runtime.parameter_swap)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from pipedream.runtime.parameter_swap import ParameterSwap


class _Tied(nn.Module):
    """An embedding and an output layer that share one weight, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.mix = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.mix(self.embed(tokens))) * self.scale


def _version(module: nn.Module, shift: float) -> dict[str, Tensor]:
    """Leaf tensors for every parameter, different from the live ones."""
    return {
        name: (param.detach() + shift).requires_grad_(True)
        for name, param in module.named_parameters()
    }


def _grads(output: Tensor, tensors: dict[str, Tensor]) -> list[Tensor]:
    return list(torch.autograd.grad(output.square().sum(), list(tensors.values())))


def test_a_call_on_a_version_matches_functional_call_and_leaves_the_parameters_alone() -> None:
    torch.manual_seed(0)
    model = _Tied()
    live = {name: param.detach().clone() for name, param in model.named_parameters()}
    objects = [id(param) for param in model.parameters()]
    tokens = torch.tensor([[0, 3, 4], [1, 1, 2]])
    swap = ParameterSwap(model)
    assert swap.direct
    assert swap.names == {"embed.weight", "mix.0.weight", "mix.0.bias"}

    ours_version, theirs_version = _version(model, 0.5), _version(model, 0.5)
    ours = swap(ours_version, (tokens,))
    theirs = functional_call(model, theirs_version, (tokens,))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # the tied head used the version too: its gradient adds to the embedding's
    for a, b in zip(_grads(ours, ours_version), _grads(theirs, theirs_version)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert model.head.weight is model.embed.weight
    assert [id(param) for param in model.parameters()] == objects
    assert all(param.grad is None for param in model.parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), live[name], rtol=0, atol=0)
    # and the plain call afterwards is on the live parameters again
    torch.testing.assert_close(model(tokens), functional_call(model, dict(live), (tokens,)))


def test_the_parameters_come_back_when_the_call_raises() -> None:
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            self.linear(x)
            raise RuntimeError("boom")

    model = Failing()
    weight = model.linear.weight
    with pytest.raises(RuntimeError, match="boom"):
        ParameterSwap(model)(_version(model, 1.0), (torch.ones(1, 2),))
    assert model.linear.weight is weight
    assert isinstance(model.linear._parameters["weight"], nn.Parameter)


def test_an_lstm_stage_is_called_through_functional_call() -> None:
    # nn.LSTM overrides __setattr__ to keep _flat_weights in sync with its parameters: a module
    # like that may hold state a swap past setattr leaves stale, so it takes the general path
    torch.manual_seed(0)
    model = nn.Sequential(nn.LSTM(3, 4, batch_first=True))
    swap = ParameterSwap(model)
    assert not swap.direct
    x = torch.randn(2, 5, 3)
    ours_version, theirs_version = _version(model, 0.25), _version(model, 0.25)
    ours = swap(ours_version, (x,))[0]
    theirs = functional_call(model, theirs_version, (x,))[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.equal(ours, model(x)[0])
    for a, b in zip(_grads(ours, ours_version), _grads(theirs, theirs_version)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
