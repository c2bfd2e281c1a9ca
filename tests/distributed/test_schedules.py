"""Every schedule on gloo against its update rule (docs/schedules.md), computed independently in
one process with plain autograd (tests/support/oracles.py).

A launch costs seconds of process start, so each checks several things: the rule with a
stateful optimizer (momentum, Adam, AdamW), with recomputation where it is on, and either a
checkpoint mid-run (the pipeline drains there, and a run resumed from that checkpoint must end
on the very same bits) or ``--trace`` (every action of every rank's table exactly once, merged
by ``pipedream trace``). More shapes of every schedule run in one process against the same
rules (tests/unit/test_schedule_rules.py).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from pipedream.data import MicrobatchStream
from pipedream.formats.plan import load_plan
from pipedream.formats.trace import CATEGORIES, load_traces
from pipedream.optimizer.measured import message_times
from pipedream.runtime.checkpoint import load_full_state_dict
from pipedream.runtime.receive_buffers import MIN_POOLED_BYTES
from pipedream.runtime.trace_plot import matplotlib_available
from pipedream.schedules import SCHEDULES, build_tables, spec_from_plan
from pipedream.workload import load_workload

from launching import run_main, straight_plan, write_plan
from oracles import plain_training, stale_oracle
from rules import rule
from runs import even_groups, max_rel_diff, train_and_load
from workers import run_plan

pytestmark = pytest.mark.slow  # launches processes: not in the fast lane (-m "not slow")

B = 8
STEPS = 8
SGD = {"layers": "5", "width": "16", "lr": "0.2"}
MOMENTUM = {"layers": "5", "width": "16", "optimizer": "sgd", "lr": "0.1", "momentum": "0.9"}
ADAM = {"layers": "5", "width": "16", "optimizer": "adam", "lr": "0.01"}
ADAMW = {"layers": "5", "width": "16", "optimizer": "adamw", "lr": "0.01"}


@dataclass(frozen=True)
class Case:
    schedule: str
    num_stages: int
    microbatches: int
    args: dict[str, str] = field(default_factory=lambda: dict(SGD))
    recompute: bool = False
    resume: bool = False
    """Checkpoint at STEPS / 2 and resume from it (else: no checkpoint mid-run, --trace)."""
    seed: int = 0
    placement: tuple[int, ...] | None = None
    """The rank of every stage, where ranks run several stages (interleaved, V)."""


CASES = [
    Case("pipedream", 4, 1, MOMENTUM, resume=True, seed=3),
    Case("pipedream-vs", 3, 1, ADAMW, recompute=True),
    Case("2bw", 3, 4, ADAM, recompute=True, resume=True),
    Case("1f1b", 4, 3, MOMENTUM, recompute=True, resume=True),
    Case("gpipe", 3, 2, ADAMW),
    Case("zb-h1", 3, 4, ADAM, recompute=True, resume=True),
    Case("zb-h1", 4, 3, MOMENTUM),
    Case("interleaved-1f1b", 4, 2, ADAM, resume=True, placement=(0, 1, 0, 1)),
    Case("zbv", 4, 3, MOMENTUM, recompute=True, placement=(0, 1, 1, 0)),
]


def _launch(tmp: Path, case: Case, name: str, *extra: str) -> Path:
    names = [n for n, _ in load_workload("mlp", case.args).model.named_children()]
    plan = straight_plan(
        "mlp", even_groups(names, case.num_stages), schedule=case.schedule,
        microbatch_size=B, microbatches=case.microbatches, workload_args=case.args,
    )  # fmt: skip
    if case.placement is not None:
        for stage, rank in zip(plan["stages"], case.placement):
            stage["ranks"] = [rank]
        plan["world_size"] = len(set(case.placement))
    path = write_plan(plan, tmp / "plan.yaml")
    run_dir = tmp / name
    options = ["--steps", str(STEPS), "--seed", str(case.seed), "--run-dir", str(run_dir)]
    options += ["--recompute"] if case.recompute else []
    result = run_plan(path, *options, "--timeout", "60", "--no-progress", *extra)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


@pytest.mark.parametrize("case", CASES, ids=[c.schedule for c in CASES])
def test_schedule_equals_its_rule(tmp_path: Path, case: Case) -> None:
    segment = STEPS // 2 if case.resume else 0
    extra = ("--checkpoint-every", str(segment)) if case.resume else ("--trace",)
    run_dir = _launch(tmp_path, case, "run", *extra)
    got = load_full_state_dict(run_dir / "checkpoints" / f"step-{STEPS:06d}")

    workload = load_workload("mlp", case.args)
    data = MicrobatchStream(workload.dataset, B, case.seed)
    m = case.microbatches
    stages = even_groups([n for n, _ in workload.model.named_children()], case.num_stages)

    def oracle(staleness):
        fresh = load_workload("mlp", case.args)
        return stale_oracle(
            fresh.model, stages, num_minibatches=STEPS,
            minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
            loss_fn=fresh.loss_fn, staleness=staleness, optimizer=fresh.optimizer,
        )  # fmt: skip

    assert max_rel_diff(got, oracle(rule(case.schedule, case.num_stages, segment=segment))) < 1e-5
    if SCHEDULES[case.schedule].flushes:  # ordinary training on the whole minibatch
        plain = plain_training(
            load_workload("mlp", case.args).model, num_updates=STEPS,
            batch=lambda k: tuple(  # type: ignore[arg-type]
                torch.cat(p) for p in zip(*(data.microbatch(k * m + j) for j in range(m)))
            ),
            loss_fn=workload.loss_fn, optimizer=workload.optimizer,
        )  # fmt: skip
        assert max_rel_diff(got, plain) < 1e-5
    else:  # the staleness is real
        assert max_rel_diff(got, oracle(lambda t, s: t)) > 1e-4

    if case.resume:  # from the checkpoint at STEPS / 2: the same bits at the end
        half = run_dir / "checkpoints" / f"step-{segment:06d}"
        resumed = _launch(tmp_path, case, "resumed", "--resume", str(half))
        again = load_full_state_dict(resumed / "checkpoints" / f"step-{STEPS:06d}")
        assert all(torch.equal(got[k], again[k]) for k in got)
    else:
        _check_trace(tmp_path, run_dir)


def _check_trace(tmp: Path, run_dir: Path) -> None:
    """Every action of every rank's table once, in table order, with the time spent posting
    and reclaiming before it; every message paired; a valid merged Chrome trace."""
    plan = load_plan(tmp / "plan.yaml")
    tables = build_tables(spec_from_plan(plan, 0, STEPS))
    traces = load_traces(run_dir)
    assert [t.rank for t in traces] == sorted(tables)
    for trace in traces:
        recorded = [event.action for event in trace.events]
        assert recorded == [str(action) for action in tables[trace.rank]], f"rank {trace.rank}"
        assert max(Counter(recorded).values()) == 1
        starts = [event.start for event in trace.events]
        assert starts == sorted(starts)
        assert all(event.end >= event.start for event in trace.events)
        for previous, event in zip(trace.events, trace.events[1:]):
            assert event.posting is not None and event.reclaiming is not None
            assert 0 <= event.posting + event.reclaiming <= event.start - previous.end + 1e-6
        if any(event.op.value in ("RF", "RB") for event in trace.events):  # posted ahead
            assert sum(event.posting or 0.0 for event in trace.events) > 0
    sends = [a for table in tables.values() for a in table if a.op.value in ("SF", "SB")]
    messages = message_times(traces, plan)
    assert len(messages) == len(sends)
    assert all(message.sent_ms <= message.received_ms for message in messages)

    png = tmp / "timeline.png"
    merged = run_main("trace", str(run_dir), "-o", str(tmp / "merged.json"), "--png", str(png))
    if not matplotlib_available():
        assert merged.returncode == 2 and "matplotlib" in merged.stderr
        merged = run_main("trace", str(run_dir), "-o", str(tmp / "merged.json"))
    assert merged.returncode == 0, merged.stderr
    events = json.loads((tmp / "merged.json").read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(len(table) for table in tables.values())
    assert {e["cat"] for e in complete} <= set(CATEGORIES.values())
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {t.rank: f"rank {t.rank} (stage {t.stage})" for t in traces}
    if matplotlib_available():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_stage_replicated_is_data_parallel(tmp_path: Path) -> None:
    """3 replicas of the whole model = single-process training on the combined batch."""
    replicas, steps = 3, 6
    names = [n for n, _ in load_workload("mlp", SGD).model.named_children()]
    got = train_and_load(tmp_path, [names], steps=steps, replicas=[replicas], workload_args=SGD)
    data = MicrobatchStream(load_workload("mlp", SGD).dataset, B, 0)
    workload = load_workload("mlp", SGD)
    want = plain_training(
        workload.model, num_updates=steps // replicas,
        batch=lambda k: tuple(  # type: ignore[arg-type]
            torch.cat(p) for p in zip(*(data.microbatch(k * replicas + j) for j in range(replicas)))
        ),
        loss_fn=workload.loss_fn, optimizer=workload.optimizer,
    )  # fmt: skip
    assert max_rel_diff(got, want) < 1e-5


@pytest.mark.parametrize(("schedule", "m"), [("pipedream", 1), ("1f1b", 4)])
def test_large_messages_in_reused_buffers_follow_the_rule(
    tmp_path: Path, schedule: str, m: int
) -> None:
    """Microbatches of 2,048 samples: every activation and gradient is 128 KiB, so the
    receiving stages take their buffers from the pool of released storage
    (runtime/receive_buffers.py), with several microbatches and weight versions in flight."""
    big, num_stages, steps = 2048, 3, 5
    assert big * int(SGD["width"]) * 4 >= MIN_POOLED_BYTES
    workload = load_workload("mlp", SGD)
    stages = even_groups([n for n, _ in workload.model.named_children()], num_stages)
    got = train_and_load(
        tmp_path, stages, steps=steps, schedule=schedule, microbatch_size=big, microbatches=m,
        workload_args=SGD,
    )  # fmt: skip
    data = MicrobatchStream(workload.dataset, big, 0)
    want = stale_oracle(
        workload.model, stages, num_minibatches=steps,
        minibatch=lambda t: [data.microbatch(t * m + j) for j in range(m)],
        loss_fn=workload.loss_fn, staleness=rule(schedule, num_stages),
        optimizer=workload.optimizer,
    )  # fmt: skip
    assert max_rel_diff(got, want) < 1e-5
