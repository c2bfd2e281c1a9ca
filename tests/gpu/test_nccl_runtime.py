"""The NCCL path with a GPU per rank (``--device cuda``): pipelines, replicated stages and split
backwards against the reference executor, a V schedule (payloads needed in another order than
sent) against the same run on gloo, messages larger than NCCL's buffers, and a pipeline's
steady state without a host synchronisation on any rank. Each test needs as many GPUs as its
plan has ranks and is skipped, naming how many it needs, where the machine has fewer (one GPU
runs the rest of the tier).

Tolerance: the reference executor runs the same action tables in one process on the CPU, whose
kernels sum in another order than cuBLAS's deterministic ones: 1e-4 (as the shared-GPU
schedules in ``test_cuda_runtime.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from counting_syncs import NONE, count_syncs
from launching import straight_plan, write_plan
from reference_run import reference_weights
from runs import max_rel_diff, train_and_load

SGD = {"layers": "3", "width": "16", "lr": "0.2", "optimizer": "sgd", "momentum": "0.5"}
TWO = [["0", "1"], ["2", "3"]]
THREE = [["0"], ["1"], ["2", "3"]]


def _needs_gpus(count: int) -> None:
    have = torch.cuda.device_count()
    if have < count:
        pytest.skip(f"needs {count} GPUs for {count} NCCL ranks; this machine has {have}")


@pytest.mark.parametrize(
    ("stages", "replicas", "schedule", "m"),
    [
        (TWO, [1, 1], "pipedream", 1),
        (TWO, [1, 1], "zb-h1", 4),  # split backwards
        (TWO, [1, 2], "1f1b", 2),  # a replicated last stage: the bucketed allreduce on NCCL
        (THREE, [2, 1, 1], "pipedream", 1),  # replicas under PipeDream's warm-up rule
    ],
    ids=["pipedream-2", "zb-h1-2", "1f1b-1-2", "pipedream-2-1-1"],
)
def test_nccl_pipelines_equal_the_reference_executor(
    tmp_path: Path, stages: list[list[str]], replicas: list[int], schedule: str, m: int
) -> None:
    _needs_gpus(sum(replicas))
    steps = 6
    got = train_and_load(
        tmp_path,
        stages,
        steps=steps,
        schedule=schedule,
        microbatches=m,
        replicas=replicas,
        workload_args=SGD,
        extra=("--device", "cuda", "--deterministic"),
    )
    want, _ = reference_weights(
        stages, replicas, schedule=schedule, microbatches=m, steps=steps, workload_args=SGD
    )
    assert max_rel_diff(got, want) < 1e-4


def test_a_v_schedule_on_nccl_equals_the_same_run_on_gloo(tmp_path: Path) -> None:
    """zbv on two GPUs: each rank sends the other activations and gradients of two stage
    pairs, in an order that differs from the one the other needs them in (NCCL pairs payloads
    in send order: the transport reads headers ahead). Against the same plan on gloo, whose
    run the CPU tier checks against the schedule's rule."""
    _needs_gpus(2)
    stages = [["0"], ["1"], ["2"], ["3"]]
    runs = {
        device: train_and_load(
            tmp_path,
            stages,
            steps=6,
            schedule="zbv",
            microbatches=4,
            workload_args=SGD,
            placement=(0, 1, 1, 0),
            extra=("--device", device, *(("--deterministic",) if device == "cuda" else ())),
            name=f"zbv-{device}",
        )
        for device in ("cuda", "cpu")
    }
    assert max_rel_diff(runs["cuda"], runs["cpu"]) < 1e-4


def test_an_nccl_pipeline_with_large_messages_finishes(tmp_path: Path) -> None:
    """64 MiB activations and gradients, larger than NCCL buffers a send: such a send waits
    on the GPU for its receive. In a 1F1B steady state both ranks send before they receive, so
    with both directions on one communicator (one stream) each receive queued behind its own
    rank's send and the pipeline hung; each direction has its own since."""
    _needs_gpus(2)
    args = {"layers": "3", "width": "2048", "samples": str(8192 * 4 * 3), "lr": "1e-4"}
    got = train_and_load(
        tmp_path,
        [["0", "1"], ["2", "3"]],
        steps=3,
        schedule="1f1b",
        microbatches=4,
        microbatch_size=8192,  # 8192 x 2048 fp32: 64 MiB a message
        workload_args=args,
        extra=("--device", "cuda"),
    )
    assert all(torch.isfinite(tensor).all() for tensor in got.values())


def test_an_nccl_pipeline_never_waits_for_the_gpu_between_updates(tmp_path: Path) -> None:
    """Two stages on two GPUs (1F1B, four microbatches a minibatch, bf16): between two updates
    neither rank synchronises with its GPU (device, stream, blocking copy or event, counted by
    PyTorch's GPU trace, ``tests/support/counting_syncs.py``). Their messages' payloads go
    over NCCL with stream waits and their headers over gloo as host tensors. The first
    minibatch (NCCL connects lazily) and the end of the run may synchronise."""
    _needs_gpus(2)
    steps = 10
    args = {"layers": "2", "dim": "64", "heads": "4", "seq": "32", "samples": "512"}
    plan = straight_plan(
        "gpt",
        [["embed", "h0"], ["h1", "norm", "head"]],
        schedule="1f1b",
        microbatches=4,
        workload_args=args,
    )
    result, ranks = count_syncs(
        tmp_path,
        write_plan(plan, tmp_path / "plan.yaml"),
        *("--steps", str(steps), "--run-dir", str(tmp_path / "run"), "--device", "cuda"),
        *("--precision", "bf16", "--no-progress", "--timeout", "60"),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 nccl processes, one GPU each" in result.stderr
    for rank in ranks:
        assert rank.between_updates[1:] == [NONE] * (steps - 2)
