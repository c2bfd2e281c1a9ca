"""Memory per worker read off the action tables, for the schedules the closed forms miss.

:class:`~pipedream.optimizer.memory.MemoryModel` counts a stage's microbatches in flight with a
formula per schedule. Two kinds of schedule need the tables themselves:

* split backwards (``zb-h1``, ``zbv``): a microbatch holds its activations from its forward to
  its ``W``, not to its ``I``, and between the two also what ``I`` leaves for ``W`` (the
  gradients of the outputs of the modules whose weights wait). The runtime's ``I`` keeps the
  whole autograd graph for ``W``, so this counts a microbatch's activations until its ``W``,
  and the buffers as its activations once more: an upper bound (the buffers are the size of
  the weight modules' outputs; on a GPT block they measure about half its saved activations);
* several stages per rank (``interleaved-1f1b``, ``zbv``): a worker holds every one of its
  stages, and their microbatches peak together only as the rank's order has them.

So a worker holds, over the stages it runs::

    sum of (weights + gradients) x (parameters + tied copies) + optimizer state
    + the most activation (and W-buffer) bytes its table holds at once
      (:func:`~pipedream.schedules.unit_time.peak_held_bytes`)

With ``--recompute`` (``LayerCosts.recompute``) a forward holds only the stage's input until
its backward; the backward recomputes the activations and holds them while it runs (split:
from ``I``, which recomputes them, to ``W``, with the buffers ``I`` leaves for ``W`` counted
as activations once more, as above), so an unsplit backward adds its stage's activations to
the peak, one microbatch at a time. The first stage's input, from the data loader, is not in
the profile and counts as nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedream.formats.plan import Plan
from pipedream.optimizer.cost_model import LayerCosts
from pipedream.schedules import build_tables, lookup, spec_from_plan
from pipedream.schedules.unit_time import peak_held_bytes

__all__ = ["TABLE_MINIBATCHES", "worker_memory"]

TABLE_MINIBATCHES = 2
"""Minibatches per replica of the tables walked: the second starts as the first drains, where
a schedule that overlaps minibatches peaks."""


def worker_memory(
    plan: Plan, costs: LayerCosts, spans: Sequence[tuple[int, int]]
) -> dict[int, float]:
    """Estimated bytes per rank of ``plan``, whose stages hold layers ``spans[s]``
    (``first, last`` inclusive), from its action tables."""
    split = lookup(plan.schedule).splits_backward
    static: dict[int, float] = {}
    held: dict[int, float] = {}
    for stage, (first, last) in enumerate(spans):
        span = slice(first, last + 1)
        copies = costs.tied.copy_bytes(first, last) if costs.tied else 0.0
        weights = 2 * (sum(costs.parameter_bytes[span]) + copies)  # one version, gradients
        static[stage] = weights + sum(costs.optimizer_state_bytes[span])
        held[stage] = sum(costs.activation_bytes[span])
    recomputed = dict.fromkeys(held, 0.0)  # an unsplit backward's, while it runs
    if costs.recompute:
        activations = held
        held = {stage: costs.kept_input_bytes(first) for stage, (first, _) in enumerate(spans)}
        # split: I keeps the recomputed graph for W, and what it leaves for W as above
        deferred = {s: 2 * a for s, a in activations.items()} if split else dict.fromkeys(held, 0.0)
        recomputed = dict.fromkeys(held, 0.0) if split else activations
    else:
        deferred = held if split else dict.fromkeys(held, 0.0)
    every = plan.steps_multiple  # each replica gets its turns
    tables = build_tables(spec_from_plan(plan, 0, TABLE_MINIBATCHES * every))
    out = {}
    for rank, table in tables.items():
        stages = sorted({action.stage for action in table})
        out[rank] = (
            sum(static[s] for s in stages)
            + peak_held_bytes(table, held, deferred)
            + max(recomputed[s] for s in stages)
        )
    return out
