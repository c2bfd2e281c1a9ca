"""PipeDream's asynchronous 1F1B with weight stashing, on gloo, against the paper's update rule.

The oracle (tests/support/oracles.py) is plain single-process autograd on the whole model:
W^(t+1) = W^(t) - eta * grad f(W_0^(t-S+1), ..., W_{S-1}^(t)) (versions clamped at 0).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.workload import load_workload

from launching import launch, straight_plan, write_plan
from oracles import stale_oracle

ARGS = {"layers": "5", "width": "16", "lr": "0.2"}
MICROBATCH = 8
SEED = 3


def _groups(names: list[str], num_stages: int) -> list[list[str]]:
    bounds = [round(i * len(names) / num_stages) for i in range(num_stages + 1)]
    return [names[bounds[i] : bounds[i + 1]] for i in range(num_stages)]


def _max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want
    )


# three stages: test_variants.py (momentum SGD and Adam) and test_graph_models.py, same rule
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_pipedream_equals_paper_rule(tmp_path: Path, num_stages: int) -> None:
    steps = 2 * num_stages + 2
    workload = load_workload("mlp", ARGS, microbatch_size=MICROBATCH)
    names = [name for name, _ in workload.model.named_children()]
    stages = _groups(names, num_stages)
    plan = write_plan(
        straight_plan("mlp", stages, microbatch_size=MICROBATCH, workload_args=ARGS),
        tmp_path / "plan.yaml",
    )
    result = launch(
        plan,
        "--steps",
        str(steps),
        "--seed",
        str(SEED),
        "--run-dir",
        str(tmp_path / "run"),
        "--timeout",
        "60",
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = load_full_state_dict(tmp_path / "run" / "checkpoints" / f"step-{steps:06d}")

    data = MicrobatchStream(workload.dataset, MICROBATCH, SEED)
    S = num_stages

    def oracle(staleness):
        fresh = load_workload("mlp", ARGS, microbatch_size=MICROBATCH)
        return stale_oracle(
            fresh.model,
            stages,
            num_minibatches=steps,
            minibatch=lambda t: [data.microbatch(t)],
            loss_fn=fresh.loss_fn,
            staleness=staleness,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.2),
        )

    paper = oracle(lambda t, s: max(0, t - (S - 1 - s)))
    assert _max_rel(got, paper) < 1e-5
    if S >= 2:
        synchronous = oracle(lambda t, s: t)
        # the staleness is real: plain synchronous SGD ends somewhere measurably different
        assert _max_rel(got, synchronous) > 1e-4
