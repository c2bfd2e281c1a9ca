"""CLI glue for ``pipedream train`` and ``pipedream export``."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pipedream.errors import CheckpointError
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.runtime.train_options import TrainOptions

__all__ = ["export", "run", "train_options"]


def run(args: argparse.Namespace) -> int:
    from pipedream.runtime.train import train

    return train(train_options(args))


def train_options(args: argparse.Namespace) -> TrainOptions:
    """The options of ``pipedream train`` as its command line gave them."""
    return TrainOptions(
        plan_path=args.plan,
        steps=args.steps,
        run_dir=args.run_dir,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        keep=args.keep,
        on_nonfinite=args.on_nonfinite,
        trace=args.trace,
        precision=args.precision,
        recompute=args.recompute,
        device=args.device,
        deterministic=args.deterministic,
        timeout=args.timeout,
        progress=not args.no_progress,
    )


def export(args: argparse.Namespace) -> int:
    directory = Path(args.checkpoint)
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory}: no such checkpoint directory; pass runs/<run>/checkpoints/step-NNNNNN"
        )
    state = load_full_state_dict(directory)
    torch.save(state, args.output)
    print(f"wrote {len(state)} tensors to {args.output}")
    return 0
