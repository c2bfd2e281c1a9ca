"""``hf-lm pretrained=DIR``: a causal LM that ``save_pretrained`` wrote, loaded as it was saved
(ties kept, missing tensors the same on every rank), and refused in one line where it cannot
be; ``save_transformers``, the writing side of ``pipedream export --hf``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream.errors import WorkloadError
from pipedream.workload import load_workload, recorded_args
from pipedream.workloads.hf_pretrained import save_transformers

transformers = pytest.importorskip("transformers")

DATA = {"samples": "32", "seq": "8"}


def _gpt2(directory: Path, *, seed: int = 3) -> nn.Module:
    """A tiny tied GPT-2 with seeded weights, saved to ``directory``."""
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=32, bos_token_id=31,
        eos_token_id=31,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(directory)
    return model


def test_the_saved_model_is_what_the_workload_trains(tmp_path: Path) -> None:
    saved = _gpt2(tmp_path / "gpt2")
    workload = load_workload("hf-lm", {"pretrained": str(tmp_path / "gpt2"), **DATA})
    model = workload.model
    state = model.state_dict()
    assert state.keys() == saved.state_dict().keys()
    for key, value in saved.state_dict().items():
        assert torch.equal(state[key], value), key
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives
    assert model.config.use_cache is False  # a pipeline cuts no cache
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert workload.description.startswith(
        f"gpt2 from {tmp_path / 'gpt2'} ({sum(p.numel() for p in saved.parameters()):,} "
        "parameters), vocab 32; 32 sequences of 8 tokens"
    )


def test_a_bfloat16_directory_loads_in_float32(tmp_path: Path) -> None:
    saved = _gpt2(tmp_path / "bf16").to(torch.bfloat16)
    saved.save_pretrained(tmp_path / "bf16")
    model = load_workload("hf-lm", {"pretrained": str(tmp_path / "bf16"), **DATA}).model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(model.transformer.wte.weight, saved.transformer.wte.weight.float())


def test_tensors_the_files_lack_are_the_same_on_every_rank(tmp_path: Path) -> None:
    """A base model's files give no head: every rank must initialize the same one."""
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=32, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaModel(config).save_pretrained(tmp_path / "base")
    args = {"pretrained": str(tmp_path / "base"), **DATA}
    first, second = load_workload("hf-lm", args), load_workload("hf-lm", args)
    assert torch.equal(first.model.lm_head.weight, second.model.lm_head.weight)
    reseeded = load_workload("hf-lm", {**args, "seed": "1"})
    assert not torch.equal(first.model.lm_head.weight, reseeded.model.lm_head.weight)
    assert "1 tensors not in its files initialized from seed 0" in first.description


def test_a_profile_records_the_directory_as_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    recorded = recorded_args("hf-lm", {"pretrained": "gpt2", "seq": "8"})
    assert recorded == {"pretrained": str(tmp_path / "gpt2"), "seq": "8"}


def test_what_cannot_be_loaded_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _gpt2(tmp_path / "gpt2")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text(
        (tmp_path / "gpt2" / "config.json").read_text()
    )
    cases = [
        ({"pretrained": "missing"}, f"hf-lm: pretrained='missing': no such directory in "
         f"{tmp_path}; give a directory that save_pretrained wrote (config.json and the "
         "weights)"),
        ({"pretrained": "nothing"}, "hf-lm: pretrained='nothing' has no config.json; give a "
         "directory that save_pretrained wrote (config.json and the weights)"),
        ({"pretrained": "gpt2", "layers": "4", "tie": "false"}, "hf-lm: pretrained='gpt2' "
         "gives the model's config, so layers, tie cannot be set too; leave them out (or build "
         "from a config without pretrained)"),
    ]  # fmt: skip
    for args, message in cases:
        with pytest.raises(WorkloadError) as error:
            load_workload("hf-lm", {**args, **DATA})
        assert str(error.value) == message
    with pytest.raises(WorkloadError) as error:
        load_workload("hf-lm", {"pretrained": "config-only", **DATA})
    said = str(error.value)
    assert said.startswith(
        "hf-lm: pretrained='config-only': transformers cannot load it as a causal LM (OSError: "
    )
    assert "\n" not in said


def test_save_transformers_writes_what_from_pretrained_loads(tmp_path: Path) -> None:
    source = tmp_path / "gpt2"
    _gpt2(source)
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    (source / "notes.txt").write_text("not the tokenizer's")
    model = load_workload("hf-lm", {"pretrained": str(source), **DATA}).model
    trained = {key: value + 1 for key, value in model.state_dict().items()}
    copied = save_transformers(model, trained, tmp_path / "out", source=str(source))
    assert copied == 1
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert not (tmp_path / "out" / "notes.txt").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.use_cache is True  # generation wants its cache back
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert loaded.lm_head.weight is loaded.transformer.wte.weight

    with pytest.raises(WorkloadError) as error:
        save_transformers(nn.Linear(2, 2), {}, tmp_path / "linear", source=None)
    assert str(error.value) == (
        "export --hf: the workload's model is a Linear, not a transformers model; write its "
        "state dict with -o model.pt"
    )
