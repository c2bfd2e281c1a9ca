"""Gradient clipping to a global norm (``train --clip-grad-norm``): where the tables take the
norm (a ``C`` per rank and update), which plans can clip, and that a clipped pipeline equals a
plain loop with ``clip_grad_norm_`` in the reference executor, tied weights and replicas
included."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipedream.errors import ScheduleError
from pipedream.runtime.global_norm import clip_factor, sum_of_squares
from pipedream.schedules import (
    SCHEDULES,
    Action,
    Op,
    PipelineSpec,
    build_tables,
    parse_action,
    validate_tables,
)
from pipedream.schedules.global_norm import global_norm_problem

from launching import run_main, straight_plan, write_plan
from plain_loop import plain_loop
from reference_run import reference_layout_weights
from runs import max_rel_diff
from tied_gpt import ARGS, LAYERS, MICROBATCH, plain_tied_training

MAX_NORM = 0.3
"""Below every norm the tied model's first updates have (0.56 to 1.07): every update clips."""
FOUR = [LAYERS[:1], LAYERS[1:2], LAYERS[2:4], LAYERS[4:]]


def _tables(spec: PipelineSpec) -> dict[int, str]:
    return {rank: " ".join(map(str, table)) for rank, table in build_tables(spec).items()}


def test_each_rank_clips_after_its_gradients_and_before_its_updates() -> None:
    spec = PipelineSpec("1f1b", ((0,), (1,)), 2, 2, global_norm=True)
    assert _tables(spec) == {
        0: "0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0C0 0U0 "
        "0F2 0SF2 0F3 0SF3 0RB2 0B2 0RB3 0B3 0C1 0U1",
        1: "1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1C0 1U0 "
        "1RF2 1F2 1B2 1SB2 1RF3 1F3 1B3 1SB3 1C1 1U1",
    }


def test_an_update_that_came_before_a_tied_gradient_waits_for_the_norm() -> None:
    """On the V's rank 0 the head's stage (3) closed before the embedding's tied gradient came
    in (``3U0 0RG0``): its norm would have missed the head's share."""
    spec = PipelineSpec("zbv", ((0,), (1,), (1,), (0,)), 4, 1, tied=((0, 3),))
    assert "3SG0 3U0 0RG0 0U0 0SW1" in _tables(spec)[0]
    clipped = _tables(
        PipelineSpec("zbv", ((0,), (1,), (1,), (0,)), 4, 1, tied=((0, 3),), global_norm=True)
    )
    assert "3SG0 0RG0 0C0 3U0 0U0 0SW1" in clipped[0]
    assert clipped[1].endswith("1W3 1C0 2U0 1U0")


def test_replicas_average_before_the_norm() -> None:
    spec = PipelineSpec("1f1b", ((0, 1), (2, 3)), 1, 2, global_norm=True)
    assert _tables(spec)[3] == "1RF1 1F1 1B1 1SB1 1A0 1C0 1U0"


@pytest.mark.parametrize("schedule", sorted(n for n, s in SCHEDULES.items() if not s.asynchronous))
def test_every_flush_schedule_clips_in_valid_tables(schedule: str) -> None:
    placement = SCHEDULES[schedule].placement
    for ranks in (1, 2, 4):
        for copies in (1, 2):
            for m in (4, 8):
                stages = 2 * ranks if placement else ranks
                where = placement(stages, ranks) if placement else list(range(stages))
                stage_ranks = tuple(
                    tuple(where[s] + ranks * j for j in range(copies)) for s in range(stages)
                )
                tied = ((0, stages - 1),) if stages > 1 else ()
                spec = PipelineSpec(
                    schedule, stage_ranks, m, 2 * copies, tied=tied, global_norm=True
                )
                tables = build_tables(spec)
                validate_tables(spec, tables)
                for rank, table in tables.items():
                    clips = [a.index for a in table if a.op is Op.CLIP]
                    assert clips == [0, 1], (schedule, rank, clips)


def test_plans_that_cannot_clip_say_why() -> None:
    for schedule in ("pipedream", "pipedream-vs", "2bw"):
        with pytest.raises(ScheduleError, match="whole model's gradient of a minibatch never"):
            PipelineSpec(
                schedule, ((0,), (1,)), 2 if schedule == "2bw" else 1, 2, global_norm=True
            ).validate()
    spec = PipelineSpec("1f1b", ((0, 1), (2,)), 2, 2, global_norm=True)
    assert (
        "the same number of replicas; this plan's stages have [2, 1]: plan with --straight"
        in global_norm_problem(spec)
    )


def test_the_checks_catch_an_update_before_its_norm_and_a_norm_nobody_asked_for() -> None:
    spec = PipelineSpec("1f1b", ((0,), (1,)), 1, 1, global_norm=True)
    tables = build_tables(spec)
    table = tables[1]
    c, u = table.index(Action(Op.CLIP, 1, 0)), table.index(Action(Op.UPDATE, 1, 0))
    table[c], table[u] = table[u], table[c]
    with pytest.raises(ScheduleError, match="1U0 before the clip of update 0"):
        validate_tables(spec, tables)
    plain = PipelineSpec("1f1b", ((0,), (1,)), 1, 1)
    with pytest.raises(ScheduleError, match="a gradient clip in a run that does not clip"):
        validate_tables(plain, build_tables(spec))


def test_the_norm_adds_squares_in_float32() -> None:
    grads = [torch.full((4,), 3.0, dtype=torch.bfloat16), torch.full((1,), 4.0)]
    total = sum_of_squares(grads, torch.device("cpu"))
    assert total.dtype == torch.float32 and float(total) == 52.0
    norm, factor = clip_factor(torch.tensor(25.0), 1.0)
    assert float(norm) == 5.0 and float(factor) == pytest.approx(1 / (5 + 1e-6))
    assert float(clip_factor(torch.tensor(0.25), 1.0)[1]) == 1.0  # below the norm: unchanged


@pytest.mark.parametrize(
    ("schedule", "placement", "replicas"),
    [
        ("1f1b", None, None),
        ("gpipe", None, None),
        ("zb-h1", None, None),
        ("1f1b", None, [2, 2, 2, 2]),
        ("interleaved-1f1b", [0, 1, 0, 1], None),
        ("zbv", [0, 1, 1, 0], None),  # the owner and its copy on rank 0
        ("zbv", [0, 1, 1, 0], [2, 2, 2, 2]),
    ],
)
def test_a_clipped_pipeline_equals_a_plain_loop_with_clip_grad_norm(
    schedule: str, placement: list[int] | None, replicas: list[int] | None
) -> None:
    """The tied GPT: the head's gradient reaches the embedding's owner before the norm, every
    tensor counts once (the tied one at its owner, a replicated stage at one replica)."""
    m, steps = 2, 4
    got = reference_layout_weights(
        "gpt", ARGS, FOUR, schedule=schedule, microbatches=m, steps=steps,
        microbatch_size=MICROBATCH, placement=placement, replicas=replicas, clip=MAX_NORM,
    )  # fmt: skip
    copies = replicas[0] if replicas else 1
    want = plain_tied_training(steps=steps, microbatches=m, copies=copies, clip=MAX_NORM)
    want["head.weight"] = want["embed.tok.weight"]
    assert max_rel_diff(got, want) < 1e-5
    unclipped = plain_tied_training(steps=steps, microbatches=m, copies=copies)
    unclipped["head.weight"] = unclipped["embed.tok.weight"]
    assert max_rel_diff(unclipped, want) > 0.1  # the clip changed the training


def test_train_refuses_a_bad_norm_and_a_plan_that_cannot_clip(tmp_path: Path) -> None:
    plan = write_plan(
        straight_plan("mlp", [["0"], ["1"]], schedule="pipedream"), tmp_path / "p.yaml"
    )
    for bad in ("0", "-1", "nan"):
        result = run_main("train", str(plan), "--steps", "1", "--clip-grad-norm", bad)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            "pipedream train: error: --clip-grad-norm must be a finite positive number, got "
            f"{bad}; e.g. --clip-grad-norm 1.0 (leave it out not to clip)"
        ]
    result = run_main("train", str(plan), "--steps", "1", "--clip-grad-norm", "1")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        "pipedream train: error: --clip-grad-norm 1: schedule 'pipedream' updates each stage while"
    )
    assert line.endswith(
        "(1f1b, gpipe, interleaved-1f1b, zb-h1, zbv): plan with --schedule 1f1b, or set "
        "schedule: 1f1b in the plan"
    )


def test_a_float64_model_clips_in_float64() -> None:
    """The norm was summed with ``_foreach_norm(..., dtype=float32)``, which refuses to narrow
    float64: every rank of a float64 model failed at its first clip."""
    args = {"dtype": "float64"}
    stages = [["0", "1"], ["2", "3", "4"]]
    got = reference_layout_weights(
        "dtype_model:build", args, stages, schedule="1f1b", microbatches=2, steps=3,
        microbatch_size=4, clip=0.1,
    )  # fmt: skip
    want, _ = plain_loop(
        "dtype_model:build", args, steps=3, microbatches=2, microbatch_size=4, clip=0.1
    )
    assert {tensor.dtype for tensor in got.values()} == {torch.float64}
    assert max_rel_diff(got, want) < 1e-12
    total = sum_of_squares([torch.full((2,), 3.0, dtype=torch.float64)], torch.device("cpu"))
    assert total.dtype == torch.float64 and float(total) == pytest.approx(18.0, rel=1e-15)


def test_one_stage_clips_under_any_schedule() -> None:
    """Plain data parallelism (one stage, two replicas) is what ``plan`` gives one worker or
    a few by default, under ``pipedream``: it was refused for "earlier stages" it has none of."""
    for schedule in ("pipedream", "2bw"):
        assert global_norm_problem(PipelineSpec(schedule, ((0, 1),), 2, 2, global_norm=True)) == ""
    got = reference_layout_weights(
        "gpt", ARGS, [LAYERS], schedule="pipedream", microbatches=1, steps=4,
        microbatch_size=MICROBATCH, replicas=[2], clip=MAX_NORM,
    )  # fmt: skip
    want = plain_tied_training(steps=4, microbatches=1, copies=2, clip=MAX_NORM)
    want["head.weight"] = want["embed.tok.weight"]
    assert max_rel_diff(got, want) < 1e-5


def test_simulating_a_clipped_runs_traces_notes_what_the_simulation_leaves_out() -> None:
    from pipedream.formats.trace import RankTrace, TraceEvent
    from pipedream.optimizer.simulate_command import run_settings_notes

    def trace(*actions: str) -> RankTrace:
        events = []
        for action in actions:
            parsed = parse_action(action)
            events.append(TraceEvent(action, parsed.op, parsed.stage, parsed.index, 0.0, 1.0))
        return RankTrace(0, 0, 1, tuple(events), "t.json")

    plan: Any = SimpleNamespace(recompute=False)
    profile: Any = SimpleNamespace(precision="fp32")
    assert run_settings_notes([trace("0F0", "0B0", "0U0")], profile, plan, "runs/a") == []
    assert run_settings_notes([trace("0F0", "0B0", "0C0", "0U0")], profile, plan, "runs/a") == [
        "note: every update of the run in runs/a waited for the whole model's gradient norm "
        "(--clip-grad-norm, or fp16's loss scale): the simulation leaves out that allreduce "
        "over all ranks, one number per update"
    ]
