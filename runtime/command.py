"""CLI glue for ``pipedream train``, ``pipedream export`` and ``pipedream evaluate``."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedream.errors import CheckpointError, LaunchError, WorkloadError
from pipedream.outputs import OutputError, check_not_input
from pipedream.runtime.checkpoint import load_full_state_dict, load_manifest
from pipedream.runtime.train_options import train_options
from pipedream.wording import count
from pipedream.workload import Workload

__all__ = ["evaluate", "export", "run"]


def run(args: argparse.Namespace) -> int:
    from pipedream.runtime.train import train

    return train(train_options(args))


def _checkpoint_dir(path: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory}: no such checkpoint directory; pass runs/<run>/checkpoints/step-NNNNNN"
        )
    return directory


def export(args: argparse.Namespace) -> int:
    """``pipedream export CHECKPOINT``: the whole model's state dict (``-o model.pt``), and
    for a ``transformers`` model a directory ``from_pretrained`` loads (``--hf DIR``). Both
    are checked before either is written."""
    directory = _checkpoint_dir(args.checkpoint)
    if args.output is None and args.hf is None:
        raise OutputError(
            "give -o model.pt (the state dict), --hf DIR (a transformers model directory), or both"
        )
    if args.workload_arg and args.hf is None:
        raise OutputError("--workload-arg builds the model --hf writes; give --hf DIR too")
    manifest = load_manifest(directory)
    source = _pretrained_source(manifest)
    if args.hf is not None:
        _check_directory_output(args.hf, "--hf", [str(directory), source], other=args.output)
    state = load_full_state_dict(directory)
    model = None
    if args.hf is not None:
        model = _transformers_model(directory, manifest, state, args.workload_arg)
    if model is not None:
        out = Path(args.hf)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"--hf {args.hf}: cannot create it ({exc.strerror})") from None
    if args.output is not None:
        torch.save(state, args.output)
        print(f"wrote {len(state)} tensors to {args.output}")
    if model is not None:
        _write_transformers(model, Path(args.hf), source)
    return 0


def _pretrained_source(manifest: dict[str, Any]) -> str | None:
    """The directory an ``hf-lm pretrained=DIR`` run started from (None: another run)."""
    options = manifest.get("workload_args")
    source = options.get("pretrained") if isinstance(options, dict) else None
    return str(source) if source else None


def _check_directory_output(
    path: str, option: str, inputs: list[str | None], *, other: str | None
) -> None:
    """Refuse an output directory that is empty, a file or under one, one of ``inputs`` (the
    checkpoint, the directory the model came from) or inside one, or the ``other`` output."""
    if not path:
        raise OutputError(f"{option} '': give a directory such as exported-model")
    target = Path(path)
    for folder in (target, *target.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "exists and" if folder == target else f"{folder}"
                raise OutputError(f"{option} {path}: {where} is not a directory; give a directory")
            break
    check_not_input(path, option, inputs)
    if other is not None and Path(other).resolve() == target.resolve():
        raise OutputError(
            f"-o {other} and {option} {path} are the same path; give the state dict a file "
            "name of its own"
        )


def _transformers_model(
    directory: Path, manifest: dict[str, Any], state: dict[str, torch.Tensor], given: list[str]
) -> nn.Module:
    """The checkpoint's ``transformers`` model with its weights: built from the config its
    manifest records, else (a model class ``transformers`` does not know, a checkpoint written
    before manifests recorded the config) by the workload's factory, as the manifest names it
    and ``given`` (``KEY=VALUE``) changes it."""
    from pipedream.runtime.checkpoint import check_fits
    from pipedream.workload import load_model, parse_workload_args
    from pipedream.workloads.hf_pretrained import (
        check_record_release,
        load_transformers,
        model_from_record,
    )

    record = manifest.get("transformers_config")
    model = None
    if isinstance(record, dict) and not given:
        check_record_release(record)
        with contextlib.suppress(WorkloadError):  # a class of the user's own: its factory
            model = model_from_record(record)
    if model is None:
        name, options = _manifest_options(directory, manifest)
        changed = {**options, **parse_workload_args(given)}
        source = None if given else str(directory / "manifest.yaml")
        size = manifest.get("microbatch_size")
        model = load_model(
            name, changed, microbatch_size=size if isinstance(size, int) else None, source=source
        )
    if callable(getattr(model, "save_pretrained", None)):
        check_fits(model.state_dict(), state, directory, doing="export it")
    load_transformers(model, state)
    return model


def _write_transformers(model: nn.Module, out: Path, source: str | None) -> None:
    """Write ``model`` to ``out`` with the tokenizer's files of ``source``, and say so."""
    from pipedream.workloads.hf_pretrained import save_transformers

    copied = save_transformers(model, out, source=source)
    tokenizer = f" and {count(copied, 'tokenizer file')}" if copied else ""
    print(
        f"wrote a transformers {type(model).__name__}{tokenizer} to {out}: "
        f"AutoModelForCausalLM.from_pretrained({str(out)!r}) loads it"
    )
    if source and not Path(source).is_dir():
        print(
            f"note: {source}, where the run's model came from, is gone: copy its tokenizer's "
            f"files to {out} yourself"
        )


def _manifest_options(directory: Path, manifest: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The workload a checkpoint's manifest names, and its options."""
    name, options = manifest.get("workload"), manifest.get("workload_args")
    if not isinstance(name, str):
        raise CheckpointError(f"{directory}: its manifest names no workload; the file is damaged")
    if not isinstance(options, dict):
        raise CheckpointError(
            f"{directory}: its manifest's workload_args is {options!r:.60}, not a mapping of "
            "options; the file is damaged"
        )
    return name, {str(k): str(v) for k, v in options.items()}


def _manifest_workload(
    directory: Path, manifest: dict[str, Any], workload_args: list[str]
) -> Workload:
    """The workload a checkpoint was trained on, built from its manifest's name and options,
    each ``KEY=VALUE`` of ``workload_args`` replacing one (other data, a file that moved)."""
    from pipedream.workload import load_workload, parse_workload_args

    name, options = _manifest_options(directory, manifest)
    given = parse_workload_args(workload_args)
    return load_workload(
        name,
        {**options, **given},
        microbatch_size=manifest.get("microbatch_size"),
        source=None if given else str(directory / "manifest.yaml"),
    )


def evaluate(args: argparse.Namespace) -> int:
    """``pipedream evaluate CHECKPOINT``: the workload's evaluation of the whole model at a
    checkpoint (what a run's summary gives for its last one), for any checkpoint of a run,
    also while the run goes on: the workload and its options come from the manifest, each
    ``--workload-arg`` replacing one (other held-out data, a file that moved)."""
    from pipedream.runtime.summary import evaluate_checkpoint, finite

    directory = _checkpoint_dir(args.checkpoint)
    wanted = args.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    elif wanted == "cuda" and not torch.cuda.is_available():
        raise LaunchError("--device cuda: this machine has no CUDA GPU; use --device cpu")
    manifest = load_manifest(directory)
    workload = _manifest_workload(directory, manifest, args.workload_arg)
    name = manifest["workload"]
    if workload.evaluate is None:
        raise WorkloadError(
            f"{name}: the workload defines no evaluation (Workload.evaluate); give it one to "
            "evaluate its checkpoints"
        )
    metrics = evaluate_checkpoint(workload, directory, torch.device(wanted))
    if args.json:  # strict JSON, as summary.json: a diverged model's NaN is null
        record = {"checkpoint": str(directory), "step": manifest.get("step"), **metrics}
        print(json.dumps(finite(record), allow_nan=False))
    else:
        said = ", ".join(f"{key} {value:.4f}" for key, value in metrics.items())
        print(f"{directory} (step {manifest.get('step')}, {name}): {said}")
    return 0
