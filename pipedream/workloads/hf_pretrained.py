"""A ``transformers`` model directory in and out: ``hf-lm pretrained=DIR`` fine-tunes the causal
LM that ``save_pretrained`` wrote to ``DIR``, and ``pipedream export --hf OUT`` writes a trained
checkpoint as such a directory, which ``AutoModelForCausalLM.from_pretrained(OUT)`` loads.

Nothing is downloaded: ``DIR`` is a local directory (``config.json`` and the weights, as
``save_pretrained`` or ``huggingface-cli download --local-dir`` leave them). The model is loaded
in float32, whatever dtype its files hold: the weights a run updates stay in float32, and
``--precision bf16`` or ``fp16`` trains it in autocast. Tensors the files lack (a causal LM
head over a base model's files, say) are initialized from the workload's seed, the same on
every rank.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedream.data import torch_seed
from pipedream.errors import WorkloadError

__all__ = ["TOKENIZER_FILES", "load_pretrained", "save_transformers"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
)
"""The tokenizer's files of a model directory, which an export copies from the directory the
model was loaded from: the exported directory then also loads with ``AutoTokenizer``."""


def load_pretrained(path: str, *, seed: int) -> tuple[nn.Module, int]:
    """The causal LM saved in directory ``path``, in float32, and how many of its tensors the
    files did not hold (initialized from ``seed``). Raises :class:`WorkloadError` in one line
    where ``path`` is not such a directory or ``transformers`` cannot load it."""
    from pipedream.workloads.hf_lm import _transformers

    directory = Path(path)
    if not directory.is_dir():
        where = "" if directory.is_absolute() else f" in {Path.cwd()}"
        raise WorkloadError(
            f"hf-lm: pretrained={path!r}: no such directory{where}; give a directory that "
            "save_pretrained wrote (config.json and the weights)"
        )
    if not (directory / "config.json").is_file():
        raise WorkloadError(
            f"hf-lm: pretrained={path!r} has no config.json; give a directory that "
            "save_pretrained wrote (config.json and the weights)"
        )
    transformers = _transformers()
    with _no_progress_bars(transformers), torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed))
        try:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                directory,
                local_files_only=True,
                dtype=torch.float32,
                output_loading_info=True,
            )
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise WorkloadError(
                f"hf-lm: pretrained={path!r}: transformers cannot load it as a causal LM "
                f"({type(exc).__name__}: {reason:.300})"
            ) from None
    return model, len(info.get("missing_keys", ()))


def save_transformers(
    model: nn.Module, state: dict[str, torch.Tensor], out: Path, *, source: str | None
) -> int:
    """Write ``model`` with the weights ``state`` to directory ``out`` as ``save_pretrained``
    does (``config.json``, ``model.safetensors``), and the tokenizer's files of ``source``, the
    directory the model was loaded from, if any. Returns how many tokenizer files it copied.

    The saved config asks for the key/value cache (``use_cache``), which generation wants and
    which training had turned off."""
    if not callable(getattr(model, "save_pretrained", None)):
        raise WorkloadError(
            f"export --hf: the workload's model is a {type(model).__name__}, not a transformers "
            "model; write its state dict with -o model.pt"
        )
    model.load_state_dict(state)
    pretrained: Any = model  # a transformers PreTrainedModel
    pretrained.config.use_cache = True
    out.mkdir(parents=True, exist_ok=True)
    from pipedream.workloads.hf_lm import _transformers

    with _no_progress_bars(_transformers()):
        pretrained.save_pretrained(out)
    copied = 0
    if source and Path(source).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, out / name)
                copied += 1
    return copied


@contextlib.contextmanager
def _no_progress_bars(transformers: Any) -> Iterator[None]:
    """``transformers`` without its progress bars (loading, writing shards): every rank loads
    the model, and a bar per rank says nothing."""
    shown = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers.utils.logging.enable_progress_bar()
