"""bf16 training, determinism, and a two-node launch on loopback. (Recomputation and stateful
optimizers under the schedules' rules: test_schedules.py.)"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.workload import load_workload

from launching import start_launch, stop, straight_plan, write_plan
from runs import even_groups, train_and_load
from workers import run_plan

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

B = 8


GPT = {"layers": "2", "dim": "32", "heads": "2", "seq": "16"}


def _gpt_final_loss(tmp: Path, name: str, *extra: str) -> float:
    names = [n for n, _ in load_workload("gpt", GPT).model.named_children()]
    plan = straight_plan("gpt", even_groups(names, 2), microbatch_size=16, workload_args=GPT)
    path = write_plan(plan, tmp / f"{name}.yaml")
    run_dir = tmp / name
    result = run_plan(
        path,
        "--steps",
        "150",
        "--run-dir",
        str(run_dir),
        "--timeout",
        "60",
        "--no-progress",
        *extra,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sum(line["loss"] for line in lines[-20:]) / 20


def test_bf16_trains_gpt_like_fp32(tmp_path: Path) -> None:
    fp32 = _gpt_final_loss(tmp_path, "fp32")
    bf16 = _gpt_final_loss(tmp_path, "bf16", "--precision", "bf16")
    assert fp32 < 0.8 * torch.log(torch.tensor(64.0)).item()  # it did learn
    assert bf16 != fp32  # autocast really ran in bf16
    assert abs(bf16 - fp32) / fp32 < 0.05, (fp32, bf16)


def test_fp16_on_two_ranks_skips_what_grad_scaler_skips(tmp_path: Path) -> None:
    """Two stages in fp16: the last one scales the loss, both unscale, and the overflow one of
    them finds reaches the other in the norm's allreduce, so both skip the first update and
    end on the weights of a plain loop with ``GradScaler``."""
    from plain_loop import plain_loop
    from runs import max_rel_diff

    support = str(Path(__file__).resolve().parents[1] / "support")  # dtype_model
    said: list[str] = []
    got = train_and_load(
        tmp_path,
        [["0", "1"], ["2", "3", "4"]],
        steps=8,
        workload="dtype_model:build",
        workload_args={"dtype": "float32"},
        schedule="1f1b",
        microbatch_size=4,
        microbatches=2,
        extra=("--precision", "fp16", "--checkpoint-every", "4"),
        env={"PYTHONPATH": support},
        said=said,
    )
    scales: list[float] = []
    want, _ = plain_loop(
        "dtype_model:build", {"dtype": "float32"}, steps=8, microbatches=2, microbatch_size=4,
        precision="fp16", scales=scales,
    )  # fmt: skip
    assert max_rel_diff(got, want) < 1e-6
    assert scales[-1] == 2.0**14  # two updates skipped
    assert (
        "fp16 loss scaling: skipped 2 of 8 updates for an overflow; loss scale 16384 at the end"
        in said
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_two_nodes_equal_one_node_bit_for_bit(tmp_path: Path) -> None:
    """Two launches of one plan and seed, one on a single node and one on two, end with the
    same bits: runs are reproducible, whichever way the ranks are spread."""
    args = {"layers": "4", "width": "16", "optimizer": "adam", "lr": "0.01"}
    names = [n for n, _ in load_workload("mlp", args).model.named_children()]
    stages = even_groups(names, 4)
    one = train_and_load(tmp_path, stages, steps=8, workload_args=args, name="one")

    plan = write_plan(straight_plan("mlp", stages, workload_args=args), tmp_path / "two.yaml")
    port = _free_port()
    nodes = [
        start_launch(
            plan,
            "--nnodes",
            "2",
            "--node-rank",
            str(n),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--steps",
            "8",
            "--run-dir",
            str(tmp_path / "two"),
            "--timeout",
            "60",
            "--no-progress",
        )
        for n in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=180) for node in nodes]
    finally:
        for node in nodes:
            stop(node)
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:]
    two = load_full_state_dict(tmp_path / "two" / "checkpoints" / "step-000008")
    assert all(torch.equal(one[k], two[k]) for k in one)
