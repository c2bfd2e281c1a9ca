"""No host reads of device tensors in the steady state: on a GPU each one (``float(t)``,
``bool(t)``, ``t.item()``, ``t.tolist()``) waits for every kernel queued before it. Counted on
the CPU, where the same calls happen."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pipedream.runtime.loss_log import GPU_READ_EVERY, LossLog
from pipedream.runtime.metrics import MetricsLogger

import reference_run
from reference_run import reference_layout_weights  # looks run_reference up when called

READS = ("__bool__", "__float__", "__int__", "item", "tolist")


@contextmanager
def counting_reads() -> Iterator[list[str]]:
    reads: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str):
        original = originals[name]

        def counted(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return counted

    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def test_the_workers_never_read_a_tensor_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forwards, backwards, updates, tied copies and the routing of a 3-stage pipeline with
    plain SGD (whose step reads nothing): not one host read in 6 minibatches (building the
    workload, before the run, reads what it likes)."""
    args = {
        "layers": "2",
        "dim": "16",
        "heads": "2",
        "seq": "8",
        "vocab": "32",
        "samples": "64",
        "tie": "true",
        "optimizer": "sgd",
        "lr": "0.1",
    }
    stages = [["embed"], ["h0", "h1"], ["norm", "head"]]
    reads: list[str] = []
    run = reference_run.run_reference

    def counted(*args, **kwargs):
        with counting_reads() as during:
            run(*args, **kwargs)
        reads.extend(during)

    monkeypatch.setattr(reference_run, "run_reference", counted)
    reference_layout_weights(
        "gpt", args, stages, schedule="pipedream", microbatches=1, steps=6, microbatch_size=4
    )
    assert reads == []


def test_losses_are_read_in_batches_on_a_gpu(tmp_path) -> None:
    logger = MetricsLogger(tmp_path / "m.jsonl", total_steps=70, samples_per_step=1, progress=False)
    log = LossLog(logger, microbatches=1, device=torch.device("cuda"))  # no GPU needed to count
    with counting_reads() as reads:
        for step in range(70):
            log.add(step, [(step, torch.tensor(1.0 + step))])
    assert reads.count("tolist") == 70 // GPU_READ_EVERY and len(logger.losses) == 64
    log.read()
    assert logger.losses == [1.0 + step for step in range(70)]
    log.add(70, [(70, torch.tensor(float("nan")))])
    with pytest.raises(
        Exception, match=r"non-finite loss \(nan\) at microbatch 70 \(minibatch 70\)"
    ):
        log.read()
    cpu = LossLog(None, microbatches=2, device=torch.device("cpu"))
    with counting_reads() as reads:
        cpu.add(0, [(0, torch.tensor(1.0)), (1, torch.tensor(2.0))])
    assert reads == ["tolist"]  # on the CPU every update is read at once


def test_the_clipper_reads_nothing_on_the_host() -> None:
    """``--clip-grad-norm``: the norm, the factor and the scaling stay tensors (on a GPU,
    queued kernels); only the stage's first replica counts, every stage scales; a float64
    model sums in float64 (one process: no allreduce)."""
    from types import SimpleNamespace
    from typing import Any

    from pipedream.runtime.global_norm import ClipPart, GlobalNorm

    def worker(*values: float, dtype: torch.dtype = torch.float32) -> Any:
        grads = [torch.tensor([v], dtype=dtype) for v in values]
        return SimpleNamespace(present_gradients=lambda: grads)

    counted, other = worker(3.0, 4.0, dtype=torch.float64), worker(100.0)
    clipper = GlobalNorm(
        [ClipPart(counted, counted=True), ClipPart(other, counted=False)],  # type: ignore[arg-type]
        device=torch.device("cpu"),
        wait=lambda work, what: None,
        float64=True,
        max_norm=1.0,
    )
    with counting_reads() as reads:
        clipper.check(7, "the clip")
        norm = clipper.norm_of(7)
    assert reads == []
    assert norm is not None and norm.dtype == torch.float64 and float(norm) == 5.0
    assert clipper.norm_of(6) is None and not clipper.skips(7)
    scale = 1 / (5 + 1e-6)
    assert [float(g) for g in counted.present_gradients()] == pytest.approx([3 * scale, 4 * scale])
    assert float(other.present_gradients()[0]) == pytest.approx(100 * scale)
