"""Fine-tune a ``transformers`` model directory and write the result as one: ``profile hf-lm
--workload-arg pretrained=DIR``, ``plan``, ``train``, then ``export --hf OUT``, which
``AutoModelForCausalLM.from_pretrained`` loads with the trained weights and the tokenizer's
files of ``DIR``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.workloads.hf_pretrained import TOKENIZER_FILES

from launching import run_main, straight_plan, write_plan
from plain_loop import plain_loop
from runs import max_rel_diff

transformers = pytest.importorskip("transformers")


def _saved_files(directory: Path) -> list[Path]:
    """The files ``save_pretrained`` wrote (which ones depends on transformers' version)."""
    return sorted(directory.iterdir())


def _saved_gpt2(directory: Path) -> dict[str, torch.Tensor]:
    """A tiny tied GPT-2 with seeded weights and a tokenizer file, saved to ``directory``."""
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=32, bos_token_id=31,
        eos_token_id=31, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(11)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    return {key: value.clone() for key, value in model.state_dict().items()}


def _tokenizer() -> Any:
    """A word-level tokenizer of 32 words (``tokenizers``, which ``transformers`` needs)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(31)} | {"[UNK]": 31}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train in this process on one thread, as the plain loop does (another thread count sums
    in another order, which Adam turns into 1e-4 differences)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_a_saved_model_fine_tunes_and_exports_as_a_transformers_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    saved = _saved_gpt2(tmp_path / "gpt2")
    args = ["--workload-arg", "pretrained=gpt2", "--workload-arg", "seq=8"]
    profiled = run_main("profile", "hf-lm", *args, "--workload-arg", "samples=64", "-o", "p.yaml")
    assert profiled.returncode == 0, profiled.stderr[-2000:]
    assert f"pretrained: {tmp_path / 'gpt2'}" in (tmp_path / "p.yaml").read_text()
    planned = run_main("plan", "p.yaml", "--workers", "1", "-o", "plan.yaml")
    assert planned.returncode == 0, planned.stderr[-2000:]
    trained = run_main("train", "plan.yaml", "--steps", "4", "--run-dir", "run", "--no-progress")
    assert trained.returncode == 0, trained.stderr[-2000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000004"

    said = run_main("export", str(checkpoint), "-o", "model.pt", "--hf", "out")
    assert said.returncode == 0, said.stderr[-2000:]
    tokenizer_files = [p.name for p in _saved_files(tmp_path / "gpt2") if p.name in TOKENIZER_FILES]
    assert len(tokenizer_files) >= 2  # tokenizer.json, tokenizer_config.json, per version more
    assert said.stdout.splitlines()[-1] == (
        f"wrote a transformers GPT2LMHeadModel and {len(tokenizer_files)} tokenizer files to "
        "out: AutoModelForCausalLM.from_pretrained('out') loads it"
    )
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.state_dict().keys() == state.keys()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("w3 w7")["input_ids"] == [3, 7]

    # the checkpoint alone makes the export: the model's directory gone, it is built from the
    # config the manifest records (and the tokenizer's files are the user's to copy)
    (tmp_path / "gpt2").rename(tmp_path / "moved")
    said = run_main("export", str(checkpoint), "--hf", "again")
    assert said.returncode == 0, said.stderr[-2000:]
    assert said.stdout.splitlines() == [
        "wrote a transformers GPT2LMHeadModel to again: "
        "AutoModelForCausalLM.from_pretrained('again') loads it",
        f"note: {tmp_path / 'gpt2'}, where the run's model came from, is gone: copy its "
        "tokenizer's files to again yourself",
    ]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert all(torch.equal(value, state[key]) for key, value in again.state_dict().items())

    # a checkpoint without the record (older, or a model class of the user's own): the
    # workload's factory builds the model, from the directory where it now is
    manifest = checkpoint / "manifest.yaml"
    text = yaml.safe_load(manifest.read_text())
    del text["transformers_config"]
    manifest.write_text(yaml.safe_dump(text))
    said = run_main("export", str(checkpoint), "--hf", "old")
    assert said.returncode == 2
    assert "pretrained='" in said.stderr and "no such directory" in said.stderr
    moved = f"pretrained={tmp_path / 'moved'}"
    said = run_main("export", str(checkpoint), "--hf", "old", "--workload-arg", moved)
    assert said.returncode == 0, said.stderr[-2000:]
    old = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "old")
    assert all(torch.equal(value, state[key]) for key, value in old.state_dict().items())
    said = run_main("export", str(checkpoint), "-o", "m.pt", "--workload-arg", moved)
    assert said.stderr.strip() == (
        "pipedream export: error: --workload-arg builds the model --hf writes; give --hf DIR too"
    )
    (tmp_path / "moved").rename(tmp_path / "gpt2")

    # the run started from the saved weights and trained as a plain loop from them does
    assert any(not torch.equal(state[key], saved[key]) for key in saved)
    want, _ = plain_loop(
        "hf-lm", {"pretrained": str(tmp_path / "gpt2"), "seq": "8", "samples": "64"},
        steps=4, microbatches=1, microbatch_size=8,
    )  # fmt: skip
    assert max_rel_diff(state, want) < 1e-5
    assert state.keys() == load_full_state_dict(checkpoint).keys()


def test_export_says_what_it_cannot_write_before_writing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _saved_gpt2(tmp_path / "gpt2")
    args = {"pretrained": str(tmp_path / "gpt2"), "seq": "8", "samples": "32"}
    layers = ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0"]
    layers += ["transformer.h.1", "transformer.ln_f", "lm_head"]
    for name, workload, stages, options in [
        ("gpt2", "hf-lm", [layers], args),
        ("mlp", "mlp", [[str(i) for i in range(9)]], None),
    ]:
        plan = write_plan(straight_plan(workload, stages, workload_args=options), tmp_path / "p")
        run = f"run-{name}"
        trained = run_main("train", str(plan), "--steps", "1", "--run-dir", run, "--no-progress")
        assert trained.returncode == 0, trained.stderr[-2000:]
    trained_at = (tmp_path / "gpt2" / "model.safetensors").stat().st_mtime
    source = _saved_files(tmp_path / "gpt2")
    gpt2, mlp = (Path(f"run-{name}", "checkpoints", "step-000001") for name in ("gpt2", "mlp"))
    (tmp_path / "afile").write_text("")
    cases = [
        (mlp, ["--hf", "out", "-o", "m.pt"], "export --hf: the workload's model is a "
         "Sequential, not a transformers model; write its state dict with -o model.pt"),
        (gpt2, ["--hf", "afile"], "--hf afile: exists and is not a directory; give a directory"),
        (gpt2, ["--hf", "afile/sub"], "--hf afile/sub: afile is not a directory; give a "
         "directory"),
        (gpt2, ["--hf", str(gpt2 / "hf")], f"--hf {gpt2 / 'hf'}: is inside the input folder "
         f"{gpt2}, whose files are the command's input; write the output elsewhere"),
        (gpt2, ["--hf", "gpt2/"], f"--hf gpt2/: is the input {tmp_path / 'gpt2'}, which "
         "writing it would replace; write the output elsewhere"),
        (gpt2, ["--hf", "same", "-o", "same"], "-o same and --hf same are the same path; give "
         "the state dict a file name of its own"),
        (gpt2, ["--hf", ""], "--hf '': give a directory such as exported-model"),
    ]  # fmt: skip
    for checkpoint, options, message in cases:
        said = run_main("export", str(checkpoint), *options)
        assert said.returncode == 2, said.stderr
        assert said.stderr.strip() == f"pipedream export: error: {message}"
    # a config a later major release of transformers recorded: this one reads it otherwise
    manifest = yaml.safe_load((gpt2 / "manifest.yaml").read_text())
    installed = transformers.__version__
    major = int(installed.split(".")[0])
    later = f"{major + 1}.0.0"
    manifest["transformers_config"]["transformers_version"] = later
    (gpt2 / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    said = run_main("export", str(gpt2), "--hf", "out")
    assert said.returncode == 2, said.stderr
    assert said.stderr.strip() == (
        f"pipedream export: error: export --hf: the checkpoint's model config was written by "
        f"transformers {later}, and transformers {installed} reads some of its settings "
        f"otherwise; export with transformers {major + 1}.x installed, or write the state dict "
        "with -o model.pt"
    )
    # an earlier major release's: a later one reads it (5.x builds what 4.x recorded)
    manifest["transformers_config"]["transformers_version"] = f"{major - 1}.57.1"
    (gpt2 / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    said = run_main("export", str(gpt2), "--hf", "earlier")
    assert said.returncode == 0, said.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "m.pt").exists()
    assert _saved_files(tmp_path / "gpt2") == source  # nothing written there either
    assert (tmp_path / "gpt2" / "model.safetensors").stat().st_mtime <= trained_at
