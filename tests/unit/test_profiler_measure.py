"""Per-layer measurement of nn.Sequential models (pipedream.profiler.measure)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipedream.errors import PipedreamError
from pipedream.profiler.measure import ProfilerError, describe_layer, measure_sequential
from pipedream.workload import load_workload


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Split(nn.Module):
    """Returns a tuple, to check that output bytes are summed over tensors."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * 2, x[:, :1].to(torch.float64)


def _tiny() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8),  # "0"
        nn.ReLU(),  # "1"
        nn.BatchNorm1d(8),  # "2"
        nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)),  # "3"
    )


def test_bytes_of_a_tiny_model_are_exact() -> None:
    layers = measure_sequential(_tiny(), torch.randn(2, 4), warmup=1, repeats=2)
    assert [layer.name for layer in layers] == ["0", "1", "2", "3"]
    # float32, batch 2: outputs 2x8, 2x8, 2x8, 2x3
    assert [layer.output_bytes for layer in layers] == [64, 64, 64, 24]
    # Linear(4,8): 40 floats; BatchNorm1d(8): weight, bias, running mean/var (32 floats) plus
    # the int64 num_batches_tracked; Linear(8,8)+Linear(8,3): 72 + 27 floats.
    assert [layer.parameter_bytes for layer in layers] == [160, 0, 136, 396]
    assert layers[0].type == "Linear -> [2, 8]"
    assert layers[3].type == "Linear+Tanh+Linear -> [2, 3]"


def test_saved_bytes_exclude_input_and_parameters_and_count_storages_once() -> None:
    layers = measure_sequential(_tiny(), torch.randn(2, 4), warmup=0, repeats=1)
    saved = {layer.name: layer.saved_bytes for layer in layers}
    assert saved["0"] == 0  # keeps only its input and its weight
    assert saved["1"] == 64  # ReLU keeps its output
    # BatchNorm keeps per-channel statistics (and perhaps a normalized copy): small, > 0
    assert saved["2"] is not None and 0 < saved["2"] <= 64 + 4 * 64
    # tanh keeps its 2x8 output, and the second Linear keeps the same tensor as its input:
    # one storage, counted once
    assert saved["3"] == 64


def test_times_are_positive_and_backward_is_timed() -> None:
    layers = measure_sequential(_tiny(), torch.randn(32, 4), warmup=1, repeats=3)
    for layer in layers:
        assert layer.forward_ms > 0
        assert layer.backward_ms > 0


def test_tuple_outputs_are_summed() -> None:
    layer = describe_layer("split", _Split(), torch.randn(2, 4), warmup=0, repeats=1)
    assert layer.output_bytes == 2 * 4 * 4 + 2 * 1 * 8
    assert layer.parameter_bytes == 0


def test_optimizer_state_bytes() -> None:
    model = _tiny()
    adam = measure_sequential(
        model, torch.randn(2, 4), warmup=0, repeats=1, optimizer=lambda p: torch.optim.Adam(p)
    )
    # exp_avg and exp_avg_sq per parameter, plus a scalar step per parameter tensor
    assert 2 * 160 <= adam[0].optimizer_state_bytes <= 2 * 160 + 2 * 8  # type: ignore[operator]
    assert adam[1].optimizer_state_bytes == 0
    sgd = measure_sequential(
        model,
        torch.randn(2, 4),
        warmup=0,
        repeats=1,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )
    assert sgd[0].optimizer_state_bytes == 0
    momentum = measure_sequential(
        model,
        torch.randn(2, 4),
        warmup=0,
        repeats=1,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    )
    assert momentum[0].optimizer_state_bytes == 160
    assert measure_sequential(model, torch.randn(2, 4))[0].optimizer_state_bytes is None


def test_measuring_leaves_the_model_unchanged() -> None:
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items() if "num_batches" not in k}
    measure_sequential(model, torch.randn(2, 4), warmup=0, repeats=1)
    for param in model.parameters():
        assert param.grad is None
    for key, value in before.items():
        if "running" not in key:  # BatchNorm statistics move in train mode, as in training
            assert torch.equal(model.state_dict()[key], value)


def test_gpt_layers_with_long_token_input() -> None:
    workload = load_workload("gpt", {"layers": "2"}, microbatch_size=2)
    layers = measure_sequential(
        workload.model, workload.example_input, warmup=0, repeats=1, optimizer=workload.optimizer
    )
    assert [layer.name for layer in layers] == ["embed", "h0", "h1", "norm", "head"]
    assert layers[0].output_bytes == 2 * 32 * 64 * 4
    assert layers[0].parameter_bytes == (64 + 32) * 64 * 4
    assert layers[-1].output_bytes == 2 * 32 * 64 * 4  # logits over the vocabulary of 64
    # a transformer block keeps several activations of its output's size
    assert layers[1].saved_bytes is not None and layers[1].saved_bytes > 4 * layers[1].output_bytes
    assert all(layer.backward_ms > 0 for layer in layers)


def test_bad_inputs() -> None:
    with pytest.raises(ProfilerError, match="nn.Sequential"):
        measure_sequential(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(ProfilerError, match="empty"):
        measure_sequential(nn.Sequential(), torch.randn(1, 2))
    with pytest.raises(PipedreamError, match="repeats"):
        measure_sequential(_tiny(), torch.randn(2, 4), repeats=0)
    with pytest.raises(PipedreamError, match="warmup"):
        measure_sequential(_tiny(), torch.randn(2, 4), warmup=-1)


def test_every_timed_pass_is_reported_once() -> None:
    passes: list[tuple[float, float]] = []
    layers = measure_sequential(_tiny(), torch.randn(2, 4), warmup=2, repeats=5, passes=passes)
    assert len(passes) == 5  # the timed ones, not the warm-up
    assert all(forward > 0 and backward > 0 for forward, backward in passes)
    assert len(layers) == 4
