"""Models with several inputs and structured outputs, the ``hf-lm`` workload and its data, and
the built-in ``gpt`` at a GPT-2-sized vocabulary (in process, no launches)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from pipedream.data import MicrobatchStream
from pipedream.errors import WorkloadError
from pipedream.graph.stages import build_stage_module, stage_ios
from pipedream.model_io import ModelIO, call_model
from pipedream.profiler.command import profile_workload
from pipedream.profiler.graph_profile import layer_graph
from pipedream.workload import Workload, load_workload
from pipedream.workload_options import absolute_paths, runtime_signature
from pipedream.workloads import hf_lm
from pipedream.workloads.gpt import markov_chain

transformers = pytest.importorskip("transformers")

TINY = {"layers": "2", "dim": "16", "heads": "2", "vocab": "32", "seq": "8", "samples": "32"}


class Masked(nn.Module):
    """Two inputs (tokens and a float mask) as keyword arguments, a dict out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 10)

    def forward(self, tokens: Tensor, mask: Tensor) -> dict[str, Tensor]:
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.relu(block(x)) * mask[..., None]
        return {"logits": self.head(x), "hidden": x}


class _Items(Dataset[tuple[dict[str, Tensor], Tensor]]):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(10, (32, 6), generator=generator)
        self.masks = (torch.rand(32, 6, generator=generator) > 0.2).float()

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[dict[str, Tensor], Tensor]:
        return {"tokens": self.tokens[i], "mask": self.masks[i]}, self.tokens[i]


def masked_workload(microbatch_size: int = 4) -> Workload:
    torch.manual_seed(0)
    data = _Items()

    def loss(output: dict[str, Tensor], target: Tensor) -> Tensor:
        logits = output["logits"]
        return nn.functional.cross_entropy(logits.reshape(-1, 10), target.reshape(-1))

    return Workload(
        model=Masked(),
        example_input={
            "tokens": data.tokens[:microbatch_size],
            "mask": data.masks[:microbatch_size],
        },
        loss_fn=loss,
        dataset=data,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )


def test_keyword_inputs_reach_the_stages_that_use_them() -> None:
    workload = masked_workload()
    graph = layer_graph(workload.model, workload.example_input)
    assert graph.layers == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert graph.input_names == ("tokens", "mask")
    ios = stage_ios(graph, [(0, 1), (2, 2), (3, 4)])
    assert ios[0].inputs == ("tokens", "mask")
    # the mask is read by the first stage from the data and sent to both later stages, which
    # use it; the model's second output ("hidden") is made on the last stage
    assert all("mask" in io.inputs for io in ios[1:]) and "mask" in ios[0].no_grad
    assert [c for c, _ in ios[0].consumers] == [1, 2]
    assert len(ios[2].outputs) == 2

    # the stages chained on one microbatch give the model's own output
    inputs = graph.model_io.flatten_inputs(workload.example_input)
    values = dict(zip(graph.input_names, inputs))
    for index, (first, last) in enumerate([(0, 1), (2, 2), (3, 4)]):
        module = build_stage_module(graph, workload.model, first, last, ios[index])
        values.update(zip(ios[index].outputs, module(*(values[v] for v in ios[index].inputs))))
    got = graph.model_io.unflatten_outputs([values[v] for v in ios[2].outputs])
    want = call_model(workload.model, workload.example_input)
    assert set(got) == {"logits", "hidden"}
    assert torch.equal(got["logits"], want["logits"]) and torch.equal(got["hidden"], want["hidden"])


def test_dict_inputs_are_collated_and_flattened_in_the_traced_order() -> None:
    workload = masked_workload()
    stream = MicrobatchStream(workload.dataset, 4, seed=0)
    inputs = stream.inputs(3)
    assert set(inputs) == {"tokens", "mask"} and inputs["tokens"].shape == (4, 6)
    graph = layer_graph(workload.model, workload.example_input)
    flat = graph.model_io.flatten_inputs({"mask": inputs["mask"], "tokens": inputs["tokens"]})
    assert flat[0] is inputs["tokens"] and flat[1] is inputs["mask"]  # by name, not by order
    with pytest.raises(WorkloadError, match="structure of the example input"):
        graph.model_io.flatten_inputs({"tokens": inputs["tokens"]})
    with pytest.raises(WorkloadError, match="takes one tensor"):
        ModelIO().flatten_inputs(inputs)


def test_profile_of_a_model_with_two_inputs() -> None:
    module = sys.modules[__name__]
    module.masked_workload_factory = masked_workload  # type: ignore[attr-defined]
    profile = profile_workload(f"{__name__}:masked_workload_factory", {}, warmup=0, repeats=1)
    assert profile.layer_names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert profile.microbatch_size == 4
    assert profile.overhead is not None and profile.overhead.loss_forward_ms > 0


@pytest.mark.parametrize(
    ("config", "layers"),
    [
        ("gpt2", ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0"]),
        ("llama", ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1"]),
        ("mistral", ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1"]),
        ("qwen2", ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1"]),
    ],
)
def test_hf_lm_families_build_and_trace_into_the_models_own_layers(
    config: str, layers: list[str]
) -> None:
    workload = load_workload("hf-lm", {"config": config, **TINY}, microbatch_size=2)
    graph = layer_graph(workload.model, workload.example_input)
    assert graph.layers[: len(layers)] == layers and graph.layers[-1] == "lm_head"
    model = workload.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tie
    output = call_model(model, workload.example_input)
    loss = workload.loss_fn(output, MicrobatchStream(workload.dataset, 2, 0).targets(0))
    assert abs(float(loss.detach()) - np.log(32)) < 0.5  # random weights: about log(vocab)


def test_hf_lm_options_and_errors() -> None:
    untied = load_workload("hf-lm", {"config": "llama", **TINY, "tie": "false", "kv_heads": "1"})
    assert untied.model.lm_head.weight is not untied.model.model.embed_tokens.weight
    assert untied.model.config.num_key_value_heads == 1
    for args, match in [
        ({"config": "bert"}, "unknown config 'bert'"),
        ({"config": "llama", "heads": "4", "kv_heads": "3"}, "not a multiple of kv_heads"),
        ({"config": "gpt2", "kv_heads": "1"}, "no grouped-query attention"),
        ({"dim": "30", "heads": "4"}, "not divisible by heads"),
    ]:
        with pytest.raises(WorkloadError, match=match):
            load_workload("hf-lm", {**TINY, **args})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # each of these crashed inside transformers or torch.export, or named the gpt workload
        ({"config": "llama", "kv_heads": "-1"}, "hf-lm: kv_heads must be >= 1 (or 0 for one per "),
        ({"ffn": "-3"}, "hf-lm: ffn must be >= 1 (or 0 for 4 x dim), got -3"),
        ({"config": "qwen2", "ffn": "-3"}, "hf-lm: ffn must be >= 1 (or 0 for 4 x dim), got -3"),
        (
            {"config": "llama", "dim": "12", "heads": "4"},
            "hf-lm: llama needs an even head size for its rotary position embeddings, but "
            "dim/heads = 12/4 = 3; pick dim and heads with an even quotient, e.g. dim=24 heads=4",
        ),
        (
            {"config": "mistral", "dim": "18", "heads": "2", "kv_heads": "1"},
            "hf-lm: mistral needs an even head size for its rotary position embeddings, but "
            "dim/heads = 18/2 = 9;",
        ),
        (
            {"vocab": "1"},
            "hf-lm: vocab must be >= 2, got 1; a model with one token has nothing to predict",
        ),
        (
            {"vocab": "3"},
            "hf-lm: branching must be 1 to vocab=3 (each token's distinct successors in the "
            "synthetic stream), got 4; choose one in that range, or a larger vocab",
        ),
        ({"branching": "0"}, "hf-lm: branching must be 1 to vocab=32 (each token's distinct "),
        ({"layers": "-1"}, "hf-lm: layers must be >= 1, got -1"),
        ({"seq": "1"}, "hf-lm: seq must be >= 2, got 1"),
        ({"test_samples": "0"}, "hf-lm: test_samples must be >= 1, got 0"),
    ],
    ids=[
        "kv_heads-negative",
        "ffn-negative",
        "ffn-negative-qwen2",
        "odd-head-llama",
        "odd-head-mistral",
        "vocab-1",
        "branching-above-vocab",
        "branching-0",
        "layers-negative",
        "seq-1",
        "test_samples-0",
    ],
)
def test_hf_lm_refuses_sizes_up_front_naming_the_option(args: dict[str, str], message: str) -> None:
    with pytest.raises(WorkloadError, match=f"^{re.escape(message)}"):
        load_workload("hf-lm", {**TINY, **args})


def test_a_wrapped_model_refuses_an_empty_window() -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    model = transformers.GPT2LMHeadModel(config)  # seq=0 failed in torch.export
    with pytest.raises(WorkloadError, match=re.escape("hf-lm: seq must be >= 1, got 0")):
        hf_lm.wrap(model, seq=0)


def test_hf_lm_without_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    with pytest.raises(WorkloadError, match=r"pip install -e '\.\[hf\]'"):
        load_workload("hf-lm", TINY)


def test_padded_data_masks_the_padding_out_of_the_loss() -> None:
    workload = load_workload("hf-lm", {**TINY, "padding": "true"}, microbatch_size=4)
    inputs, targets = MicrobatchStream(workload.dataset, 8, 0).microbatch(0)
    real = inputs["attention_mask"].bool()
    assert (~real).any() and real[:, : 8 // 2].all()  # at least half of every sequence
    assert bool((targets[~real] == -100).all()) and bool((targets[real] >= 0).all())
    assert bool((inputs["input_ids"][~real] == 0).all())


@pytest.mark.parametrize("suffix", [".npy", ".pt", ".bin"])
def test_hf_lm_token_files(tmp_path: Path, suffix: str) -> None:
    tokens = np.arange(2000) % 50
    path = tmp_path / f"tokens{suffix}"
    writers: dict[str, Callable[[], None]] = {
        ".npy": lambda: np.save(path, tokens),
        ".pt": lambda: torch.save(torch.from_numpy(tokens), path),
        ".bin": lambda: tokens.astype(np.uint16).tofile(path),
    }
    writers[suffix]()
    workload = load_workload(
        "hf-lm", {**TINY, "vocab": "50", "tokens": str(path), "test_samples": "4"}
    )
    inputs, targets = workload.dataset[0]
    assert torch.equal(inputs, torch.arange(8)) and torch.equal(targets, torch.arange(1, 9))
    assert len(workload.dataset) == min(32, (2000 - 1) // 8 - 4)
    metrics = workload.evaluate(workload.model)  # type: ignore[misc]
    assert set(metrics) == {"test_loss"}  # no known best loss for a user's data
    with pytest.raises(WorkloadError, match="vocab=50"):
        load_workload("hf-lm", {**TINY, "vocab": "40", "tokens": str(path)})
    with pytest.raises(WorkloadError, match="no such file"):
        load_workload("hf-lm", {**TINY, "tokens": str(tmp_path / "missing.npy")})


@pytest.mark.parametrize(
    ("suffix", "ids", "message"),
    [
        (
            ".npy",
            np.array([3, -1, 5] * 100),  # an IndexError inside the embedding, at the first step
            "holds token id -1; ids must be 0 to vocab-1=31 (drop or replace the negative ones, "
            "e.g. padding markers)",
        ),
        (
            ".npy",
            np.arange(300) % 32 + 0.5,  # truncated to ids silently
            "holds float64 values, not integer token ids; save the ids as integers (e.g. int64; "
            ".bin files hold uint16)",
        ),
        (
            ".pt",
            torch.arange(300.0) % 32,
            "holds float32 values, not integer token ids; save the ids as integers",
        ),
        (
            ".npy",
            np.arange(300) % 2 == 0,
            "holds bool values, not integer token ids; save the ids as integers",
        ),
    ],
    ids=["negative", "float-npy", "float-pt", "bool-npy"],
)
def test_hf_lm_refuses_token_ids_it_would_misread(
    tmp_path: Path, suffix: str, ids: np.ndarray | Tensor, message: str
) -> None:
    path = tmp_path / f"tokens{suffix}"
    if suffix == ".npy":
        np.save(path, ids)
    else:
        torch.save(ids, path)
    with pytest.raises(WorkloadError, match=re.escape(f"hf-lm: tokens={str(path)!r} {message}")):
        load_workload("hf-lm", {**TINY, "tokens": str(path), "test_samples": "2"})


def test_a_relative_token_path_is_recorded_absolute_so_a_plan_trains_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile (and so its plans) kept the path as written: launched from another directory,
    the ranks found no file, or another file of the same name."""
    made, elsewhere = tmp_path / "made", tmp_path / "elsewhere"
    made.mkdir()
    elsewhere.mkdir()
    np.save(made / "tokens.npy", np.arange(600) % 32)
    monkeypatch.chdir(made)
    args = {**TINY, "tokens": "tokens.npy", "test_samples": "2"}
    profile = profile_workload("hf-lm", args, microbatch_size=2, warmup=0, repeats=1)
    assert profile.workload_args == {**args, "tokens": str(made / "tokens.npy")}
    monkeypatch.chdir(elsewhere)
    load_workload("hf-lm", profile.workload_args)
    missing = (
        f"hf-lm: tokens='tokens.npy': no such file in {elsewhere}, where a relative path is read "
        "from; give the absolute path of a .npy, .pt or .bin file"
    )
    with pytest.raises(WorkloadError, match=re.escape(missing)):
        load_workload("hf-lm", args)


def test_only_the_options_that_name_files_are_made_absolute(tmp_path: Path) -> None:
    def own_tokens(tokens: str = "") -> nn.Module: ...  # its own option: no path known

    def transformers_model(layers: int = 1) -> nn.Module: ...  # tokens goes to wrap

    args = {"tokens": "data/t.npy", "layers": "2"}
    made_absolute = {"tokens": str(Path.cwd() / "data/t.npy"), "layers": "2"}
    assert absolute_paths("hf-lm", runtime_signature(hf_lm.build), args) == made_absolute
    assert absolute_paths("m:f", runtime_signature(transformers_model), args) == made_absolute
    assert absolute_paths("m:f", runtime_signature(own_tokens), args) == args
    given = {"tokens": str(tmp_path / "t.npy"), "seq": "8"}
    assert absolute_paths("hf-lm", runtime_signature(hf_lm.build), given) == given
    synthetic = {"tokens": ""}
    assert absolute_paths("hf-lm", runtime_signature(hf_lm.build), synthetic) == synthetic


def test_a_function_returning_a_transformers_model_is_wrapped() -> None:
    module = sys.modules[__name__]

    def tiny_gpt2(layers: int = 1) -> nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=32)
        return transformers.GPT2LMHeadModel(config)

    module.tiny_gpt2 = tiny_gpt2  # type: ignore[attr-defined]
    name = f"{__name__}:tiny_gpt2"
    workload = load_workload(name, {"layers": "2", "seq": "8", "samples": "16"}, microbatch_size=3)
    assert workload.model.config.n_layer == 2 and not workload.model.config.use_cache
    assert workload.example_input.shape == (3, 8) and len(workload.dataset) == 16
    with pytest.raises(WorkloadError, match="has no option 'width'"):
        load_workload(name, {"width": "8"})

    def short_context() -> nn.Module:  # a context shorter than the default window of 64
        config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32)
        return transformers.GPT2LMHeadModel(config)

    module.short_context = short_context  # type: ignore[attr-defined]
    name = f"{__name__}:short_context"
    assert load_workload(name, {"samples": "4"}, microbatch_size=2).example_input.shape == (2, 32)
    with pytest.raises(WorkloadError, match="seq=33 is longer than the model's 32 positions"):
        load_workload(name, {"seq": "33"})


def test_gpt_builds_a_gpt2_sized_vocabulary_sparsely() -> None:
    generator = torch.Generator().manual_seed(0)
    chain = markov_chain(50257, 4, generator)
    assert chain.successors.shape == (50257, 4) and chain.probs.shape == (50257, 4)
    assert bool((chain.successors.sort(dim=1).values.diff(dim=1) > 0).all())  # distinct
    assert torch.allclose(chain.probs.sum(1), torch.ones(50257))
    workload = load_workload(
        "gpt", {"vocab": "50257", "samples": "8", "test_samples": "2"}, microbatch_size=2
    )
    assert workload.model.head.weight.shape == (50257, 64)
