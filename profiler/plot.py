"""``pipedream profile --plot``: per-layer compute time, output bytes and parameter bytes."""

from __future__ import annotations

from pathlib import Path

from pipedream.errors import PipedreamError
from pipedream.formats.profile import Profile

__all__ = ["plot_profile"]


def plot_profile(profile: Profile, path: str | Path) -> None:
    """Three stacked bar charts over the layers, written as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PipedreamError(
            "--plot needs matplotlib; install it with pip install 'pipedream[plot]'"
        ) from None
    names = profile.layer_names
    x = range(len(names))
    fig, axes = plt.subplots(3, 1, figsize=(max(6.0, 0.35 * len(names)), 7), sharex=True)
    forward = [layer.forward_ms for layer in profile.layers]
    backward = [layer.backward_ms for layer in profile.layers]
    axes[0].bar(x, forward, label="forward", color="#4c72b0")
    axes[0].bar(x, backward, bottom=forward, label="backward", color="#dd8452")
    axes[0].set_ylabel("ms")
    axes[0].legend(loc="upper right")
    axes[0].set_title(
        f"{profile.workload}: microbatch {profile.microbatch_size} on {profile.device}"
    )
    axes[1].bar(x, [layer.output_bytes / 2**20 for layer in profile.layers], color="#55a868")
    axes[1].set_ylabel("output MiB")
    axes[2].bar(x, [layer.parameter_bytes / 2**20 for layer in profile.layers], color="#8172b3")
    axes[2].set_ylabel("parameters MiB")
    axes[2].set_xticks(list(x))
    axes[2].set_xticklabels(names, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
