"""A lower bound on a plan's simulated time per minibatch, from its work alone.

The simulator (:mod:`~pipedream.optimizer.simulator`) runs the action tables event by event;
the planner runs it for every candidate it compares, and on large clusters most of its time
goes there. Many of those candidates cannot win, which a sum shows without a simulation:
whatever the schedule, in a simulated run

* a rank runs its actions one at a time: per minibatch of a stage it holds a replica of, it
  spends ``m (F + B)`` on the microbatches, ``m - 1`` times the adding of a backward's
  gradients into ``.grad``, the update and, for a replicated stage, the allreduce, all
  times the share of minibatches that replica gets (``1/r``: minibatch ``t`` goes to
  replica ``t mod r``), plus the time posting its messages holds it;
* a link between two ranks carries one message at a time, either way: per minibatch it is
  busy for the transfers of all the activations and gradients between them;
* with an interface per rank and level (:attr:`~pipedream.optimizer.simulator.Network.interface`),
  a rank sends one message at a time and receives one at a time on each level.

Every minibatch needs that work, so in the steady state the time between two minibatches is
at least the largest of those sums (:func:`minibatch_lower_bound`). The bound leaves out
weight copies, tied parameters' messages, receive postings and every wait, so it is below
the steady state's time, often well below, but never above it
(``tests/unit/test_optimizer_bounds.py`` checks that on the original profiles' plans). A
candidate whose bound exceeds the fastest time simulated so far need not be simulated. (A run
too short for its steady state can average less, while a backlog of messages builds up; ruling
such a candidate out is right, as its steady state is slower.)

It holds for fixed times only: a simulation given a spread of forward and backward times, or
a network with a spread of message times, draws from it (for the latter the bound raises). In
a transfer pool (``unit_capacity``, ``duplex``, ``per_rank``) links and interfaces share
bandwidth rather than taking turns, and the bound counts compute alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from pipedream.formats.plan import Plan
from pipedream.optimizer.simulator import Network, StageWork, message_bytes, pipeline_edges

__all__ = ["BOUND_SLACK", "minibatch_lower_bound"]

BOUND_SLACK = 0.02
"""How far below a candidate's bound the fastest simulated time must lie before the planner
leaves the candidate out: a simulation ends once its runs agree within a tolerance
(:data:`~pipedream.optimizer.simulator.AVERAGE_TOLERANCE`), so the time it gives may lie a
little below its steady state's."""


def minibatch_lower_bound(plan: Plan, work: Sequence[StageWork], network: Network) -> float:
    """A lower bound on ``plan``'s simulated time per minibatch (ms) on ``network`` with the
    stages' ``work`` (module docstring)."""
    if network.message_spread is not None:
        raise ValueError("the bound holds for fixed message times; the network has a spread")
    m = plan.microbatches
    rank_ms: defaultdict[int, float] = defaultdict(float)  # compute and posting
    link_ms: defaultdict[tuple[int, int], float] = defaultdict(float)
    interface_ms: defaultdict[tuple[int, int, bool], float] = defaultdict(float)  # sending?
    for stage, placement in enumerate(plan.stages):
        w = work[stage]
        # one minibatch of a replica: its microbatches, then its update
        minibatch_ms = m * (w.forward_ms + w.backward_ms) + (m - 1) * w.accumulate_ms
        minibatch_ms += w.update_ms
        if placement.replicas > 1:
            minibatch_ms += network.allreduce_ms(w.parameter_bytes, placement.ranks)
        for rank in placement.ranks:
            rank_ms[rank] += minibatch_ms / placement.replicas
    edges = pipeline_edges(work) or tuple((s, s + 1) for s in range(len(work) - 1))
    for producer, consumer in edges:
        sources, targets = plan.stages[producer].ranks, plan.stages[consumer].ranks
        cycle = math.lcm(len(sources), len(targets))  # minibatches until the pairs repeat
        for t in range(cycle):
            a, b = sources[t % len(sources)], targets[t % len(targets)]
            if a == b:
                continue  # two stages of one rank hand the tensor over
            level = network.level_of((a, b))
            for sender, receiver, gradient in ((a, b, False), (b, a, True)):
                size = message_bytes(work, producer, consumer, gradient=gradient)
                transfer = network.transfer_ms(size, a, b) * m / cycle
                rank_ms[sender] += network.post_ms(size) * m / cycle
                link_ms[min(a, b), max(a, b)] += transfer
                interface_ms[sender, level, True] += transfer
                interface_ms[receiver, level, False] += transfer
    bound = max(rank_ms.values(), default=0.0)
    pooled = (network.unit_capacity, network.duplex, network.per_rank)
    if any(x is not None for x in pooled):
        return bound
    bound = max(bound, max(link_ms.values(), default=0.0))
    if network.interface:
        bound = max(bound, max(interface_ms.values(), default=0.0))
    return bound
