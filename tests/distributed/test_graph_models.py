"""Models that are not an nn.Sequential (traced with torch.export), cut into 3 stages at
boundaries that cut residual connections, under PipeDream's schedule against the paper rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.formats import load_plan
from pipedream.formats.trace import load_traces
from pipedream.graph.stages import stage_ios
from pipedream.optimizer.measured import message_times
from pipedream.profiler.graph_profile import layer_graph
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.runtime.train import IN_ORDER_ENV
from pipedream.workload import load_workload

from launching import write_plan
from oracles import plain_training, stale_oracle
from runs import max_rel_diff
from workers import run_plan

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

CASES = {
    # the block input of layer1.0 skips from stage 0 over stage 1 to the addition in stage 2
    "resnet": (
        {"width": "4", "samples": "256", "lr": "0.05"},
        3,
        ["layer1.0.conv1", "layer1.0.conv2"],
    ),
    # cut between a block's norm and attention: the residual stream crosses with the activations
    "gpt": (
        {"layers": "2", "dim": "32", "heads": "2", "seq": "16", "optimizer": "sgd", "lr": "0.1"},
        2,
        ["h0.attn", "h1.attn"],
    ),
}


def _plan(
    workload: str,
    args: dict[str, str],
    schedule: str,
    microbatch: int,
    microbatches: int,
    layers: list[str],
    ranges: list[tuple[int, int]],
) -> dict[str, object]:
    """A plan of one rank per stage, stage ``s`` the layers ``ranges[s]`` (inclusive)."""
    return {
        "format": "pipedream/plan@1",
        "workload": workload,
        "workload_args": args,
        "schedule": schedule,
        "microbatch_size": microbatch,
        "microbatches": microbatches,
        "world_size": len(ranges),
        "layers": layers,
        "stages": [
            {"first_layer": layers[a], "last_layer": layers[b], "replicas": 1, "ranks": [s]}
            for s, (a, b) in enumerate(ranges)
        ],
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_traced_model_in_three_stages_equals_paper_rule(tmp_path: Path, name: str) -> None:
    args, depth, cuts = CASES[name]
    microbatch = 4
    workload = load_workload(name, args, microbatch_size=microbatch)
    graph = layer_graph(workload.model, workload.example_input, depth=depth)
    layers = graph.layers
    starts = [0, layers.index(cuts[0]), layers.index(cuts[1])]
    ranges = [(starts[i], (starts + [len(layers)])[i + 1] - 1) for i in range(3)]
    ios = stage_ios(graph, ranges)
    if name == "resnet":  # a real skip connection: stage 0 sends to stage 2 directly
        assert [c for c, _ in ios[0].consumers] == [1, 2]
    else:  # the residual stream crosses every cut
        assert all(len(io.inputs) >= 2 for io in ios[1:])
    steps = 7
    path = write_plan(
        _plan(name, args, "pipedream", microbatch, 1, layers, ranges), tmp_path / "plan.yaml"
    )
    result = run_plan(
        path,
        "--steps",
        str(steps),
        "--run-dir",
        str(tmp_path / "run"),
        "--timeout",
        "120",
        "--no-progress",
        "--trace",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # the traces carry the wiring, so the reader rebuilds the tables the run executed and
    # times every message, a skip connection's included
    edges = tuple(sorted({(io.stage, c) for io in ios for c, _ in io.consumers}))
    traces = load_traces(tmp_path / "run")
    assert [t.edges for t in traces] == [edges] * 3
    links = {(m.source, m.destination) for m in message_times(traces, load_plan(path))}
    assert links == {pair for p, c in edges for pair in ((p, c), (c, p))}
    got = load_full_state_dict(tmp_path / "run" / "checkpoints" / f"step-{steps:06d}")

    fresh = load_workload(name, args, microbatch_size=microbatch)
    data = MicrobatchStream(fresh.dataset, microbatch, 0)
    stages = [layers[a : b + 1] for a, b in ranges]
    want_params = stale_oracle(
        fresh.model,
        stages,
        num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t)],
        loss_fn=fresh.loss_fn,
        staleness=lambda t, s: max(0, t - (2 - s)),
        optimizer=fresh.optimizer,
    )
    want = {**fresh.model.state_dict(), **want_params}  # buffers (batch-norm statistics) too
    assert max_rel_diff(got, want) < 1e-5


def test_densely_connected_model_in_six_stages_under_nccls_discipline(tmp_path: Path) -> None:
    """Every stage sends to every later one: under 1F1B the ranks send so many messages between
    their receives that with the default bound on sends in flight two ranks wait for each other
    forever (rank 0 for its activations to reach rank 5, rank 5 for its gradient to reach rank
    0). Under NCCL's discipline, here on gloo, the wait is the host's; on GPUs it would be the
    streams'. The runtime raises the bound, says so, and trains what a plain loop does."""
    microbatch, microbatches, steps = 4, 6, 2
    workload = load_workload("dense_mlp:build", {}, microbatch_size=microbatch)
    graph = layer_graph(workload.model, workload.example_input, depth=2)
    layers = graph.layers
    assert layers == [*(f"blocks.{k}" for k in range(6)), "head"]
    ranges = [(k, k) for k in range(5)] + [(5, 6)]
    ios = stage_ios(graph, ranges)
    assert [[c for c, _ in io.consumers] for io in ios] == [[*range(s + 1, 6)] for s in range(6)]
    plan = _plan("dense_mlp:build", {}, "1f1b", microbatch, microbatches, layers, ranges)
    path = write_plan(plan, tmp_path / "plan.yaml")
    run = tmp_path / "run"
    args = ("--steps", str(steps), "--run-dir", str(run), "--timeout", "60", "--no-progress")
    result = run_plan(path, *args, env={IN_ORDER_ENV: "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "; 16 sent messages in flight (raised: " in result.stderr
    got = load_full_state_dict(run / "checkpoints" / f"step-{steps:06d}")

    fresh = load_workload("dense_mlp:build", {}, microbatch_size=microbatch)
    data = MicrobatchStream(fresh.dataset, microbatch, 0)
    want = plain_training(
        fresh.model,
        num_updates=steps,
        batch=lambda k: tuple(  # type: ignore[arg-type]
            torch.cat(p)
            for p in zip(*(data.microbatch(k * microbatches + j) for j in range(microbatches)))
        ),
        loss_fn=fresh.loss_fn,
        optimizer=fresh.optimizer,
    )
    assert max_rel_diff(got, want) < 1e-5
