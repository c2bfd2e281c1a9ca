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
at least the largest of those sums.

A schedule that flushes adds a bound of its own: the rank of a copy's first stage starts a
minibatch only once it has done its part of the previous one (the first forward needs the
updated weights, and a rank runs its table in order), so the time between two of its
minibatches is at least the longest chain from that first forward to the end of that rank's
part, with every rank running its table in order and every message taking its transfer and
latency but never waiting for a busy link. With ``r`` copies, each runs every ``r``-th
minibatch: per minibatch that is the chain over ``r``. :func:`minibatch_lower_bound`
is the largest of all of them. The sums leave out weight copies, tied parameters' messages,
postings and every wait, the chain weight copies, postings and every wait but a message's own
transfer, so the bound is below the steady state's time, often well below, but never above it
(``tests/unit/test_optimizer_bounds.py`` checks that on the original profiles' plans). A
candidate whose bound exceeds the fastest time simulated so far need not be simulated. (A run
too short for its steady state can average less, while a backlog of messages builds up; ruling
such a candidate out is right, as its steady state is slower.)

It holds for fixed times only: a simulation given a spread of forward and backward times, or
a network with a spread of message times, draws from it (for the latter the bound raises). In
a transfer pool (``unit_capacity``, ``duplex``, ``per_rank``) links and interfaces share
bandwidth rather than taking turns, and the bound counts compute, and messages their latency
alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from pipedream.formats.plan import Plan
from pipedream.optimizer.simulator import (
    NORM_BYTES,
    Network,
    StageWork,
    message_bytes,
    pipeline_edges,
    tied_pairs,
)
from pipedream.schedules import Action, Op, PipelineSpec, build_tables, lookup, spec_from_plan
from pipedream.schedules.validate import Message, message_of

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
    bound = max(max(rank_ms.values(), default=0.0), flush_chain_ms(plan, work, network))
    if _pooled(network):
        return bound
    bound = max(bound, max(link_ms.values(), default=0.0))
    if network.interface:
        bound = max(bound, max(interface_ms.values(), default=0.0))
    return bound


def flush_chain_ms(plan: Plan, work: Sequence[StageWork], network: Network) -> float:
    """Under a schedule that flushes, the longest chain of one minibatch's actions per copy,
    over the copies (module docstring); 0 for an asynchronous schedule, or stages replicated
    unequally (a stage's replicas then update at their own pace)."""
    copies = {placement.replicas for placement in plan.stages}
    if lookup(plan.schedule).asynchronous or len(copies) != 1:
        return 0.0
    (r,) = copies
    edges, tied = pipeline_edges(work), tied_pairs(work)
    spec = spec_from_plan(plan, 0, r, edges, tied)  # one minibatch per copy
    # a tied copy receives the new version before its first forward of the next minibatch:
    # in these tables, at their end, which in a longer run comes after the next one started
    tables = {
        rank: [action for action in table if action.op is not Op.RECV_WEIGHTS]
        for rank, table in build_tables(spec).items()
    }
    run = _ChainRun(tables, work, network, spec)
    run.finish()
    # a copy starts its next minibatch once its first stage's rank has done this one (that
    # rank's part ends with its allreduces and updates: nothing after them waits for another
    # rank); the other ranks may still be busy then (updates, deferred weight gradients)
    return max(run.clock[rank] for rank in spec.stage_ranks[0]) / r


def _pooled(network: Network) -> bool:
    """Whether transfers share bandwidth in a pool (their time is not the link's alone)."""
    return any(x is not None for x in (network.unit_capacity, network.duplex, network.per_rank))


class _ChainRun:
    """The tables run from time 0 with every wait left out but the tables' own order, the
    messages (each its transfer and latency, on a link of its own) and the allreduces: every
    action starts no later, after the first forward, than in a simulation, so each rank's
    end is the length of a chain from that forward."""

    def __init__(
        self,
        tables: dict[int, list[Action]],
        work: Sequence[StageWork],
        network: Network,
        spec: PipelineSpec,
    ) -> None:
        self.tables, self.work, self.network, self.spec = tables, work, network, spec
        self.clock = dict.fromkeys(tables, 0.0)
        self.position = dict.fromkeys(tables, 0)
        self.arrival: dict[Message, float] = {}
        self.allreduce: dict[tuple[int, int], dict[int, float]] = {}  # (stage, index) -> ranks

    def finish(self) -> None:
        """Run every table to its end (:attr:`clock`: when each rank's last action ends)."""
        moved = True
        while moved:
            moved = False
            for rank in self.tables:
                while self._step(rank):
                    moved = True
        stuck = [r for r, p in self.position.items() if p < len(self.tables[r])]
        assert not stuck, f"the tables deadlock at ranks {stuck}"  # built tables never do

    def _step(self, rank: int) -> bool:
        """Run ``rank``'s next action if it can start; whether it did."""
        table, position = self.tables[rank], self.position[rank]
        if position >= len(table):
            return False
        action = table[position]
        op, stage, now = action.op, action.stage, self.clock[rank]
        if op.is_receive:
            arrival = self.arrival.get(message_of(rank, action))
            if arrival is None:
                return False
            now = max(now, arrival)
        elif op.is_send:
            self.arrival[message_of(rank, action)] = now + self._message_ms(rank, action)
        elif op in (Op.ALLREDUCE, Op.CLIP):  # a clip: every rank adds one number
            among = stage if op is Op.ALLREDUCE else -1
            arrived = self.allreduce.setdefault((among, action.index), {})
            arrived[rank] = now
            members = self.spec.stage_ranks[stage] if op is Op.ALLREDUCE else sorted(self.tables)
            if len(arrived) < len(members):
                return False  # the last replica to arrive runs it for all
            end = max(arrived.values())
            size = self.work[stage].parameter_bytes if op is Op.ALLREDUCE else NORM_BYTES
            end += self.network.allreduce_ms(size, members)
            for member in members:
                self.clock[member] = end
                self.position[member] += 1
            return True
        else:
            now += self._compute_ms(action)
        self.clock[rank] = now
        self.position[rank] = position + 1
        return True

    def _message_ms(self, rank: int, action: Action) -> float:
        """From a send's start to its message's arrival, with a link of its own."""
        peer, peer_stage = action.peer, action.peer_stage
        assert peer is not None and peer_stage is not None
        if peer == rank:
            return 0.0  # handed over between two stages of the rank
        if _pooled(self.network):
            return self.network.latency_ms
        if action.op is Op.SEND_ACT:
            size = message_bytes(self.work, action.stage, peer_stage, gradient=False)
        elif action.op is Op.SEND_GRAD:
            size = message_bytes(self.work, peer_stage, action.stage, gradient=True)
        else:  # a tied parameter's gradient or new version
            size = self.work[action.stage].tied_bytes[peer_stage]
        return self.network.transfer_ms(size, rank, peer) + self.network.latency_ms

    def _compute_ms(self, action: Action) -> float:
        """A forward, backward (or half), or update, as the simulator times it, without the
        weight copy an update may add."""
        work, op = self.work[action.stage], action.op
        duration = work.action_ms(op)
        if op in (Op.BACKWARD, Op.BACKWARD_WEIGHT) and action.index % self.spec.microbatches:
            duration += work.accumulate_ms  # .grad holds the earlier ones
        return duration
