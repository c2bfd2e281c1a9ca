"""CLI glue for ``pipedream train`` and ``pipedream export``."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pipedream.errors import CheckpointError
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.runtime.train_options import train_options

__all__ = ["export", "run"]


def run(args: argparse.Namespace) -> int:
    from pipedream.runtime.train import train

    return train(train_options(args))


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
