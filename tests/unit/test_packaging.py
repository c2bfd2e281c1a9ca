"""Guards for the one-namespace layout (docs/architecture.md, "Packages").

``profiler/``, ``optimizer/`` and ``runtime/`` are top-level folders installed as
``pipedream.profiler`` etc. through ``[tool.setuptools.package-dir]``. The known traps of that
mapping each have a check here: an unlisted sub-package (missing from a wheel), a generic
top-level import name (``import runtime``), setuptools' ``compat`` editable mode, and an
``__init__.py`` in ``tests/`` (which makes pytest import test folders as packages).
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launching import REPO

# tomllib is stdlib from Python 3.11; the project supports 3.10 too
tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

SOURCE_ROOTS = ("pipedream", "profiler", "optimizer", "runtime")
GENERIC_NAMES = ("runtime", "optimizer", "profiler")
SKIP_DIRS = {
    ".venv",
    ".venv-oldest",
    ".git",
    "build",
    "dist",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
}


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    with (REPO / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)


def _package_dirs(pyproject: dict[str, Any]) -> dict[str, str]:
    """Package name -> folder, as setuptools resolves it with the package-dir mapping."""
    mapping: dict[str, str] = pyproject["tool"]["setuptools"]["package-dir"]
    out = {}
    for package in pyproject["tool"]["setuptools"]["packages"]:
        parts = package.split(".")
        # the longest mapped prefix wins, as in setuptools
        for cut in range(len(parts), 0, -1):
            prefix = ".".join(parts[:cut])
            if prefix in mapping:
                out[package] = "/".join([mapping[prefix], *parts[cut:]])
                break
        else:
            out[package] = "/".join(parts)
    return out


def _folder_to_package(folder: str, mapping: dict[str, str]) -> str:
    top, _, rest = folder.partition("/")
    reverse = {path: package for package, path in mapping.items()}
    base = reverse.get(top, top)
    return ".".join([base, *rest.split("/")]) if rest else base


def test_package_dir_maps_the_three_folders(pyproject: dict[str, Any]) -> None:
    assert pyproject["tool"]["setuptools"]["package-dir"] == {
        "pipedream.profiler": "profiler",
        "pipedream.optimizer": "optimizer",
        "pipedream.runtime": "runtime",
    }


def test_every_package_folder_is_listed_and_every_listed_package_exists(
    pyproject: dict[str, Any],
) -> None:
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    folders = sorted(
        init.parent.relative_to(REPO).as_posix()
        for root in SOURCE_ROOTS
        for init in (REPO / root).rglob("__init__.py")
        if not SKIP_DIRS & set(init.relative_to(REPO).parts)
    )
    on_disk = {_folder_to_package(folder, mapping) for folder in folders}
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - on_disk == set(), "these listed packages have no folder with __init__.py"
    for package, folder in _package_dirs(pyproject).items():
        assert (REPO / folder / "__init__.py").is_file(), (package, folder)


def test_installed_packages_resolve_to_the_repo_folders() -> None:
    """The editable install maps pipedream.runtime to ./runtime (not a stale copy)."""
    code = (
        "import pipedream, pipedream.runtime, pipedream.optimizer, pipedream.profiler\n"
        "for m in (pipedream, pipedream.runtime, pipedream.optimizer, pipedream.profiler):\n"
        "    print(m.__file__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    files = [Path(line) for line in out.stdout.splitlines()]
    assert files == [
        REPO / "pipedream" / "__init__.py",
        REPO / "runtime" / "__init__.py",
        REPO / "optimizer" / "__init__.py",
        REPO / "profiler" / "__init__.py",
    ]


def test_generic_names_never_enter_sys_modules() -> None:
    code = (
        "import importlib.util, sys\n"
        "import pipedream, pipedream.cli, pipedream.runtime, pipedream.optimizer, "
        "pipedream.profiler\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {GENERIC_NAMES!r})\n"
        "print(','.join(bad) or 'none')\n"
        # not even importable: a compat-mode editable install puts the repo on sys.path
        f"print([n for n in {GENERIC_NAMES!r} if importlib.util.find_spec(n)] or 'none')\n"
    )
    # run from / so that the repo folders are not importable through the current directory
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["none", "none"]


_GENERIC_IMPORT = re.compile(
    r"^\s*(?:import|from)\s+(?:" + "|".join(GENERIC_NAMES) + r")(?:[\s.,;]|$)", re.MULTILINE
)


def test_import_pattern_catches_generic_imports() -> None:
    caught = ["import runtime", "from optimizer.planner import x", "    import profiler.measure"]
    allowed = ["from pipedream.runtime import x", "import runtimes", "x = 'import runtime'"]
    assert all(_GENERIC_IMPORT.search(line) for line in caught)
    assert not any(_GENERIC_IMPORT.search(line) for line in allowed)


def test_no_generic_imports_in_the_repo() -> None:
    offenders = []
    for path in sorted(REPO.rglob("*.py")):
        relative = path.relative_to(REPO)
        if SKIP_DIRS & set(relative.parts) or relative.parts[0].endswith(".egg-info"):
            continue
        for match in _GENERIC_IMPORT.finditer(path.read_text(encoding="utf-8")):
            offenders.append(f"{relative}: {match.group(0).strip()}")
    assert offenders == []


def test_ruff_bans_generic_imports(pyproject: dict[str, Any]) -> None:
    lint = pyproject["tool"]["ruff"]["lint"]
    assert "TID251" in lint["select"]
    banned = lint["flake8-tidy-imports"]["banned-api"]
    assert set(banned) == set(GENERIC_NAMES)
    for name in GENERIC_NAMES:
        assert f"pipedream.{name}" in banned[name]["msg"]


def test_tests_folder_has_no_init_py() -> None:
    assert sorted((REPO / "tests").rglob("__init__.py")) == []


_COMPAT = re.compile(r"editable[_-]mode\W*compat|compat\W*editable", re.IGNORECASE)


def test_no_compat_editable_mode() -> None:
    candidates = [REPO / "README.md", REPO / "pyproject.toml", REPO / "demo.sh"]
    ci = REPO / ".ci"
    if ci.is_dir():
        candidates += sorted(p for p in ci.rglob("*") if p.is_file())
    checked = [p for p in candidates if p.is_file()]
    assert REPO / "pyproject.toml" in checked
    for path in checked:
        text = path.read_text(encoding="utf-8")
        assert not _COMPAT.search(text), f"{path}: never use setuptools' compat editable mode"
    assert _COMPAT.search("pip install -e . --config-settings editable_mode=compat")


def test_console_script_is_cli_main(pyproject: dict[str, Any]) -> None:
    assert pyproject["project"]["scripts"] == {"pipedream": "pipedream.cli:main"}
    scripts = importlib.metadata.entry_points(group="console_scripts", name="pipedream")
    assert [entry.value for entry in scripts] == ["pipedream.cli:main"]
    from pipedream.cli import main

    assert next(iter(scripts)).load() is main


def test_ci_runs_the_readme_test_command() -> None:
    """``.ci/run`` runs the README's test command (pip's ``-q`` aside), so CI proves that a
    newcomer's commands work."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Set up and run the tests", 1)[1]
    command = section.split("```bash\n", 1)[1].split("\n", 1)[0]
    assert " -m pytest" in command, command
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    lines = [line.replace(" -q ", " ") for line in ci.splitlines()]
    assert command in lines


def test_the_oldest_deps_script_pins_the_floors(pyproject: dict[str, Any]) -> None:
    """scripts/oldest_deps.sh tests the oldest releases pyproject.toml admits: each dependency
    (and the hf extra's) pinned to a release of its floor, and nothing else pinned there."""
    project = pyproject["project"]
    floors = {}
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["hf"]]:
        name, floor = re.fullmatch(r"([A-Za-z0-9_-]+)>=([0-9.]+)(,<\d+)?", requirement).group(1, 2)
        floors[name.lower()] = floor
    # transformers 4 needs torch 2.9: next to torch's floor, the oldest is the first 5.x
    assert floors["torch"] == "2.8" and floors["transformers"].startswith("4.")
    floors["transformers"] = "5.0"
    script = (REPO / "scripts" / "oldest_deps.sh").read_text(encoding="utf-8")
    pins = dict(re.findall(r"^\s+([A-Za-z0-9_-]+)==([0-9.]+)", script, flags=re.MULTILINE))
    assert set(pins) == set(floors)
    for name, floor in floors.items():
        assert pins[name] == floor or pins[name].startswith(floor + "."), (name, pins[name], floor)


def test_the_transformers_floor_of_the_code_is_the_extras(pyproject: dict[str, Any]) -> None:
    """hf-lm refuses a transformers older than the hf extra's floor, not another."""
    from pipedream.workloads.hf_lm import MIN_TRANSFORMERS

    (requirement,) = pyproject["project"]["optional-dependencies"]["hf"]
    floor = re.fullmatch(r"transformers>=([0-9.]+),<\d+", requirement).group(1)
    assert ".".join(map(str, MIN_TRANSFORMERS)) == floor
