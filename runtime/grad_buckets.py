"""A replicated stage's gradient allreduce, in buckets, overlapped with its last backward.

The replicas of a stage average their gradients before every update. Done in one piece after
the whole backward, the allreduce waits for the last gradient and the backward waits for
nothing: the two never overlap. :class:`GradientBuckets` does what ``DistributedDataParallel``
does instead: the parameters are grouped into buckets of about :data:`BUCKET_BYTES` (the first
of :data:`FIRST_BUCKET_BYTES`), in the reverse of their order (a backward produces the last
layers' gradients first), and a bucket's allreduce starts, asynchronously, as soon as every
gradient in it is final, while the backward goes on with the earlier layers. The update's
allreduce action then only waits.

Each bucket's gradients are one buffer, summed in place by the allreduce; at the update each
``.grad`` is a view of its bucket. The updates set the gradients to None, so the first
microbatch of the next minibatch leaves autograd's own tensor in ``.grad`` (no add) and the
later ones add to it; a bucket copies its gradients in when it starts, and makes them views
again. That one copy costs less than keeping the views, which needs the gradients zeroed in
place after every update and the first microbatch's gradients added to the zeros: two passes
over the gradients' memory where the copy is one (about 1.4 ms a minibatch on the 34 MB of
``benchmarks/replicas_vs_ddp.py``'s model).

A gradient is final once it has been accumulated once per microbatch of the minibatch: each
backward (``B``, or the ``I`` or ``W`` half that computes it) adds it once. The worker reports
every accumulation (:meth:`accumulated`): autograd's post-accumulate hooks where a forward ran
on the live parameters, the worker itself where it adds a stashed version's gradients. What
never becomes final (a parameter no loss reaches, a microbatch skipped for a non-finite loss)
goes in :meth:`finish`. A bucket holds one dtype on one device (a change of either starts a
new one). Buckets start strictly in order, so every replica issues the same
collectives in the same order whatever its timing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "GradientBuckets"]

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per bucket (DistributedDataParallel's default ``bucket_cap_mb``)."""
FIRST_BUCKET_BYTES = 2**20
"""Bytes of the first bucket: small, so that the first allreduce starts early in the backward
(DistributedDataParallel does the same)."""


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: Tensor
    """The bucket's gradients, concatenated (reused from minibatch to minibatch)."""
    pending: set[int] = field(default_factory=set)
    """Indices (into ``params``) of the gradients not yet final."""
    work: Any = None
    """The allreduce in flight, once started."""


class GradientBuckets:
    """Averages the gradients of ``params`` over a replica group, bucket by bucket."""

    def __init__(
        self,
        params: Sequence[tuple[nn.Parameter, int]],
        group: Any,
        *,
        num_replicas: int,
        wait: Callable[[Any, str], None],
        bucket_bytes: int = BUCKET_BYTES,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        allreduce: Callable[[Tensor, Any], Any] | None = None,
    ) -> None:
        """``params``: each parameter with the accumulations that make its gradient final
        (the microbatches of a minibatch, plus one per stage that sends it a tied copy's
        gradient). ``wait(work, what)`` waits for one allreduce (a stream wait on NCCL, a host
        wait with the run's timeout on gloo) and raises when it fails; ``allreduce(flat,
        group)`` starts one (default: an asynchronous ``dist.all_reduce``, summing)."""
        self.group = group
        self.num_replicas = num_replicas
        self._final = {id(param): count for param, count in params}
        self._wait = wait
        self._allreduce = allreduce or _sum_async
        self._buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for param, _ in reversed(list(params)):  # the backward's order, roughly
            kind = (param.dtype, param.device)
            if current and (current[0].dtype, current[0].device) != kind:  # one dtype a bucket
                self._buckets.append(self._bucket(current))
                current, size = [], 0
            current.append(param)
            size += param.numel() * param.element_size()
            if size >= (first_bucket_bytes if not self._buckets else bucket_bytes):
                self._buckets.append(self._bucket(current))
                current, size = [], 0
        if current:
            self._buckets.append(self._bucket(current))
        self._where = {
            id(p): (b, i)
            for b, bucket in enumerate(self._buckets)
            for i, p in enumerate(bucket.params)
        }
        self._counts: dict[int, int] = {}
        self._started = 0  # buckets started, in order
        self._reset()

    @staticmethod
    def _bucket(params: list[nn.Parameter]) -> _Bucket:
        numel = sum(p.numel() for p in params)
        flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        bucket = _Bucket(list(params), flat)
        for param, view in zip(params, _views(bucket)):
            if param.grad is not None:
                view.copy_(param.grad)
            param.grad = view
        return bucket

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def _reset(self) -> None:
        self._counts = dict.fromkeys(self._where, 0)
        self._started = 0
        for bucket in self._buckets:
            bucket.pending = set(range(len(bucket.params)))
            bucket.work = None

    def accumulated(self, param: nn.Parameter) -> None:
        """One more microbatch's gradient was added to ``param.grad``."""
        key = id(param)
        if key not in self._where:
            return  # not averaged here (a copy of another stage's tied parameter)
        self._counts[key] += 1
        if self._counts[key] == self._final[key]:
            index, position = self._where[key]
            self._buckets[index].pending.discard(position)
            self._start_ready()

    def _start_ready(self) -> None:
        while self._started < len(self._buckets) and not self._buckets[self._started].pending:
            self._start(self._buckets[self._started])
            self._started += 1

    def _start(self, bucket: _Bucket) -> None:
        with torch.no_grad():
            for param, view in zip(bucket.params, _views(bucket)):
                if param.grad is None:  # no microbatch gave it a gradient
                    view.zero_()
                    param.grad = view
                elif param.grad.data_ptr() != view.data_ptr():  # autograd's own tensor: in
                    view.copy_(param.grad)
                    param.grad = view
        bucket.work = self._allreduce(bucket.flat, self.group)

    def finish(self, what: str) -> None:
        """Start what is left, wait for every bucket, and leave the mean in each ``.grad``."""
        for bucket in self._buckets[self._started :]:
            self._start(bucket)
        self._started = len(self._buckets)
        with torch.no_grad():
            for bucket in self._buckets:
                self._wait(bucket.work, what)
                bucket.flat /= self.num_replicas  # the gradients are views of it
        self._reset()


def _views(bucket: _Bucket) -> list[Tensor]:
    """Each parameter's stretch of the bucket's buffer, in its shape."""
    out, offset = [], 0
    for param in bucket.params:
        out.append(bucket.flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()
    return out


def _sum_async(flat: Tensor, group: Any) -> Any:
    return dist.all_reduce(flat, group=group, async_op=True)
