"""Output paths of the commands (``-o``, ``--png``, ``--plot``), checked before any work.

A profile can take minutes and a plan search longer: a path that cannot be written must fail at
once, in one line, not with a traceback after the work (or, as root, by replacing a device such
as ``/dev/null`` with the file). :func:`check_output` refuses an empty path, a directory, an
existing path that is not a regular file, a folder that cannot be created or written, for
images a file type matplotlib does not write, and for the other outputs an image's name (the
trace's JSON written as ``run.png``, where ``--png`` was meant); it creates the missing folders,
as the writers would. :func:`check_not_input` refuses an output that would replace one of the
command's own inputs (``pipedream plan profile.yaml -o profile.yaml``) or write into an input
folder (a checkpoint, a run's traces), and :func:`check_distinct` two outputs of one command
that are the same file (``pipedream profile --plot p.png -o p.yaml`` with ``p.png`` a link to
``p.yaml`` wrote the profile, then the image over it).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from pipedream.errors import PipedreamError

__all__ = ["IMAGE_SUFFIXES", "OutputError", "check_distinct", "check_not_input", "check_output"]

IMAGE_SUFFIXES = (
    ".png",
    ".pdf",
    ".svg",
    ".svgz",
    ".jpg",
    ".jpeg",
    ".tif",
    ".tiff",
    ".webp",
    ".eps",
    ".ps",
    ".pgf",
)
"""The file types matplotlib's default backend writes, chosen by the file's suffix."""


class OutputError(PipedreamError):
    """An output path that cannot be written."""


def check_output(
    path: str, option: str, *, example: str, image: bool = False, image_option: str | None = None
) -> None:
    """Raise :class:`OutputError` unless ``path`` (given as ``option``) can be written as a
    file; create its missing folders. ``example`` is a file name the messages suggest. A file
    that is not an image (``image`` False) must not be named as one: ``trace -o run.png`` wrote
    the trace's JSON under an image's name, where the picture was meant (``image_option``, the
    command's option that draws one, if any)."""
    if not path:
        raise OutputError(f"{option} '': give a file path such as {example}")
    target = Path(path)
    if target.is_dir():
        raise OutputError(
            f"{option} {path}: is a directory; give a file path such as {target / example}"
        )
    if target.exists() and not target.is_file():
        raise OutputError(
            f"{option} {path}: exists and is not a regular file (a device, a pipe or a "
            "socket); give the path of a file to write"
        )
    if image and target.suffix.lower() not in IMAGE_SUFFIXES:
        shown = f"'{target.suffix}'" if target.suffix else "no suffix"
        raise OutputError(
            f"{option} {path}: unsupported image type ({shown}); end the name in .png, .svg or .pdf"
        )
    if not image and target.suffix.lower() in IMAGE_SUFFIXES:
        drawn = f"; the picture is {image_option} {path}" if image_option else ""
        raise OutputError(
            f"{option} {path}: an image's name, but {option} writes a {Path(example).suffix} "
            f"file; give a name such as {example}{drawn}"
        )
    folder = target.parent
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(
            f"{option} {path}: {existing} is a file, not a folder; choose another path"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".check", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise OutputError(
            f"{option} {path}: cannot write in its folder {folder} ({reason}); choose another path"
        ) from None


def check_not_input(path: str, option: str, inputs: Iterable[str | None]) -> None:
    """Raise :class:`OutputError` if ``path`` (given as ``option``) is one of the ``inputs``
    (files, or folders it must not write into; None: an input not given), however written
    (relative, through links)."""
    target = Path(path).resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if target == source:
            raise OutputError(
                f"{option} {path}: is the input {given}, which writing it would replace; "
                "write the output elsewhere"
            )
        if source.is_dir() and source in target.parents:
            raise OutputError(
                f"{option} {path}: is inside the input folder {given}, whose files are the "
                "command's input; write the output elsewhere"
            )


def check_distinct(outputs: Sequence[tuple[str, str]]) -> None:
    """Raise :class:`OutputError` if two of a command's ``outputs`` (``(option, path)`` pairs, in
    the order the command writes them) are the same file, however written (relative, through
    links): the later one would replace the earlier."""
    seen: list[tuple[str, str, Path]] = []
    for option, path in outputs:
        target = Path(path).resolve()
        for earlier_option, earlier_path, earlier in seen:
            if target == earlier or _same_existing_file(target, earlier):
                raise OutputError(
                    f"{option} {path}: is the same file as {earlier_option} {earlier_path}, "
                    "which writing it would replace; give each output its own path"
                )
        seen.append((option, path, target))


def _same_existing_file(one: Path, other: Path) -> bool:
    """Whether two existing paths are one file (hard links)."""
    try:
        return one.is_file() and other.is_file() and one.samefile(other)
    except OSError:
        return False
