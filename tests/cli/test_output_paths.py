"""Output paths (``-o``, ``--png``, ``--plot``) that cannot be written fail at once, in one line
with exit code 2, before any work: not with a traceback after it, and never by replacing a
device such as ``/dev/null`` with the file (pipedream/outputs.py)."""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

import pytest

from pipedream.errors import PipedreamError
from pipedream.formats.yamlio import write_yaml
from pipedream.outputs import check_output

from launching import run_main


@pytest.fixture
def places(tmp_path: Path) -> Path:
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("not a folder\n")
    return tmp_path


# (verb and its inputs, the output option, the path under tmp_path, what the line says); the
# inputs need not exist: the outputs are checked first
CASES = [
    (["plan", "p.yaml", "--workers", "2"], "-o", "adir",
     "-o {d}/adir: is a directory; give a file path such as {d}/adir/plan.yaml"),
    (["plan", "p.yaml", "--workers", "2"], "-o", "afile/plan.yaml",
     "-o {d}/afile/plan.yaml: {d}/afile is a file, not a folder; choose another path"),
    (["profile", "digits", "-o", "x.yaml"], "--plot", "profile.txt",
     "--plot {d}/profile.txt: unsupported image type ('.txt'); end the name in .png, .svg or "
     ".pdf"),
    (["profile", "digits"], "-o", "afile/sub/p.yaml",
     "-o {d}/afile/sub/p.yaml: {d}/afile is a file, not a folder; choose another path"),
    (["simulate", "plan.yaml"], "--png", "timeline",
     "--png {d}/timeline: unsupported image type (no suffix); end the name in .png, .svg or "
     ".pdf"),
    (["trace", "run"], "--png", "adir",
     "--png {d}/adir: is a directory; give a file path such as {d}/adir/timeline.png"),
    (["trace", "run"], "-o", "adir", "-o {d}/adir: is a directory; give a file path such as "
     "{d}/adir/trace.json"),
    (["export", "run/checkpoints/step-000001"], "-o", "afile/m.pt",
     "-o {d}/afile/m.pt: {d}/afile is a file, not a folder; choose another path"),
    # an image's name for a file that is not one (the trace's JSON was written as run.png)
    (["trace", "run"], "-o", "run.png", "-o {d}/run.png: an image's name, but -o writes a "
     ".json file; give a name such as trace.json; the picture is --png {d}/run.png"),
    (["profile", "digits"], "-o", "p.PDF", "-o {d}/p.PDF: an image's name, but -o writes a "
     ".yaml file; give a name such as profile.yaml; the picture is --plot {d}/p.PDF"),
    (["export", "run/checkpoints/step-000001"], "-o", "model.svg", "-o {d}/model.svg: an "
     "image's name, but -o writes a .pt file; give a name such as model.pt"),
]  # fmt: skip


@pytest.mark.parametrize(("command", "option", "where", "message"), CASES)
def test_an_output_that_cannot_be_written_is_one_line(
    places: Path, command: list[str], option: str, where: str, message: str
) -> None:
    result = run_main(*command, option, str(places / where))
    assert result.returncode == 2, result.stderr
    verb = command[0]
    assert result.stderr == f"pipedream {verb}: error: {message.format(d=places)}\n"


def test_an_empty_output_path_is_refused(places: Path) -> None:
    result = run_main("plan", "p.yaml", "--workers", "2", "-o", "")
    assert result.returncode == 2
    assert result.stderr == "pipedream plan: error: -o '': give a file path such as plan.yaml\n"


@pytest.mark.skipif(not Path("/dev/null").is_char_device(), reason="needs /dev/null")
def test_a_device_is_never_replaced(places: Path) -> None:
    """As root, writing the plan by renaming a temporary file over ``/dev/null`` replaced the
    device with a regular file."""
    result = run_main("plan", "p.yaml", "--workers", "2", "-o", "/dev/null")
    assert result.returncode == 2
    assert "-o /dev/null: exists and is not a regular file" in result.stderr
    assert Path("/dev/null").is_char_device()


def test_the_writer_refuses_a_target_that_is_not_a_file(places: Path) -> None:
    fifo = places / "pipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(PipedreamError, match="exists and is not a regular file"):
        write_yaml(fifo, {"a": 1})
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_missing_folders_are_created(places: Path) -> None:
    check_output(str(places / "new" / "sub" / "plan.yaml"), "-o", example="plan.yaml")
    assert (places / "new" / "sub").is_dir()
    assert list((places / "new" / "sub").iterdir()) == []  # the probe is gone


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_that_cannot_be_written(places: Path) -> None:
    with pytest.raises(PipedreamError, match=r"cannot write in its folder /proc \("):
        check_output("/proc/plan.yaml", "-o", example="plan.yaml")


# (verb and its inputs, the output option and path, what the line says); paths under tmp_path
INPUT_CASES = [
    (["plan", "{d}/p.yaml", "--workers", "2"], "-o", "{d}/p.yaml",
     "-o {d}/p.yaml: is the input {d}/p.yaml, which writing it would replace"),
    (["plan", "p.yaml", "--topology", "{d}/t.yaml"], "-o", "{d}/adir/../t.yaml",
     "-o {d}/adir/../t.yaml: is the input {d}/t.yaml, which writing it would replace"),
    (["profile", "--from-pipedream", "{d}/graph.txt"], "-o", "{d}/graph.txt",
     "-o {d}/graph.txt: is the input {d}/graph.txt, which writing it would replace"),
    (["simulate", "{d}/plan.yaml"], "--png", "{d}/plan.yaml",
     "--png {d}/plan.yaml: is the input {d}/plan.yaml, which writing it would replace"),
    (["export", "{d}/run/checkpoints/step-000001"], "-o",
     "{d}/run/checkpoints/step-000001/stage-000.pt",
     "-o {d}/run/checkpoints/step-000001/stage-000.pt: is inside the input folder "
     "{d}/run/checkpoints/step-000001, whose files are the command's input"),
    (["trace", "{d}/run"], "-o", "{d}/run/traces/rank-000.json",
     "-o {d}/run/traces/rank-000.json: is inside the input folder {d}/run/traces"),
    (["trace", "{d}/run", "--plan", "{d}/plan.yaml"], "--png", "{d}/plan.yaml",
     "--png {d}/plan.yaml: is the input {d}/plan.yaml"),
]  # fmt: skip


@pytest.mark.parametrize(("command", "option", "where", "message"), INPUT_CASES)
def test_an_output_never_replaces_an_input(
    places: Path, command: list[str], option: str, where: str, message: str
) -> None:
    """``plan p.yaml -o p.yaml`` replaced the profile with the plan; ``export -o`` into the
    checkpoint replaced a stage file, ``trace -o`` a rank's trace."""
    (places / "run" / "checkpoints" / "step-000001").mkdir(parents=True)
    (places / "run" / "traces").mkdir()
    for name in ("p.yaml", "t.yaml", "graph.txt", "plan.yaml"):
        (places / name).write_text("the input\n")
    result = run_main(*(part.format(d=places) for part in command), option, where.format(d=places))
    assert result.returncode == 2, result.stderr
    line = result.stderr.splitlines()
    assert len(line) == 1 and line[0].startswith(f"pipedream {command[0]}: error: "), line
    assert message.format(d=places) in line[0]
    assert line[0].endswith("write the output elsewhere")
    assert all((places / n).read_text() == "the input\n" for n in ("p.yaml", "t.yaml", "plan.yaml"))
    assert not (places / "run" / "traces" / "rank-000.json").exists()


# (the command, its outputs under tmp_path, what the line says): two names of one file, through
# a link (the same name twice is refused already: an output is an image or names none)
SAME_FILE_CASES = [
    (["profile", "digits", "-o", "{d}/same.yaml", "--plot", "{d}/link.png"],
     "--plot {d}/link.png: is the same file as -o {d}/same.yaml"),
    (["profile", "digits", "-o", "{d}/adir/../link.png.yaml", "--plot", "{d}/link.png"],
     "--plot {d}/link.png: is the same file as -o {d}/adir/../link.png.yaml"),
    (["trace", "{d}/run", "-o", "{d}/same.yaml", "--png", "{d}/link.png"],
     "--png {d}/link.png: is the same file as -o {d}/same.yaml"),
]  # fmt: skip


@pytest.mark.parametrize(("command", "message"), SAME_FILE_CASES)
def test_two_outputs_are_never_one_file(places: Path, command: list[str], message: str) -> None:
    """``profile --plot same.png -o same.png`` profiled, wrote the profile, then replaced it with
    the image, and exited 0; now it stops before profiling, whatever the names."""
    (places / "link.png").symlink_to(places / "same.yaml")
    (places / "link.png.yaml").symlink_to(places / "same.yaml")
    result = run_main(*(part.format(d=places) for part in command))
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"pipedream {command[0]}: error: {message.format(d=places)}, which writing it would "
        "replace; give each output its own path\n"
    )
    assert result.stdout == ""  # nothing measured
    assert not (places / "same.yaml").exists()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_an_output_is_never_the_file_another_writes_by_default(places: Path) -> None:
    """``trace RUN -o RUN/timeline.png`` wrote the Perfetto trace, then the Gantt chart over it
    (``--png``'s default); ``-o RUN/trace`` linked to it does not write it either."""
    run = places / "run"
    run.mkdir()
    result = run_main("trace", str(run), "-o", str(run / "timeline.png"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"pipedream trace: error: -o {run}/timeline.png: an image's")
    (run / "trace").symlink_to(run / "timeline.png")
    result = run_main("trace", str(run), "-o", str(run / "trace"))
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"pipedream trace: error: --png (default) {run}/timeline.png: is the same file as -o "
        f"{run}/trace, which writing it would replace; give each output its own path\n"
    )
