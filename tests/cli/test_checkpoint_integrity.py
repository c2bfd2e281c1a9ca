"""Checkpoint integrity: truncated, bit-flipped or missing files are detected and skipped; a file
that would run code when unpickled is refused; resume skips a broken newest checkpoint; a run
neither starts before a later checkpoint in its directory nor restarts from an older one."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from pipedream.errors import CheckpointError
from pipedream.runtime import launch_check
from pipedream.runtime.checkpoint import (
    find_latest_checkpoint,
    load_full_state_dict,
    load_manifest,
    step_directories,
)
from pipedream.runtime.checkpoint_protocol import prune_checkpoints, restart_point

from launching import run_main, straight_plan, write_plan


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A single-process run (world_size 1, no torchrun needed; in this process) with
    checkpoints at 2 and 4."""
    tmp = tmp_path_factory.mktemp("ckpt")
    plan = write_plan(
        straight_plan("mlp", [[str(i) for i in range(9)]], workload_args={"layers": "8"}),
        tmp / "plan.yaml",
    )
    result = run_main(
        "train",
        str(plan),
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--run-dir",
        str(tmp / "run"),
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    return tmp / "run"


@pytest.fixture
def checkpoints(run: Path, tmp_path: Path) -> Path:
    """A private copy of the run's checkpoints to damage."""
    copy = tmp_path / "checkpoints"
    shutil.copytree(run / "checkpoints", copy)
    return copy


def _stage_file(step_dir: Path) -> Path:
    return step_dir / load_manifest(step_dir)["stages"][0]["file"]


def test_intact_checkpoints_load(checkpoints: Path) -> None:
    assert find_latest_checkpoint(checkpoints) == checkpoints / "step-000004"
    assert len(load_full_state_dict(checkpoints / "step-000004")) == 18


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip", "delete", "no-manifest", "bad-manifest", "odd-manifest", "not-utf8"],
)
def test_damaged_newest_checkpoint_is_skipped(
    checkpoints: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    newest = checkpoints / "step-000004"
    stage_file = _stage_file(newest)
    if damage == "truncate":
        stage_file.write_bytes(stage_file.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(stage_file.read_bytes())
        data[len(data) // 2] ^= 0x01
        stage_file.write_bytes(bytes(data))
    elif damage == "delete":
        stage_file.unlink()
    elif damage == "no-manifest":
        (newest / "manifest.yaml").unlink()
    elif damage == "bad-manifest":
        (newest / "manifest.yaml").write_text("format: [unclosed\n")
    elif damage == "not-utf8":  # a torn write, a disk error: the manifest's bytes are not text
        (newest / "manifest.yaml").write_bytes(b"format: \xff\xfe pipedream\n")
    else:
        manifest = yaml.safe_load((newest / "manifest.yaml").read_text())
        manifest["stages"] = [{"file": "../../etc/passwd", "sha256": 1}]
        (newest / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    with pytest.raises(CheckpointError):
        load_full_state_dict(newest)
    assert find_latest_checkpoint(checkpoints) == checkpoints / "step-000002"
    assert "skipping checkpoint" in capsys.readouterr().err
    if damage == "not-utf8":  # `pipedream export` says so in one line (exit 2)
        from pipedream.cli import main

        assert main(["export", str(newest), "-o", str(checkpoints / "model.pt")]) == 2
        err = capsys.readouterr().err
        assert "manifest.yaml: not valid UTF-8; the checkpoint is corrupt" in err
        assert len(err.strip().splitlines()) == 1


class _RunsCode:
    def __reduce__(self):  # what a malicious checkpoint would do on torch.load(weights_only=False)
        return (Path.touch, (Path(__file__).parent / "PWNED",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickled_code_is_refused(checkpoints: Path, tmp_path: Path) -> None:
    newest = checkpoints / "step-000004"
    marker = Path(__file__).parent / "PWNED"
    marker.unlink(missing_ok=True)
    stage_file = _stage_file(newest)
    stage_file.write_bytes(pickle.dumps({"model": _RunsCode()}))
    # the attacker also fixes the checksum in the manifest, so only weights_only stops it
    import hashlib

    manifest = yaml.safe_load((newest / "manifest.yaml").read_text())
    manifest["stages"][0]["sha256"] = hashlib.sha256(stage_file.read_bytes()).hexdigest()
    (newest / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    with pytest.raises(CheckpointError, match="refused to load"):
        load_full_state_dict(newest)
    assert not marker.exists()
    result = run_main("export", str(newest), "-o", str(tmp_path / "model.pt"))
    assert result.returncode == 2 and "refused to load" in result.stderr
    assert not marker.exists()


def test_resume_auto_skips_a_corrupt_newest_checkpoint(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    stage_file = _stage_file(copy / "checkpoints" / "step-000004")
    stage_file.write_bytes(b"garbage")
    plan = write_plan(
        straight_plan("mlp", [[str(i) for i in range(9)]], workload_args={"layers": "8"}),
        tmp_path / "plan.yaml",
    )
    result = run_main(
        "train",
        str(plan),
        "--steps",
        "6",
        "--checkpoint-every",
        "2",
        "--run-dir",
        str(copy),
        "--resume",
        "auto",
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    assert "skipping checkpoint" in result.stderr and "step-000004" in result.stderr
    # it resumed from step 2 and rewrote steps 4 and 6
    assert find_latest_checkpoint(copy / "checkpoints") == copy / "checkpoints" / "step-000006"
    assert len(load_full_state_dict(copy / "checkpoints" / "step-000004")) == 18


def test_steps_past_a_million_order_by_number(checkpoints: Path) -> None:
    """``step-1000000`` sorts before ``step-999999`` by name; the newest is the larger step."""
    shutil.move(checkpoints / "step-000002", checkpoints / "step-999999")
    shutil.move(checkpoints / "step-000004", checkpoints / "step-1000000")
    (checkpoints / "step-notanumber").mkdir()
    assert step_directories(checkpoints) == [
        checkpoints / "step-999999",
        checkpoints / "step-1000000",
    ]
    assert find_latest_checkpoint(checkpoints) == checkpoints / "step-1000000"
    assert prune_checkpoints(checkpoints, keep=1) == [checkpoints / "step-999999"]
    assert (checkpoints / "step-1000000" / "manifest.yaml").is_file()


PLAN_ARGS = {"layers": "8"}


def _launch_check(tmp_path: Path, *options: str, replicas: int = 1) -> int:
    """``launch.sh``'s check (in this process) for the run's plan with ``replicas`` of its one
    stage: its exit code."""
    data = straight_plan(
        "mlp", [[str(i) for i in range(9)]], workload_args=PLAN_ARGS, replicas=[replicas]
    )
    plan = write_plan(data, tmp_path / f"plan-{replicas}.yaml")
    return launch_check.main([str(plan), "--", *options])


def test_a_run_does_not_start_before_a_later_checkpoint_in_its_directory(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checkpoints of steps after where a run starts belong to a run that went further:
    --keep pruned the new run's own checkpoints before them (it kept the highest steps), and
    --resume auto would continue that other run. Found by a review: --resume step-2 --keep 1
    left only the old step-4."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for options, start in [
        ((), 0),  # a fresh run
        (("--resume", str(copy / "checkpoints" / "step-000002")), 2),
    ]:
        code = _launch_check(tmp_path, "--steps", "6", "--run-dir", str(copy), *options)
        assert (code, capsys.readouterr().err) == (
            2,
            f"launch.sh: error: {copy} holds a checkpoint after step {start}, where this run "
            "starts: step-000004, of a run that went further; continue that one with --resume "
            "auto, or train in another --run-dir\n",
        )
    assert _launch_check(tmp_path, "--steps", "6", "--run-dir", str(copy), "--resume", "auto") == 0


def test_the_steps_are_checked_from_where_a_run_resumes(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four replicas need segments of 4: 8 minibatches checkpointed every 4 are, from step 0;
    from step 2 the first is 2 long. Every rank used to find that out, after launch.sh. The
    error said to use multiples of 4, which 8 and 4 are: from step 2 none fits, and it says
    how to go on."""
    step2 = str(run / "checkpoints" / "step-000002")
    options = ("--steps", "8", "--checkpoint-every", "4", "--run-dir", str(tmp_path / "new"))
    assert _launch_check(tmp_path, *options, replicas=4) == 0
    capsys.readouterr()
    assert _launch_check(tmp_path, *options, "--resume", step2, replicas=4) == 2
    assert capsys.readouterr().err == (
        "launch.sh: error: stage 0 has 4 replicas, so every stretch between checkpoints must "
        "be a multiple of 4; the run resumes at step 2, not a multiple of 4 (a checkpoint of "
        "another plan), so checkpoints at multiples of --checkpoint-every do not fit: train "
        "without --checkpoint-every to a step 4 x k after 2 (e.g. --steps 6), then resume from "
        "there\n"
    )


def test_a_restarted_run_continues_from_its_newest_checkpoint(run: Path, tmp_path: Path) -> None:
    """torchrun restarts the workers with their first command line: one that resumed from a
    checkpoint continued from that one again (or failed, where --keep had deleted it)."""
    began = str(run / "checkpoints" / "step-000002")
    assert restart_point(None, str(run)) == restart_point("auto", str(run)) == "auto"
    assert restart_point(began, str(run)) == "auto"  # step 4 was written since
    assert restart_point(began, str(tmp_path / "empty")) == began  # none yet
    assert restart_point(str(tmp_path / "pruned"), str(run)) == "auto"


def test_a_resumed_run_keeps_the_seed_of_its_checkpoint(tmp_path: Path) -> None:
    """Without --seed a resumed run used seed 0, another data order than a run with --seed 5
    it continued; the manifest now records the seed, and it is the resumed run's default."""
    plan = write_plan(
        straight_plan("mlp", [[str(i) for i in range(9)]], workload_args=PLAN_ARGS),
        tmp_path / "plan.yaml",
    )

    def train(run: str, steps: int, *options: str) -> Path:
        result = run_main(
            "train", str(plan), "--steps", str(steps), "--checkpoint-every", "2",
            "--run-dir", str(tmp_path / run), "--no-progress", *options,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return tmp_path / run / "checkpoints" / f"step-{steps:06d}"

    whole = train("whole", 4, "--seed", "5")
    assert load_manifest(whole)["seed"] == 5
    train("halves", 2, "--seed", "5")
    resumed = train("halves", 4, "--resume", "auto")
    want, got = load_full_state_dict(whole), load_full_state_dict(resumed)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_resumed_run_counts_its_progress_and_summary_from_the_checkpoint(
    run: Path, tmp_path: Path
) -> None:
    """It printed "step 1/6", "step 2/6", "done: 6 minibatches" and wrote minibatches 6 for the
    2 minibatches it ran after the checkpoint at step 4."""
    import json

    resumed = tmp_path / "run"
    shutil.copytree(run, resumed)
    plan = run.parent / "plan.yaml"
    result = run_main(
        "train", str(plan), "--steps", "6", "--resume", "auto", "--run-dir", str(resumed),
        "--no-progress",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "2 minibatches 4..5 (resumed at step 4) of 1 x " in result.stderr
    assert "done: 2 minibatches (4..5, resumed) in " in result.stderr
    summary = json.loads((resumed / "summary.json").read_text())
    assert (summary["minibatches"], summary["first_minibatch"]) == (2, 4)


def test_resume_auto_checks_the_newest_checkpoint_against_the_plan_before_launching(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--resume PATH was checked, --resume auto only read the step: every rank then failed."""
    data = straight_plan("mlp", [[str(i) for i in range(9)]], workload_args=PLAN_ARGS)
    written = data["microbatch_size"]
    data["microbatch_size"] = written * 2
    plan = write_plan(data, tmp_path / "plan.yaml")
    options = ["--steps", "6", "--run-dir", str(run), "--resume", "auto"]
    assert launch_check.main([str(plan), "--", *options]) == 2
    assert capsys.readouterr().err == (
        f"launch.sh: error: {run / 'checkpoints' / 'step-000004'}: minibatches of 1 x {written} "
        f"samples, the plan uses 1 x {written * 2}; the data position would not match, so keep "
        "microbatch_size and microbatches when resuming\n"
    )


def test_resume_path_checks_the_checkpoints_files_before_launching(
    checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stage file deleted or damaged in the checkpoint of --resume PATH failed every rank
    (--resume auto skipped such a checkpoint already, here)."""
    step = checkpoints / "step-000004"
    options = ("--steps", "6", "--run-dir", str(tmp_path / "new"), "--resume", str(step))
    stage = _stage_file(step)
    stage.write_bytes(stage.read_bytes()[:-1])
    assert _launch_check(tmp_path, *options) == 2
    assert capsys.readouterr().err == (
        f"launch.sh: error: {stage}: checksum mismatch; the file is corrupt or truncated\n"
    )
    stage.unlink()
    assert _launch_check(tmp_path, *options) == 2
    assert capsys.readouterr().err == (
        f"launch.sh: error: {stage}: stage file listed in the manifest is missing\n"
    )
