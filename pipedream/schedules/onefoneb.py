"""``1f1b``: PipeDream-Flush, 1F1B within each minibatch and a flush after it.

Stage ``s`` runs ``min(S - 1 - s, m)`` warm-up forwards of the minibatch's ``m`` microbatches,
then alternates forwards and backwards, drains, and updates: synchronous SGD,
``W^(k+1) = W^(k) - eta * mean_i grad f_i(W^(k))``, exactly single-process training on
minibatches of ``m x microbatch_size``, with at most ``min(S - s, m)`` microbatches' activations
at a time::

    S = 2, m = 3:   stage 0:  F0 F1 B0 F2 B1 B2 U | F3 ...
                    stage 1:     F0 B0 F1 B1 F2 B2 U | ...
"""

from __future__ import annotations

from pipedream.schedules.pipedream import latest_version
from pipedream.schedules.schedule import Schedule, flushed_one_f_one_b

__all__ = ["ONE_F_ONE_B"]


ONE_F_ONE_B = Schedule(
    name="1f1b",
    summary="PipeDream-Flush: 1F1B and a flush after every minibatch; exact synchronous SGD",
    asynchronous=False,
    order=flushed_one_f_one_b,
    version=latest_version,
    in_flight=lambda m, stages_from, depth: min(stages_from, m),
    memory_key=lambda after, mult, m: min(after, m),
    versions_kept=1,
    auto_rank=0,
)
