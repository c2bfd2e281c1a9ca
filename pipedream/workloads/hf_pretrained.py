"""A ``transformers`` model directory in and out: ``hf-lm pretrained=DIR`` fine-tunes the causal
LM that ``save_pretrained`` wrote to ``DIR``, and ``pipedream export --hf OUT`` writes a trained
checkpoint as such a directory, which ``AutoModelForCausalLM.from_pretrained(OUT)`` loads.

Nothing is downloaded: ``DIR`` is a local directory (``config.json`` and the weights, as
``save_pretrained`` or ``huggingface-cli download --local-dir`` leave them). The model is loaded
in float32, whatever dtype its files hold: the weights a run updates stay in float32, and
``--precision bf16`` or ``fp16`` trains it in autocast. Tensors the files lack (a causal LM
head over a base model's files, say) are initialized from the workload's seed, the same on
every rank.

A checkpoint of a ``transformers`` model records the model's config (:func:`config_record`),
so that an export rebuilds the model from the checkpoint alone (:func:`model_from_record`):
not from the training data, nor from a ``pretrained`` directory that may have moved.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedream.data import torch_seed
from pipedream.errors import WorkloadError
from pipedream.wording import count

__all__ = [
    "TOKENIZER_FILES",
    "check_record_release",
    "config_record",
    "load_pretrained",
    "load_transformers",
    "model_from_record",
    "save_transformers",
]

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


def load_pretrained(path: str, *, seed: int) -> nn.Module:
    """The causal LM saved in directory ``path``, in float32, the tensors its files lack
    initialized from ``seed`` (said in one line, once per node). Raises
    :class:`WorkloadError` in one line where ``path`` is not such a directory or
    ``transformers`` cannot load it."""
    from pipedream.workloads.hf_lm import _transformers

    directory = Path(path)
    if not directory.is_dir():
        if directory.exists():
            found = "is a file, not a directory"
        else:
            found = "no such directory" + ("" if directory.is_absolute() else f" in {Path.cwd()}")
        raise WorkloadError(
            f"hf-lm: pretrained={path!r}: {found}; give a directory that save_pretrained wrote "
            "(config.json and the weights)"
        )
    if not (directory / "config.json").is_file():
        raise WorkloadError(
            f"hf-lm: pretrained={path!r} has no config.json; give a directory that "
            "save_pretrained wrote (config.json and the weights)"
        )
    transformers = _transformers()
    recorded: object = None
    with contextlib.suppress(OSError, ValueError, AttributeError):  # from_pretrained says why
        recorded = json.loads((directory / "config.json").read_text()).get("transformers_version")
    installed = newer_release_than_installed(recorded)
    if installed is not None:
        raise WorkloadError(
            f"hf-lm: pretrained={path!r} was saved by transformers {recorded}, and "
            f"transformers {installed} reads some of its settings otherwise; install "
            f"transformers {str(recorded).split('.')[0]}.x to train it"
        )
    with _quiet(transformers), torch.random.fork_rng(devices=[]):
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
    missing = sorted(info.get("missing_keys", ()))
    if missing and os.environ.get("LOCAL_RANK", "0") == "0":  # once per node, not per rank
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        print(
            f"pipedream: note: pretrained={path!r} lacks {count(len(missing), 'tensor')} of "
            f"{type(model).__name__} ({shown}): initialized from seed {seed}, the same on every "
            "rank",
            file=sys.stderr,
        )
    return model


def config_record(model: nn.Module) -> dict[str, Any] | None:
    """The config of ``model``, a ``transformers`` model, as a checkpoint's manifest records
    it (what ``save_pretrained`` writes to ``config.json``); None for another model."""
    config = getattr(model, "config", None)
    if not callable(getattr(model, "save_pretrained", None)) or config is None:
        return None
    record: dict[str, Any] = json.loads(config.to_json_string(use_diff=False))
    return record


def newer_release_than_installed(recorded: object) -> str | None:
    """The installed ``transformers`` version where ``recorded`` (a config's
    ``transformers_version``) is of a later major release, else None. 5.x names some settings
    otherwise than 4.x (``rope_parameters`` holds what 4.x reads from ``rope_theta``), so 4.x
    builds a model of a 5.x config that differs without a word; 5.x reads 4.x configs."""
    from pipedream.torch_support import release_numbers
    from pipedream.workloads.hf_lm import _transformers

    installed = str(_transformers().__version__)
    saved = release_numbers(recorded) if isinstance(recorded, str) else None
    present = release_numbers(installed)
    if saved is None or present is None or saved[0] <= present[0]:
        return None
    return installed


def check_record_release(record: dict[str, Any]) -> None:
    """Refuse to build a model from a config a later major release of ``transformers`` recorded
    (:func:`newer_release_than_installed`)."""
    recorded = record.get("transformers_version")
    installed = newer_release_than_installed(recorded)
    if installed is not None:
        raise WorkloadError(
            f"export --hf: the checkpoint's model config was written by transformers {recorded}, "
            f"and transformers {installed} reads some of its settings otherwise; export with "
            f"transformers {str(recorded).split('.')[0]}.x installed, or write the state dict "
            "with -o model.pt"
        )


def model_from_record(record: dict[str, Any]) -> nn.Module:
    """A causal LM (random weights, float32) of the config a manifest recorded."""
    from pipedream.workloads.hf_lm import _transformers

    transformers = _transformers()
    settings = dict(record)
    model_type = settings.pop("model_type", None)
    try:
        config = transformers.AutoConfig.for_model(model_type, **settings)
        with _quiet(transformers):
            model: nn.Module = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32
            )
    except Exception as exc:
        raise WorkloadError(
            f"export --hf: transformers {transformers.__version__} cannot build the recorded "
            f"{model_type} model ({type(exc).__name__}: {str(exc).strip()[:200]})"
        ) from None
    return model


def save_transformers(model: nn.Module, out: Path, *, source: str | None) -> int:
    """Write ``model``, a ``transformers`` model, to directory ``out`` as ``save_pretrained``
    does (``config.json``, ``model.safetensors``), and the tokenizer's files of ``source``, the
    directory the model was loaded from, if any. Returns how many tokenizer files it copied.

    The saved config asks for the key/value cache (``use_cache``), which generation wants and
    which training had turned off."""
    pretrained: Any = model  # a transformers PreTrainedModel
    pretrained.config.use_cache = True
    out.mkdir(parents=True, exist_ok=True)
    from pipedream.workloads.hf_lm import _transformers

    with _quiet(_transformers()):
        pretrained.save_pretrained(out)
    copied = 0
    if source and Path(source).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, out / name)
                copied += 1
    return copied


def load_transformers(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into ``model``, a ``transformers`` model, and check that it holds every
    tensor as given: a model that ties two tensors the checkpoint holds apart (built from
    another config) would keep one of them silently."""
    if not callable(getattr(model, "save_pretrained", None)):
        raise WorkloadError(
            f"export --hf: the workload's model is a {type(model).__name__}, not a transformers "
            "model; write its state dict with -o model.pt"
        )
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:  # keys or shapes that differ
        reason = str(exc).strip().splitlines()
        raise WorkloadError(
            f"export --hf: the model built for the checkpoint does not fit it "
            f"({' '.join(line.strip() for line in reason[:3]):.200}): it is not the model that "
            "was trained; write its state dict with -o model.pt"
        ) from None
    held = model.state_dict()
    differ = [key for key, value in state.items() if not torch.equal(held[key], value)]
    if differ:
        raise WorkloadError(
            f"export --hf: the model built for the checkpoint does not hold its {differ[0]} as "
            "trained (it ties tensors the checkpoint holds apart): it is not the model that "
            "was trained"
        )


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """``transformers`` without its progress bars (loading, writing shards) and its load
    report: every rank loads the model, and what matters is said once, in one line."""
    shown = transformers.utils.logging.is_progress_bar_enabled()
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
        if shown:
            transformers.utils.logging.enable_progress_bar()
