"""CLI glue for ``pipedream train``, ``pipedream export`` and ``pipedream evaluate``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipedream.errors import CheckpointError, LaunchError, WorkloadError
from pipedream.outputs import OutputError, check_not_input
from pipedream.runtime.checkpoint import load_full_state_dict, load_manifest
from pipedream.runtime.train_options import train_options
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
    for a ``transformers`` model a directory ``from_pretrained`` loads (``--hf DIR``)."""
    directory = _checkpoint_dir(args.checkpoint)
    if args.output is None and args.hf is None:
        raise OutputError(
            "give -o model.pt (the state dict), --hf DIR (a transformers model directory), or both"
        )
    if args.hf is not None:
        _check_directory_output(args.hf, "--hf", directory)
    state = load_full_state_dict(directory)
    if args.output is not None:
        torch.save(state, args.output)
        print(f"wrote {len(state)} tensors to {args.output}")
    if args.hf is not None:
        _export_transformers(directory, state, Path(args.hf), args.workload_arg)
    return 0


def _check_directory_output(path: str, option: str, checkpoint: Path) -> None:
    """Refuse an output directory that is empty, a file, or the checkpoint (or inside it)."""
    if not path:
        raise OutputError(f"{option} '': give a directory such as exported-model")
    if Path(path).exists() and not Path(path).is_dir():
        raise OutputError(f"{option} {path}: exists and is not a directory; give a directory")
    check_not_input(path, option, [str(checkpoint)])


def _export_transformers(
    directory: Path, state: dict[str, torch.Tensor], out: Path, workload_args: list[str]
) -> None:
    """Write the checkpoint's model as ``save_pretrained`` does, with the tokenizer's files of
    the directory an ``hf-lm pretrained=`` run started from."""
    from pipedream.runtime.checkpoint import check_fits
    from pipedream.workloads.hf_pretrained import save_transformers

    workload, options = _manifest_workload(directory, workload_args)
    model = workload.model
    check_fits(model.state_dict(), state, directory, doing="export it")
    copied = save_transformers(model, state, out, source=options.get("pretrained"))
    tokenizer = f" and {copied} tokenizer file{'s' if copied > 1 else ''}" if copied else ""
    print(
        f"wrote a transformers {type(model).__name__}{tokenizer} to {out}: "
        f"AutoModelForCausalLM.from_pretrained({str(out)!r}) loads it"
    )


def _manifest_workload(
    directory: Path, workload_args: list[str]
) -> tuple[Workload, dict[str, str]]:
    """The workload a checkpoint was trained on, built from its manifest's name and options,
    each ``KEY=VALUE`` of ``workload_args`` replacing one (other data, a file that moved); and
    the options it was built with."""
    from pipedream.workload import load_workload, parse_workload_args

    manifest = load_manifest(directory)
    name, options = manifest.get("workload"), manifest.get("workload_args")
    if not isinstance(name, str):
        raise CheckpointError(f"{directory}: its manifest names no workload; the file is damaged")
    if not isinstance(options, dict):
        raise CheckpointError(
            f"{directory}: its manifest's workload_args is {options!r:.60}, not a mapping of "
            "options; the file is damaged"
        )
    given = parse_workload_args(workload_args)
    built = {**{str(k): str(v) for k, v in options.items()}, **given}
    workload = load_workload(
        name,
        built,
        microbatch_size=manifest.get("microbatch_size"),
        source=None if given else str(directory / "manifest.yaml"),
    )
    return workload, built


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
    workload, _ = _manifest_workload(directory, args.workload_arg)
    manifest = load_manifest(directory)
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
