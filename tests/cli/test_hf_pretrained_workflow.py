"""Fine-tune a ``transformers`` model directory and write the result as one: ``profile hf-lm
--workload-arg pretrained=DIR``, ``plan``, ``train``, then ``export --hf OUT``, which
``AutoModelForCausalLM.from_pretrained`` loads with the trained weights and the tokenizer's
files of ``DIR``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipedream.runtime.checkpoint import load_full_state_dict

from launching import run_main, straight_plan, write_plan
from plain_loop import plain_loop
from runs import max_rel_diff

transformers = pytest.importorskip("transformers")


def _saved_gpt2(directory: Path) -> dict[str, torch.Tensor]:
    """A tiny tied GPT-2 with seeded weights and a tokenizer file, saved to ``directory``."""
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=32, bos_token_id=31,
        eos_token_id=31, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(11)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_text('{"model": "a tokenizer"}')
    return {key: value.clone() for key, value in model.state_dict().items()}


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
    assert said.stdout.splitlines()[-1] == (
        "wrote a transformers GPT2LMHeadModel and 1 tokenizer file to out: "
        "AutoModelForCausalLM.from_pretrained('out') loads it"
    )
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.state_dict().keys() == state.keys()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": "a tokenizer"}'

    # the run started from the saved weights and trained as a plain loop from them does
    assert any(not torch.equal(state[key], saved[key]) for key in saved)
    want, _ = plain_loop(
        "hf-lm", {"pretrained": str(tmp_path / "gpt2"), "seq": "8", "samples": "64"},
        steps=4, microbatches=1, microbatch_size=8,
    )  # fmt: skip
    assert max_rel_diff(state, want) < 1e-5
    assert state.keys() == load_full_state_dict(checkpoint).keys()


def test_export_says_what_it_cannot_write(tmp_path: Path) -> None:
    plan = write_plan(straight_plan("mlp", [[str(i) for i in range(9)]]), tmp_path / "plan.yaml")
    run = tmp_path / "run"
    trained = run_main("train", str(plan), "--steps", "1", "--run-dir", str(run), "--no-progress")
    assert trained.returncode == 0, trained.stderr
    checkpoint = run / "checkpoints" / "step-000001"
    (tmp_path / "afile").write_text("")
    cases = [
        (["--hf", str(tmp_path / "mlp")], "export --hf: the workload's model is a Sequential, "
         "not a transformers model; write its state dict with -o model.pt"),
        (["--hf", str(tmp_path / "afile")], f"--hf {tmp_path / 'afile'}: exists and is not a "
         "directory; give a directory"),
        (["--hf", str(checkpoint / "hf")], f"--hf {checkpoint / 'hf'}: is inside the input "
         f"folder {checkpoint}, whose files are the command's input; write the output "
         "elsewhere"),
        (["--hf", ""], "--hf '': give a directory such as exported-model"),
    ]  # fmt: skip
    for options, message in cases:
        said = run_main("export", str(checkpoint), *options)
        assert said.returncode == 2, said.stderr
        assert said.stderr.strip() == f"pipedream export: error: {message}"
    assert not (tmp_path / "mlp").exists()
