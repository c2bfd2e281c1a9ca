"""The small ``gpt`` model whose output head reuses its token embedding, for the tied tests."""

from __future__ import annotations

__all__ = ["ARGS", "LAYERS", "MICROBATCH"]

ARGS = {
    "layers": "2",
    "dim": "16",
    "heads": "2",
    "seq": "8",
    "vocab": "32",
    "samples": "256",
    "tie": "true",
    "optimizer": "sgd",  # Adam turns float rounding into 1e-4 differences within a few steps
    "lr": "0.5",
    "momentum": "0.5",
}
"""``--workload-arg``s of ``gpt``: the head's weight is ``embed.tok.weight``."""
LAYERS = ["embed", "h0", "h1", "norm", "head"]
"""Its layers."""
MICROBATCH = 4
"""Samples per microbatch."""
