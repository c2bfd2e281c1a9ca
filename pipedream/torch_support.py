"""The PyTorch releases pipedream runs on, checked before a command that needs torch starts.

pip enforces the floor of ``pyproject.toml`` when it installs pipedream's dependencies; an
install that skips them (``pip install --no-deps`` into a Python that already has torch, as on a
machine without internet) does not, so ``pipedream profile``, ``train`` and ``export`` and
``launch.sh`` check the release themselves and name the fix in one line.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

from pipedream.errors import PipedreamError

__all__ = [
    "MIN_TORCH",
    "UnsupportedTorch",
    "check_installed_torch",
    "check_torch_release",
    "main",
    "release_numbers",
]

MIN_TORCH = (2, 8)
"""The oldest release (major, minor) pipedream supports. Before 2.8, destroying a gloo process
group held Python's GIL while waiting for its worker threads, and a worker that had just
finished a collective could need the GIL to free its tensors: a rank hung at the end of a run
(this project's multi-process tests hung so with 2.4 and 2.6). PyTorch 2.8 releases the GIL
there. (Older releases also miss other things pipedream uses: Hugging Face transformers 5 needs
torch 2.6, and with 2.4 the traced resnet's BatchNorm layers train differently.)"""


class UnsupportedTorch(PipedreamError):
    """The installed PyTorch is older than :data:`MIN_TORCH`."""


def check_torch_release(version: str) -> None:
    """Refuse a ``torch.__version__`` older than :data:`MIN_TORCH` (``"2.6.0+cu124"``, say).

    A version string that does not start with ``MAJOR.MINOR`` (a custom build) is let through:
    the check is there to explain a known failure, not to gate unknown builds."""
    numbers = release_numbers(version)
    if numbers is None:
        return
    if numbers[:2] < MIN_TORCH:
        floor = ".".join(str(part) for part in MIN_TORCH)
        raise UnsupportedTorch(
            f"pipedream needs torch >= {floor}, and this Python has torch {version}: older "
            f"releases can hang a run's ranks at its end (gloo); install a newer one, e.g. "
            f"pip install 'torch>={floor}'"
        )


def release_numbers(version: str) -> tuple[int, int, int] | None:
    """The release a version string starts with (``"2.9.1+cu128"``: (2, 9, 1); ``"5.1.0.dev0"``:
    (5, 1, 0); ``"4.57"``: (4, 57, 0)); None where it does not start with ``MAJOR.MINOR``."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        return None
    major, minor, patch = (int(part or 0) for part in found.groups())
    return major, minor, patch


def check_installed_torch() -> None:
    """:func:`check_torch_release` of the torch this Python has, read from its installed
    metadata (without importing torch, which takes seconds), else from ``torch.__version__``
    (a build from source without metadata)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch

        version = torch.__version__
    check_torch_release(version)


def main() -> int:
    """``python -m pipedream.torch_support``: exit status 2 and one line where torch is too old
    (``scripts/gpu_check.sh`` runs it first)."""
    try:
        check_installed_torch()
    except UnsupportedTorch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
