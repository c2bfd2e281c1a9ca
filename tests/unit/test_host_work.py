"""``benchmarks/host_work.py``: the pieces that run without valgrind (the plan it trains, the
arithmetic, the message when valgrind is missing)."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

from pipedream.formats.plan import load_plan
from pipedream.runtime import launch_check

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import host_work  # noqa: E402


def test_doctests() -> None:
    failed, attempted = doctest.testmod(host_work)
    assert attempted > 0 and failed == 0


def test_the_stage_side_is_one_rank_training_every_layer(tmp_path: Path, capsys) -> None:
    command, env = host_work.stage_command(host_work.Model(layers=3), 25, tmp_path)
    plan = load_plan(tmp_path / "plan.yaml")
    assert [s.first_layer for s in plan.stages] == ["embed"]
    assert [s.last_layer for s in plan.stages] == ["head"]
    assert plan.world_size == 1 and plan.workload_args["layers"] == "3"
    assert command[:4] == ["-m", "pipedream.cli", "train", str(tmp_path / "plan.yaml")]
    assert command[command.index("--steps") + 1] == "25"
    assert command[command.index("--device") + 1] == "cpu"
    assert env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    assert launch_check.main([str(tmp_path / "plan.yaml")]) == 0  # what launch.sh checks
    assert capsys.readouterr().out == "1 1\n"  # one process, on one node


def test_without_valgrind_it_says_what_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setattr(host_work.shutil, "which", lambda name: None)
    assert host_work.main([]) == 2
    assert "needs valgrind" in capsys.readouterr().out
