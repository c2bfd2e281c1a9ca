"""Reading and atomically writing the YAML files of the formats."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pipedream.errors import FormatError
from pipedream.outputs import OutputError

__all__ = ["atomic_write_text", "new_file_mode", "read_yaml_mapping", "write_yaml"]


def read_yaml_mapping(path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    """Load ``path`` with ``yaml.safe_load`` and check that it holds a mapping.

    ``what`` names the kind of file ("profile", "plan", ...) for the error messages.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FormatError(source, "", f"{what} file not found", "check the path") from None
    except IsADirectoryError:
        raise FormatError(source, "", "is a directory", f"pass a {what} YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FormatError(
            source,
            "",
            f"cannot read {what} file ({exc})",
            "check its permissions and that it is UTF-8 text",
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise FormatError(
            source, "", f"not valid YAML{where}", f"fix the syntax of this {what} file"
        ) from None
    except ValueError as exc:  # an integer of over 4300 digits, a date such as 2026-13-45
        reason = str(exc).split(";")[0]
        raise FormatError(
            source, "", f"holds a value YAML cannot read: {reason}", "correct or remove it"
        ) from None
    if data is None:
        raise FormatError(source, "", f"the {what} file is empty", f"is this a {what} file?")
    if not isinstance(data, dict):
        raise FormatError(
            source,
            "",
            f"expected a YAML mapping at the top level, got {type(data).__name__}",
            f"is this a {what} file?",
        )
    return data


def new_file_mode() -> int:
    """The permissions a file opened for writing gets (``0o666`` less the umask): what a file
    written in place would have; a temporary file of ``tempfile.mkstemp`` has ``0o600``, which
    a rename would otherwise keep (a plan or checkpoint only its writer could read)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder, fsync, rename."""
    target = Path(path)
    if target.exists() and not target.is_file():  # renaming over it would replace a device
        raise OutputError(f"{target}: exists and is not a regular file; write to a file path")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.fchmod(fd, new_file_mode())
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_yaml(path: str | os.PathLike[str], data: dict[str, Any], *, header: str = "") -> None:
    """Dump ``data`` as block-style YAML (keys in insertion order) and write it atomically."""
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    atomic_write_text(path, comment + body)
