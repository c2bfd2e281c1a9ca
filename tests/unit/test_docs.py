"""The documentation is the repository's own: short README, links that resolve, and no file
that points outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from launching import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md")


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    paths = [REPO / name for name in listed.split("\0") if name]
    return [p for p in paths if p.is_file() and p.suffix not in {".png", ".pt", ".npy"}]


def test_the_docs_are_there() -> None:
    names = {p.name for p in DOCS}
    assert {"README.md", "architecture.md", "cli.md", "formats.md", "schedules.md"} <= names


def test_the_readme_reads_in_minutes() -> None:
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or a heading of the same page
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{doc.name} links to {target}, which does not exist"
        assert REPO in path.parents or path == REPO, f"{doc.name}: {target} is outside"


def test_no_file_points_outside_the_repository() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")  # an unpacked sdist: nothing lists the tracked files
    this = Path(__file__).resolve()
    offenders = []
    for path in _tracked_text_files():
        if path.resolve() == this:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        offenders += [f"{path.relative_to(REPO)}: {m.group()}" for m in OUTSIDE.finditer(text)]
    assert offenders == []


def test_the_plan_format_lists_every_schedule() -> None:
    """docs/formats.md's plan table named six schedules, where plans also have
    ``interleaved-1f1b`` and ``zbv``: the row names the registry's schedules, in its order."""
    from pipedream.schedules import SCHEDULES

    text = (REPO / "docs" / "formats.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| `schedule` | string |")]
    assert len(rows) == 1, rows
    meaning = rows[0].split("|")[4]
    assert re.findall(r"`([^`]+)`", meaning) == list(SCHEDULES)
