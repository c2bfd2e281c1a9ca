"""Bad input ends with one clear line, exit code 2, no traceback and no hang (docs/cli.md,
docs/formats.md).

Every case runs the real command: ``pipedream`` through ``pipedream.cli.main`` in this process
(``launching.run_main``: its exit code and what it prints), ``launch.sh`` in a subprocess
(``launching.launch`` kills the process group on timeout), so the exit code and stderr are what a
user sees.
"""

from __future__ import annotations

import copy
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipedream.runtime import launch_check

from launching import REPO, launch, run_main, straight_plan, write_plan

# The default mlp with layers=2 has the layers "0", "1" (Linear+ReLU blocks) and "2" (the head).
MLP_ARGS = {"layers": "2", "samples": "64"}
TORCHRUN_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _one_line(result: subprocess.CompletedProcess[str], prefix: str) -> str:
    """Exit code 2 and exactly one line on stderr, starting with ``prefix``; returns it."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


def _plan(tmp_path: Path, data: dict[str, Any], name: str = "plan.yaml") -> Path:
    return write_plan(data, tmp_path / name)


def _single(first: str = "0", last: str = "2", **changes: Any) -> dict[str, Any]:
    """A one-process plan of the 3-layer mlp: runs without torchrun."""
    plan = straight_plan("mlp", [[first, last]], microbatch_size=4, workload_args=MLP_ARGS)
    plan.update(changes)
    return plan


def _two_stages(**changes: Any) -> dict[str, Any]:
    plan = straight_plan("mlp", [["0", "1"], ["2"]], microbatch_size=4, workload_args=MLP_ARGS)
    plan.update(changes)
    return plan


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# pipedream train: the plan file


def test_train_missing_plan(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    line = _one_line(run_main("train", str(path)), "pipedream train: error: ")
    assert line == f"pipedream train: error: {path}: plan file not found; check the path"


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        pytest.param(
            {**_two_stages(), "colour": "red"},
            "colour",
            "unknown key; remove it or use one of: ",
            id="unknown-key",
        ),
        pytest.param(
            {**_two_stages(), "microbatch_szie": 4},
            "microbatch_szie",
            "unknown key; did you mean 'microbatch_size'?",
            id="typo-of-optional-key",
        ),
        pytest.param(
            _two_stages(world_size="two"),
            "world_size",
            "expected an integer, got str 'two'; write a whole number such as 4",
            id="wrong-type",
        ),
        pytest.param(
            _two_stages(schedule="fast"),
            "schedule",
            "unknown schedule 'fast'; use one of pipedream, pipedream-vs, 2bw, 1f1b, gpipe, "
            "interleaved-1f1b, zb-h1, zbv",
            id="unknown-schedule",
        ),
        pytest.param(
            {**_two_stages(), "stages": [{"first_layer": "0", "last_layer": "2", "ranks": [0, 1]}]},
            "stages[0].ranks",
            "lists 2 ranks for 1 replicas; give exactly one rank per replica",
            id="ranks-vs-replicas",
        ),
    ],
)
def test_train_malformed_plan(
    tmp_path: Path, data: dict[str, Any], field: str, message: str
) -> None:
    path = _plan(tmp_path, data)
    line = _one_line(run_main("train", str(path)), "pipedream train: error: ")
    assert line.startswith(f"pipedream train: error: {path}: {field}: {message}")


def test_train_plan_names_a_layer_the_model_lacks(tmp_path: Path) -> None:
    path = _plan(tmp_path, _single(last="7"))
    line = _one_line(run_main("train", str(path), "--steps", "1"), "pipedream train: error: ")
    assert line == (
        f"pipedream train: error: {path}: stages[0].last_layer: the model has no layer '7'; "
        "use one of the model's layers '0'..'2'"
    )


def test_train_plan_does_not_cover_the_model(tmp_path: Path) -> None:
    path = _plan(tmp_path, _single(last="1"))
    line = _one_line(run_main("train", str(path), "--steps", "1"), "pipedream train: error: ")
    assert line == (
        f"pipedream train: error: {path}: stages: end at layer '1' but the model continues to "
        "'2'; let the last stage end at '2'"
    )


def test_train_plan_layers_differ_from_the_model(tmp_path: Path) -> None:
    data = _single(last="3", layers=["0", "1", "2", "3"])  # profiled with layers=3
    path = _plan(tmp_path, data)
    line = _one_line(run_main("train", str(path), "--steps", "1"), "pipedream train: error: ")
    assert line.startswith(
        f"pipedream train: error: {path}: layers: do not match the traced model: layers ['3'] "
        "run no operation in the traced model"
    )
    assert "re-run `pipedream profile` and `pipedream plan`" in line


def test_train_one_stage_plan_of_a_layer_the_model_lacks(tmp_path: Path) -> None:
    """A name that is no module of the model used to own every root-level operation, so a
    one-layer plan of any name trained the whole model."""
    data = _single(first="a", last="a", layers=["a"])
    path = _plan(tmp_path, data)
    line = _one_line(run_main("train", str(path), "--steps", "1"), "pipedream train: error: ")
    assert line.startswith(
        f"pipedream train: error: {path}: layers: do not match the traced model: layers ['a'] "
        "run no operation in the traced model; use module paths of the model (its top-level "
        "modules: '0', '1', '2')"
    )


# ---------------------------------------------------------------------------------------------
# pipedream train: the plan against the launch


def test_train_two_process_plan_as_a_single_process(tmp_path: Path) -> None:
    path = _plan(tmp_path, _two_stages())
    line = _one_line(run_main("train", str(path)), "pipedream train: error: ")
    assert line.startswith(
        f"pipedream train: error: {path}: world_size: the plan needs 2 processes but this is a "
        f"single process; launch it with `./launch.sh {path}`"
    )


def test_train_world_size_differs_from_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Must fail before the rendezvous: rank 0 of 3 would otherwise wait for peers forever."""
    path = _plan(tmp_path, _two_stages())
    for name, value in {
        "WORLD_SIZE": "3",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    result = run_main("train", str(path), "--steps", "1", timeout=60)
    line = _one_line(result, "pipedream train: error: ")
    assert line.startswith(
        f"pipedream train: error: {path}: world_size: the plan needs 2 processes but torchrun "
        "started 3; launch with `./launch.sh"
    )
    assert "re-plan with --workers 3" in line


def test_train_non_integer_world_size_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _plan(tmp_path, _two_stages())
    monkeypatch.setenv("WORLD_SIZE", "two")
    line = _one_line(run_main("train", str(path), "--steps", "1", timeout=60), "pipedream train")
    assert "WORLD_SIZE" in line


def test_train_rank_out_of_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _plan(tmp_path, _two_stages())
    for name, value in {
        "WORLD_SIZE": "2",
        "RANK": "5",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    # --timeout 2 bounds the rendezvous wait, so this fails fast while the bug is there
    result = run_main("train", str(path), "--steps", "1", "--timeout", "2", timeout=60)
    line = _one_line(result, "pipedream train: error: ")
    assert "RANK" in line


def test_launch_sh_nproc_differs_from_plan(tmp_path: Path) -> None:
    path = _plan(tmp_path, _two_stages())
    result = launch(path, "--nproc-per-node", "3", "--steps", "1", timeout=60)
    line = _one_line(result, "launch.sh: error: ")
    assert line == (
        "launch.sh: error: --nnodes 1 x --nproc-per-node 3 = 3 processes, but the plan's "
        "world_size is 2; drop --nproc-per-node (launch.sh derives it from the plan) or re-plan "
        "with --workers 3"
    )
    assert result.stdout == ""  # torchrun never started


def test_launch_sh_malformed_plan(tmp_path: Path) -> None:
    path = _plan(tmp_path, _two_stages(world_size=-2))
    line = _one_line(launch(path, timeout=60), "launch.sh: error: ")
    assert line == f"launch.sh: error: {path}: world_size: must be >= 1, got -2; use 1 or more"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param(
            ["--nnodes", "1:2"],
            "--nnodes 1:2: a plan runs on a fixed number of processes (2), so not on an elastic "
            "range of nodes; give one number, e.g. --nnodes 2",
            id="elastic-range",  # accepted, then torchrun waited for a second node forever
        ),
        pytest.param(
            ["--nnodes=abc"],
            "--nnodes 'abc': must be a whole number of nodes, or MIN:MAX with MIN = MAX",
            id="nnodes",  # named --nproc-per-node None too
        ),
        pytest.param(
            ["--nnodes", "1:x"],
            "--nnodes '1:x': must be a whole number of nodes, or MIN:MAX with MIN = MAX",
            id="nnodes-range",
        ),
        pytest.param(
            ["--nnodes="],
            "--nnodes '': must be a whole number of nodes, or MIN:MAX with MIN = MAX",
            id="nnodes-empty",  # checked as 1, then handed to torchrun empty
        ),
        pytest.param(
            ["--nproc-per-node="],
            "--nproc-per-node '': must be a whole number of processes",
            id="nproc-per-node-empty",  # dropped: the plan's count was used
        ),
        pytest.param(
            ["--nproc-per-node", "two"],
            "--nproc-per-node 'two': must be a whole number of processes",
            id="nproc-per-node",  # named --nnodes '1' too
        ),
    ],
)
def test_launch_sh_names_the_node_option_it_refuses(
    tmp_path: Path, options: list[str], message: str
) -> None:
    result = launch(_plan(tmp_path, _two_stages()), *options, "--steps", "1", timeout=60)
    assert _one_line(result, "launch.sh: error: ") == f"launch.sh: error: {message}"
    assert result.stdout == ""  # torchrun never started


def _torchrun_argv(tmp_path: Path, plan: Path, *options: str) -> list[str]:
    """The command line launch.sh gives torchrun for ``./launch.sh PLAN OPTIONS...``: its
    interpreter ($PYTHON) is a script that prints the arguments of ``-m
    pipedream.runtime.torchrun`` instead of starting it (and runs the checks before it)."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = pipedream.runtime.torchrun ]; then\n'
        "  shift 2; printf '%s\\n' \"$@\"; exit 0\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    result = subprocess.run(
        ["bash", str(REPO / "launch.sh"), str(plan), *options],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.parametrize("nnodes", ["1", "1:1"])
def test_launch_sh_runs_one_node_standalone(tmp_path: Path, nnodes: str) -> None:
    """``--nnodes 1:1`` is one node, as ``--nnodes 1``: torchrun --standalone (it went without,
    on the static rendezvous at a fixed port)."""
    argv = _torchrun_argv(tmp_path, _plan(tmp_path, _two_stages()), "--nnodes", nnodes)
    assert "--standalone" in argv
    assert argv[argv.index("--nproc-per-node") + 1] == "2"


@pytest.mark.parametrize(
    "spelling",
    [
        ["--node_rank=0", "--max_restarts=0", "--master_addr=127.0.0.1", "--master_port=29501"],
        ["--node-rank=0", "--max-restarts=0", "--master-addr=127.0.0.1", "--master-port=29501"],
        ["--node_rank", "0", "--max_restarts", "0", "--master_addr", "127.0.0.1"]
        + ["--master_port", "29501"],
    ],
    ids=["underscore=value", "dash=value", "underscore value"],
)
def test_launch_sh_gives_torchrun_its_options_however_spelled(
    tmp_path: Path, spelling: list[str]
) -> None:
    """torchrun takes ``--node_rank=0`` as ``--node-rank=0``; launch.sh gave the underscore
    spelling with ``=`` to ``pipedream train``, which refused it."""
    path = _plan(tmp_path, _two_stages())
    argv = _torchrun_argv(tmp_path, path, *spelling, "--nproc_per_node=2", "--steps", "1")
    options = argv[: argv.index("-m")]
    assert options == [
        "--node-rank", "0", "--max-restarts", "0", "--master-addr", "127.0.0.1",
        "--master-port", "29501", "--nproc-per-node", "2",
    ]  # fmt: skip
    assert argv[argv.index("train") + 1 :][:3] == [str(path), "--steps", "1"]


# ---------------------------------------------------------------------------------------------
# pipedream train: options


@pytest.mark.parametrize(
    ("plan", "options", "message"),
    [
        pytest.param(_two_stages(), ["--steps", "0"], "--steps must be >= 1, got 0", id="steps"),
        pytest.param(
            _two_stages(),
            ["--checkpoint-every", "-1"],
            "--checkpoint-every must be >= 0, got -1",
            id="checkpoint-every",
        ),
        pytest.param(
            _two_stages(),
            ["--timeout", "0"],
            "--timeout must be 1 to 604800 seconds, got 0; e.g. --timeout 300",
            id="timeout",
        ),
        # nan passed every comparison, and inf or 1e308 overflowed the process group's timer
        *(
            pytest.param(
                _two_stages(),
                ["--timeout", value],
                f"--timeout must be 1 to 604800 seconds, got {value}",
                id=f"timeout-{value}",
            )
            for value in ("nan", "inf", "1e+308", "0.001")
        ),
        pytest.param(
            straight_plan("mlp", [["0", "2"]], replicas=[2], workload_args=MLP_ARGS),
            ["--steps", "3"],
            "stage 0 has 2 replicas, so --steps and --checkpoint-every must be multiples of 2",
            id="steps-vs-replicas",
        ),
        pytest.param(
            straight_plan("mlp", [["0"], ["1", "2"]], replicas=[2, 3], workload_args=MLP_ARGS),
            ["--steps", "4"],  # a multiple of 2, not of 3: it used to name one stage at a time
            "the stages have 2 and 3 replicas, so --steps and --checkpoint-every must be "
            "multiples of 6, their least common multiple (a segment of 4 minibatches starts at 0)",
            id="steps-vs-several-replica-counts",
        ),
        pytest.param(
            _two_stages(),
            ["--steps", "many"],
            "argument --steps: invalid int value: 'many'",
            id="steps-not-int",
        ),
    ],
)
def test_train_bad_option(
    tmp_path: Path, plan: dict[str, Any], options: list[str], message: str
) -> None:
    path = _plan(tmp_path, plan)
    line = _one_line(run_main("train", str(path), *options), "pipedream train: error: ")
    assert message in line


REPLICATED = straight_plan("mlp", [["0", "2"]], replicas=[2], workload_args=MLP_ARGS)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param(
            ["--steps", "3"],
            "launch.sh: error: stage 0 has 2 replicas, so --steps and --checkpoint-every must be "
            "multiples of 2 (a segment of 3 minibatches starts at 0)",
            id="steps-vs-replicas",
        ),
        pytest.param(
            ["--steps", "many"],
            "pipedream train: error: argument --steps: invalid int value: 'many'",
            id="steps-not-int",
        ),
        pytest.param(  # as `pipedream train` says it (was "pipedream: error: ...")
            ["--steps", "2", "--bogus"],
            "pipedream train: error: unrecognized arguments: --bogus",
            id="unknown-option",
        ),
        pytest.param(  # the ranks would have built tables of gigabytes before the first step
            ["--steps", "100000000"],
            "launch.sh: error: a stretch of 100000000 minibatches between checkpoints (--steps "
            "100000000, no --checkpoint-every) needs action tables of up to 200,000,000 "
            "actions per rank (at most 10,000,000: about 2 GB of host memory, built before the "
            "stretch starts); use --checkpoint-every 5000000 or less (each stretch between "
            "checkpoints runs as one table)",
            id="stretch-too-long",
        ),
        pytest.param(
            ["--steps", "2", "--resume", "auto"],  # launch.sh's default run dir would be new
            "launch.sh: error: --resume auto needs --run-dir (the run whose checkpoints to use)",
            id="resume-auto-without-run-dir",
        ),
        pytest.param(
            ["--steps", "2", "--resume", "nowhere"],
            "launch.sh: error: nowhere: no manifest.yaml (not a checkpoint directory, or an "
            "incomplete one); pass a runs/<run>/checkpoints/step-NNNNNN directory",
            id="resume-path",
        ),
    ],
)
def test_launch_check_refuses_the_options_every_rank_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    """What launch.sh runs before torchrun (the wiring: the next test)."""
    path = _plan(tmp_path, REPLICATED)
    try:
        code = launch_check.main([str(path), "--", *options])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    captured = capsys.readouterr()
    assert (code, captured.out, captured.err) == (2, "", message + "\n")


@pytest.mark.parametrize(
    ("gpus", "device", "message"),
    [
        (0, "cuda", "--device cuda: this node has no GPU that PyTorch can use; use --device cpu "
         "(or auto)"),
        (0, "cuda-shared", "--device cuda-shared: this node has no GPU that PyTorch can use; use "
         "--device cpu (or auto)"),
        (1, "cuda", "--device cuda: the node runs 2 ranks but has 1 GPU; give every rank its "
         "own GPU, or let ranks share them with --device cuda-shared"),
        (1, "cuda-shared", None),
        (2, "cuda", None),
    ],
)  # fmt: skip
def test_launch_check_refuses_a_device_the_node_lacks(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
    device: str,
    message: str | None,
) -> None:
    """Every rank refused --device cuda on a host without GPUs, suggesting cuda-shared, which
    every rank refused too."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    path = _plan(tmp_path, REPLICATED)
    code = launch_check.main([str(path), "--", "--steps", "2", "--device", device])
    captured = capsys.readouterr()
    if message is None:
        assert (code, captured.out) == (0, "2 1\n")  # 2 processes per node, 1 node
    else:
        assert (code, captured.err) == (2, f"launch.sh: error: {message}\n")


def test_launch_check_refuses_a_run_dir_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each gave a traceback from every rank: FileExistsError, NotADirectoryError, and (after
    training to the end) IsADirectoryError for summary.json."""
    path = _plan(tmp_path, REPLICATED)
    afile = tmp_path / "afile"
    afile.write_text("")
    odd = tmp_path / "odd"
    (odd / "summary.json").mkdir(parents=True)
    cases = {
        str(afile): f"--run-dir {afile}: {afile} is not a directory; give another path",
        str(afile / "sub"): f"--run-dir {afile / 'sub'}: {afile} is not a directory; give "
        "another path",
        str(odd): f"--run-dir {odd}: {odd / 'summary.json'} is not a file, where the run "
        "writes one; move it away or give another --run-dir",
        "": "--run-dir is empty; give the run's directory, e.g. --run-dir runs/a",
    }
    for run_dir, message in cases.items():
        code = launch_check.main([str(path), "--", "--steps", "2", "--run-dir", run_dir])
        captured = capsys.readouterr()
        assert (code, captured.err) == (2, f"launch.sh: error: {message}\n")


def test_launch_check_of_a_fresh_run_does_not_import_torch(tmp_path: Path) -> None:
    """launch.sh runs the check before every launch: seconds of importing torch there are
    paid again by every rank."""
    path = _plan(tmp_path, REPLICATED)
    code = (
        "import sys\n"
        "from pipedream.runtime import launch_check\n"
        f"assert launch_check.main([{str(path)!r}, '--', '--steps', '4']) == 0\n"
        "assert 'torch' not in sys.modules, 'the launch check imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_launch_sh_checks_the_train_options_before_torchrun(tmp_path: Path) -> None:
    """Without the check, each of the 2 ranks printed the error and torchrun its report."""
    result = launch(_plan(tmp_path, REPLICATED), "--steps", "3", "--no-progress", timeout=60)
    line = _one_line(result, "launch.sh: error: stage 0 has 2 replicas")
    assert line.endswith("(a segment of 3 minibatches starts at 0)")
    assert result.stdout == ""  # torchrun never started
    helped = launch(_plan(tmp_path, REPLICATED), "--steps", "2", "--help", timeout=60)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: pipedream train")


def test_launch_sh_ends_on_a_mistake_the_ranks_find_with_their_one_line(tmp_path: Path) -> None:
    """What launch.sh cannot check without building the model, the ranks find: each printed
    the line, then torchrun a traceback and a table of the ranks' failures, exit status 1."""
    path = _plan(tmp_path, _two_stages(workload_args={**MLP_ARGS, "in_features": "-1"}))
    # torchrun's options in the spellings it takes (they went to pipedream train): the ranks'
    # line shows that torchrun took them and started the ranks
    spelled = ["--nnodes=1:1", "--node_rank=0", "--max_restarts=0", "--nproc_per_node=2"]
    result = launch(path, *spelled, "--steps", "1", "--no-progress", timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("pipedream")]
    assert ours == ["pipedream train: error: mlp: in_features must be >= 1, got -1"]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


def test_launch_sh_checks_the_workload_before_torchrun(tmp_path: Path) -> None:
    """Without the check, each rank printed the error and torchrun its report (exit 1)."""
    path = _plan(tmp_path, _two_stages(workload_args={**MLP_ARGS, "widht": "8"}))
    result = launch(path, "--steps", "1", "--no-progress", timeout=60)
    line = _one_line(result, "launch.sh: error: ")
    assert line == (
        f"launch.sh: error: {path}: workload_args.widht: workload 'mlp' has no option 'widht' "
        "(did you mean 'width'?); its options are: layers, width, in_features, out_features, "
        "samples, lr, momentum, optimizer, warmup, decay, seed"
    )
    assert result.stdout == ""  # torchrun never started


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"workload": "mpl"},
            "workload: unknown workload 'mpl'; use a built-in name (mlp, gpt, digits, resnet, "
            "sleep, hf-lm) or package.module:function",
        ),
        (
            {"workload": "my_models.lm:build"},
            "workload: workload 'my_models.lm:build': cannot import module 'my_models.lm' "
            "(No module named 'my_models'); check the name and that the module is on PYTHONPATH",
        ),
        (
            {"workload_args": {**MLP_ARGS, "layers": "two"}},
            "workload_args.layers: 'two' is not a valid int for workload 'mlp'; write a whole "
            "number such as 8",
        ),
    ],
)
def test_launch_check_refuses_the_workload_every_rank_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, Any], message: str
) -> None:
    path = _plan(tmp_path, _two_stages(**changes))
    code = launch_check.main([str(path), "--", "--steps", "1"])
    captured = capsys.readouterr()
    assert (code, captured.out, captured.err) == (2, "", f"launch.sh: error: {path}: {message}\n")


# ---------------------------------------------------------------------------------------------
# pipedream train: the workload named by the plan


def test_train_unknown_workload(tmp_path: Path) -> None:
    path = _plan(tmp_path, _single(workload="nope"))
    line = _one_line(run_main("train", str(path), "--steps", "1"), "pipedream train: error: ")
    assert (
        "unknown workload 'nope'; use a built-in name (mlp, gpt, digits, resnet, sleep, hf-lm)"
        in line
    )


def test_train_bad_workload_arg_value(tmp_path: Path) -> None:
    path = _plan(tmp_path, _single(workload_args={**MLP_ARGS, "layers": "many"}))
    line = _one_line(run_main("train", str(path), "--steps", "1"), "pipedream train: error: ")
    assert "workload_args.layers: 'many' is not a valid int for workload 'mlp'" in line


def test_train_unknown_workload_arg(tmp_path: Path) -> None:
    path = _plan(tmp_path, _single(workload_args={**MLP_ARGS, "colour": "red"}))
    line = _one_line(run_main("train", str(path), "--steps", "1"), "pipedream train: error: ")
    assert "workload 'mlp' has no option 'colour'; its options are: layers, width" in line


def test_train_unknown_workload_names_plan_file_and_field(tmp_path: Path) -> None:
    path = _plan(tmp_path, _single(workload="nope"))
    line = _one_line(run_main("train", str(path), "--steps", "1"), "pipedream train: error: ")
    assert line.startswith(f"pipedream train: error: {path}: workload: ")


def test_train_bad_workload_arg_names_plan_file_and_field(tmp_path: Path) -> None:
    path = _plan(tmp_path, _single(workload_args={**MLP_ARGS, "layers": "many"}))
    line = _one_line(run_main("train", str(path), "--steps", "1"), "pipedream train: error: ")
    assert line.startswith(f"pipedream train: error: {path}: workload_args.layers: ")


# ---------------------------------------------------------------------------------------------
# pipedream export


def test_export_missing_directory(tmp_path: Path) -> None:
    directory = tmp_path / "runs" / "checkpoints" / "step-000001"
    out = tmp_path / "model.pt"
    result = run_main("export", str(directory), "-o", str(out))
    line = _one_line(result, "pipedream export: error: ")
    assert line == (
        f"pipedream export: error: {directory}: no such checkpoint directory; "
        "pass runs/<run>/checkpoints/step-NNNNNN"
    )
    assert not out.exists()


@pytest.mark.parametrize("script", ["launch.sh", "demo.sh"])
def test_a_python_without_pipedream_is_told_which_to_use(tmp_path: Path, script: str) -> None:
    """Outside the virtualenv, launch.sh's python printed "Error while finding module
    specification for 'pipedream.runtime.launch_check' (ModuleNotFoundError ...)", and demo.sh
    without the set-up ".venv/bin/python: No such file or directory"."""
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')  # sees no site-packages
    bare.chmod(0o755)
    args = ["plan.yaml", "--steps", "1"] if script == "launch.sh" else []
    result = subprocess.run(
        ["bash", str(REPO / script), *args],
        cwd=REPO,  # where an uninstalled Python finds the pipedream folder, not its runtime
        env=dict(os.environ, PYTHON=str(bare)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    fix = {
        "launch.sh": "activate the virtualenv it is installed in (. .venv/bin/activate) or name "
        "its Python (PYTHON=.venv/bin/python ./launch.sh ...)",
        "demo.sh": "set up first (README: python3 -m venv .venv && .venv/bin/pip install "
        "torch==2.13.0 -e .), or name a Python that has it (PYTHON=...)",
    }[script]
    line = f"{script}: error: {bare}: cannot import pipedream; {fix}"
    assert _one_line(result, f"{script}: error: ") == line


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (  # was "pipedream: error: unrecognized arguments: 8"
            ["profile", "mlp", "--workload-arg", "layers", "8", "-o", "p.yaml"],
            "pipedream profile: error: argument --workload-arg: 'layers' is not KEY=VALUE; "
            "write e.g. --workload-arg layers=8",
        ),
        (
            ["evaluate", "ckpt", "--workload-arg", "=8"],
            "pipedream evaluate: error: argument --workload-arg: '=8' is not KEY=VALUE; write "
            "e.g. --workload-arg layers=8",
        ),
        (  # said by the verb, as its other usage errors are (was "pipedream: error: ...")
            ["plan", "p.yaml", "--workers", "2", "-o", "plan.yaml", "extra"],
            "pipedream plan: error: unrecognized arguments: extra",
        ),
    ],
)
def test_usage_errors_name_the_verb_and_the_fix(argv: list[str], line: str) -> None:
    assert _one_line(run_main(*argv), "pipedream ") == line


@pytest.mark.parametrize("given", ["run", "run/checkpoints"])
def test_a_run_folder_given_for_a_checkpoint_names_its_newest(tmp_path: Path, given: str) -> None:
    """A run's folder, or its checkpoints folder, was told to pass a step-NNNNNN directory, not
    which; the newest is by number (step-1000000 sorts before step-999999 by name), of those
    saved whole (with a manifest)."""
    checkpoints = tmp_path / "run" / "checkpoints"
    directory = tmp_path / given
    what = "a run's folder" if given == "run" else "a folder of checkpoints"
    prefix = f"pipedream export: error: {directory}: no manifest.yaml ({what}, not a checkpoint); "
    (checkpoints / "step-1000001").mkdir(parents=True)  # a save that did not finish
    result = run_main("export", str(directory), "-o", str(tmp_path / "model.pt"))
    assert _one_line(result, "pipedream export: error: ") == (
        prefix + "none of its checkpoints was saved whole"
    )
    for step in ("step-999999", "step-1000000"):
        (checkpoints / step).mkdir()
        (checkpoints / step / "manifest.yaml").write_text("stages: []\n")
    result = run_main("export", str(directory), "-o", str(tmp_path / "model.pt"))
    assert _one_line(result, "pipedream export: error: ") == (
        prefix + f"pass one of its checkpoints, e.g. the newest: {checkpoints / 'step-1000000'}"
    )


def test_export_directory_without_manifest(tmp_path: Path) -> None:
    directory = tmp_path / "step-000001"
    directory.mkdir()
    (directory / "stage-00.pt").write_bytes(b"not a checkpoint")
    out = tmp_path / "model.pt"
    result = run_main("export", str(directory), "-o", str(out))
    line = _one_line(result, "pipedream export: error: ")
    assert line == (
        f"pipedream export: error: {directory}: no manifest.yaml (not a checkpoint directory, "
        "or an incomplete one); pass a runs/<run>/checkpoints/step-NNNNNN directory"
    )
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# pipedream plan: a malformed profile

PROFILE: dict[str, Any] = {
    "format": "pipedream/profile@1",
    "workload": "mlp",
    "microbatch_size": 4,
    "device": "cpu",
    "dtype": "float32",
    "layers": [
        {
            "name": str(i),
            "type": "Linear",
            "forward_ms": 1.0,
            "backward_ms": 2.0,
            "output_bytes": 1024,
            "parameter_bytes": 4096,
        }
        for i in range(3)
    ],
}


def _profile_with(path: Path, edit: str) -> Path:
    data = copy.deepcopy(PROFILE)
    if edit == "unknown-key":
        data["layers"][1]["forward_msec"] = 1.0
    elif edit == "wrong-type":
        data["layers"][2]["output_bytes"] = "1 KiB"
    elif edit == "negative":
        data["layers"][0]["parameter_bytes"] = -1
    elif edit == "non-finite":
        data["layers"][1]["backward_ms"] = math.inf
    elif edit == "wrong-format":
        data["format"] = "pipedream/plan@1"
    elif edit == "missing-key":
        del data["layers"]
    elif edit == "syntax":
        path.write_text("format: pipedream/profile@1\nlayers: [\n")
        return path
    elif edit == "directory":
        path.mkdir()
        return path
    elif edit == "missing-file":
        return path
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("unknown-key", "layers[1].forward_msec: unknown key; did you mean 'forward_ms'?"),
        ("wrong-type", "layers[2].output_bytes: expected an integer, got str '1 KiB'; write a "),
        ("negative", "layers[0].parameter_bytes: must be >= 0, got -1; use 0 or more"),
        ("non-finite", "layers[1].backward_ms: must be a finite number, got inf; write a "),
        ("wrong-format", "format: expected 'pipedream/profile@1', got 'pipedream/plan@1'; is "),
        ("missing-key", "layers: required field is missing; add 'layers: ...'"),
        ("syntax", "not valid YAML at line 3, column 1; fix the syntax of this profile file"),
        ("directory", "is a directory; pass a profile YAML file"),
        ("missing-file", "profile file not found; check the path"),
    ],
)
def test_plan_malformed_profile(tmp_path: Path, edit: str, message: str) -> None:
    path = _profile_with(tmp_path / "profile.yaml", edit)
    out = tmp_path / "plan.yaml"
    result = run_main("plan", str(path), "--workers", "2", "-o", str(out))
    line = _one_line(result, "pipedream plan: error: ")
    assert line.startswith(f"pipedream plan: error: {path}: {message}")
    assert not out.exists()


def test_plan_of_a_valid_profile_succeeds(tmp_path: Path) -> None:
    """The control for the cases above: the unedited profile plans fine."""
    path = _profile_with(tmp_path / "profile.yaml", "none")
    out = tmp_path / "plan.yaml"
    result = run_main("plan", str(path), "--workers", "2", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.is_file()


# ---------------------------------------------------------------------------------------------
# Help and usage


@pytest.mark.parametrize("verb", [None, "profile", "plan", "train", "export"])
def test_help_exits_0(verb: str | None) -> None:
    args = ["--help"] if verb is None else [verb, "--help"]
    result = run_main(*args)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    usage = "usage: pipedream" if verb is None else f"usage: pipedream {verb}"
    assert result.stdout.startswith(usage)


def test_unknown_verb_exits_2() -> None:
    line = _one_line(run_main("frobnicate"), "pipedream: error: ")
    assert "invalid choice: 'frobnicate'" in line


def test_no_verb_exits_2() -> None:
    line = _one_line(run_main(), "pipedream: error: ")
    assert "required: verb" in line


def test_missing_required_option_exits_2(tmp_path: Path) -> None:
    line = _one_line(run_main("profile", "digits"), "pipedream profile: error: ")
    assert "-o/--output" in line
    line = _one_line(run_main("export", str(tmp_path)), "pipedream export: error: ")
    assert line == (
        "pipedream export: error: give -o model.pt (the state dict), --hf DIR (a transformers "
        "model directory), or both"
    )


def test_launch_rejects_an_invalid_schedule_before_torchrun(tmp_path: Path) -> None:
    """2bw needs at least as many microbatches as stages: caught by launch.sh's table check."""
    plan = {
        "format": "pipedream/plan@1",
        "workload": "mlp",
        "schedule": "2bw",
        "microbatch_size": 4,
        "microbatches": 2,
        "world_size": 3,
        "stages": [
            {"first_layer": "0", "last_layer": "2", "replicas": 1, "ranks": [0]},
            {"first_layer": "3", "last_layer": "5", "replicas": 1, "ranks": [1]},
            {"first_layer": "6", "last_layer": "8", "replicas": 1, "ranks": [2]},
        ],
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    result = launch(path, "--steps", "4", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"launch.sh: error: {path}: the action tables are invalid: schedule '2bw' needs "
        "microbatches >= stages (3), got 2"
    ]
    assert "torch.distributed" not in result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------
# A reader of stdout that goes away (`pipedream plan ... | head -1`)


@pytest.mark.parametrize(
    ("command", "written"),
    [
        (["plan", "{d}/profile.yaml", "--workers", "2", "-o", "{d}/out.yaml"], "out.yaml"),
        (["simulate", "{d}/plan.yaml"], None),
        (
            ["profile", "mlp", "--workload-arg", "layers=1", "--repeats", "1", "-o", "{d}/p.yaml"],
            "p.yaml",
        ),
    ],
    ids=["plan", "simulate", "profile"],
)
def test_a_closed_stdout_ends_quietly(
    tmp_path: Path, command: list[str], written: str | None
) -> None:
    """``pipedream plan ... | head -1`` ended in a BrokenPipeError traceback: now the command
    stops without a word and exit status 1, as Python's documentation advises, its output
    file written (before the report). Here stdout is a pipe whose reader is gone before the
    command starts, so every write to it fails."""
    profile = _profile_with(tmp_path / "profile.yaml", "none")
    made = run_main("plan", str(profile), "--workers", "2", "-o", str(tmp_path / "plan.yaml"))
    assert made.returncode == 0, made.stderr
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pipedream.cli", *(p.format(d=tmp_path) for p in command)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (1, "")
    assert written is None or (tmp_path / written).is_file()
