"""``hf-lm pretrained=DIR``: a causal LM that ``save_pretrained`` wrote, loaded as it was saved
(ties kept, missing tensors the same on every rank), and refused in one line where it cannot
be; ``save_transformers``, the writing side of ``pipedream export --hf``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream.errors import WorkloadError
from pipedream.workload import load_workload, recorded_args
from pipedream.workloads.hf_pretrained import (
    config_record,
    load_transformers,
    model_from_record,
    save_transformers,
)

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
    assert model.training  # from_pretrained gives it in eval mode: dropout off
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


def test_tensors_the_files_lack_are_the_same_on_every_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A base model's files give no head: every rank must initialize the same one."""
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=32, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaModel(config).save_pretrained(tmp_path / "base")
    capsys.readouterr()  # what saving printed
    args = {"pretrained": str(tmp_path / "base"), **DATA}
    first, second = load_workload("hf-lm", args), load_workload("hf-lm", args)
    assert torch.equal(first.model.lm_head.weight, second.model.lm_head.weight)
    reseeded = load_workload("hf-lm", {**args, "seed": "1"})
    assert not torch.equal(first.model.lm_head.weight, reseeded.model.lm_head.weight)
    said = capsys.readouterr().err.strip().splitlines()
    assert said[0] == (
        f"pipedream: note: pretrained='{tmp_path / 'base'}' lacks 1 tensor of "
        "LlamaForCausalLM (lm_head.weight): initialized from seed 0, the same on every rank"
    )
    assert not any("LOAD REPORT" in line or "Loading" in line for line in said)


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
    bert = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=32, max_position_embeddings=16,
    )  # fmt: skip
    transformers.BertModel(bert).save_pretrained(tmp_path / "bert")
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text(
        (tmp_path / "gpt2" / "config.json").read_text()
    )
    installed = transformers.__version__
    later = f"{int(installed.split('.')[0]) + 1}.0.0"  # names some settings otherwise
    _gpt2(tmp_path / "later")
    config = json.loads((tmp_path / "later" / "config.json").read_text())
    (tmp_path / "later" / "config.json").write_text(
        json.dumps({**config, "transformers_version": later})
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
        ({"pretrained": "gpt2", "vocab": "64"}, "hf-lm: pretrained='gpt2' gives the model's "
         "config, so vocab cannot be set too; leave it out (or build from a config without "
         "pretrained)"),
        ({"pretrained": "gpt2/config.json"}, "hf-lm: pretrained='gpt2/config.json': is a file, "
         "not a directory; give a directory that save_pretrained wrote (config.json and the "
         "weights)"),
        ({"pretrained": "later"}, f"hf-lm: pretrained='later' was saved by transformers "
         f"{later}, and transformers {installed} reads some of its settings otherwise; install "
         f"transformers {later[0]}.x to train it"),
        ({"pretrained": "bert"}, "hf-lm: the BertLMHeadModel is not causal: its outputs at a "
         "position change with later tokens (an encoder such as BERT attends both ways), so it "
         "would learn to read the next token off its input; give a decoder-only causal LM (or a "
         "config with is_decoder=True)"),
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
    rebuilt = model_from_record(config_record(model))  # as export builds it: no files needed
    assert type(rebuilt) is type(model) and rebuilt.state_dict().keys() == trained.keys()
    load_transformers(rebuilt, trained)
    copied = save_transformers(rebuilt, tmp_path / "out", source=str(source))
    assert copied == 1
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert not (tmp_path / "out" / "notes.txt").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.use_cache is True  # generation wants its cache back
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_a_model_that_ties_what_the_checkpoint_holds_apart_is_refused() -> None:
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=32, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    untied = transformers.LlamaForCausalLM(config)
    state = {key: value.clone() for key, value in untied.state_dict().items()}
    tied = model_from_record({**config_record(untied), "tie_word_embeddings": True})
    with pytest.raises(WorkloadError) as error:
        load_transformers(tied, state)
    assert str(error.value).startswith("export --hf: the model built for the checkpoint does not ")
    assert "it is not the model that was trained" in str(error.value)
    extra = {**state, "lm_head.bias": torch.zeros(32)}  # a head of the user's own
    with pytest.raises(WorkloadError) as error:
        load_transformers(transformers.LlamaForCausalLM(config), extra)
    assert str(error.value).startswith(
        "export --hf: the model built for the checkpoint does not fit it (Error(s) in loading "
        'state_dict for LlamaForCausalLM: Unexpected key(s) in state_dict: "lm_head.bias".'
    )
    assert str(error.value).endswith("write its state dict with -o model.pt")
    with pytest.raises(WorkloadError) as error:
        load_transformers(nn.Linear(2, 2), {})
    assert str(error.value) == (
        "export --hf: the workload's model is a Linear, not a transformers model; write its "
        "state dict with -o model.pt"
    )


def test_a_functions_model_trains_in_train_mode() -> None:
    """``from_pretrained`` gives a model in eval mode; a function returning it must still train
    with its dropout on, as ``hf-lm pretrained=`` does."""
    from pipedream.workloads.hf_lm import wrap

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    workload = wrap(model, seq=8, samples=32, weight_decay=0.0)
    assert workload.model.training
    assert workload.optimizer(model.parameters()).param_groups[0]["weight_decay"] == 0.0


def test_load_model_checks_options_as_load_workload_does(tmp_path: Path) -> None:
    """``export --hf`` builds with :func:`load_model`: a misspelt option is refused, not
    dropped, and the options a function leaves to ``wrap`` are known."""
    from pipedream.workload import load_model

    _gpt2(tmp_path / "gpt2")
    model = load_model("hf-lm", {"pretrained": str(tmp_path / "gpt2"), "seq": "8"})
    assert type(model).__name__ == "GPT2LMHeadModel"
    with pytest.raises(WorkloadError, match="has no option 'pretraned'"):
        load_model("hf-lm", {"pretraned": str(tmp_path / "gpt2")})
    with pytest.raises(WorkloadError, match="has no option 'width'"):
        load_model("gpt", {"width": "8"})
