"""CLI glue for ``pipedream train``, ``pipedream export`` and ``pipedream evaluate``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipedream.errors import CheckpointError, LaunchError, WorkloadError
from pipedream.runtime.checkpoint import load_full_state_dict, load_manifest
from pipedream.runtime.train_options import train_options

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
    directory = _checkpoint_dir(args.checkpoint)
    state = load_full_state_dict(directory)
    torch.save(state, args.output)
    print(f"wrote {len(state)} tensors to {args.output}")
    return 0


def evaluate(args: argparse.Namespace) -> int:
    """``pipedream evaluate CHECKPOINT``: the workload's evaluation of the whole model at a
    checkpoint (what a run's summary gives for its last one), for any checkpoint of a run,
    also while the run goes on: the workload and its options come from the manifest, each
    ``--workload-arg`` replacing one (other held-out data, a file that moved)."""
    from pipedream.runtime.summary import evaluate_checkpoint, finite
    from pipedream.workload import load_workload, parse_workload_args

    directory = _checkpoint_dir(args.checkpoint)
    wanted = args.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    elif wanted == "cuda" and not torch.cuda.is_available():
        raise LaunchError("--device cuda: this machine has no CUDA GPU; use --device cpu")
    manifest = load_manifest(directory)
    name, options = manifest.get("workload"), manifest.get("workload_args")
    if not isinstance(name, str):
        raise CheckpointError(f"{directory}: its manifest names no workload; the file is damaged")
    if not isinstance(options, dict):
        raise CheckpointError(
            f"{directory}: its manifest's workload_args is {options!r:.60}, not a mapping of "
            "options; the file is damaged"
        )
    given = parse_workload_args(args.workload_arg)
    workload = load_workload(
        name,
        {**{str(k): str(v) for k, v in options.items()}, **given},
        microbatch_size=manifest.get("microbatch_size"),
        source=None if given else str(directory / "manifest.yaml"),
    )
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
