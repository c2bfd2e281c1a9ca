"""An event simulation of a plan's action tables: predicted timeline and time per minibatch.

It runs the very tables the runtime executes (:func:`pipedream.schedules.build_tables`)
with profiled costs instead of tensors:

* ``F``/``B``: the stage's summed forward/backward time of one microbatch (the first and the
  last stage's forward also read the microbatch's inputs and targets); ``U``: the optimizer
  step over the stage's parameters (the layers' ``update_ms``, 0 where the profile has none),
  plus a copy of the stage's weights when the version it creates is stashed (weight stashing,
  :mod:`~pipedream.schedules.versions`); every backward of a minibatch but its first also adds
  its gradients into ``.grad`` (``accumulate_ms``);
  each plus the runtime's own cost per action where the profile measured it (``overhead_ms``);
* the stages exchange what the runtime's wiring sends: with the profile's ``values`` a stage
  sends each later stage that uses them the values it makes (a skip connection is one message
  from its producer's stage straight to its consumer's) and gets their gradients back
  (:mod:`~pipedream.optimizer.stage_messages`); without them each stage sends the next the
  bytes live across its last layer's cut;
* a send is posted when the rank reaches it; posting holds the sender for ``send_ms`` plus
  ``send_ms_per_mib`` per MiB of the message (the runtime's main thread packs and hands it to
  the transport: on gloo that thread itself writes the first megabytes into the socket), an
  ``S`` event; the rank then goes on while the message moves. The message occupies the link
  between the two ranks (one link per pair, shared by activations and gradients, as PipeDream's
  cost model assumes) for ``bytes / bandwidth``, and arrives ``latency`` later; a receive waits
  for its message; the bandwidth of a pair is that of the innermost level both ranks share;
  with a ``unit_capacity`` the transfers touching one innermost unit (a host) also share that
  many bytes/s in total; with a ``duplex`` factor a link's two directions move at once and
  share that many times its bandwidth; with a ``per_rank`` factor the transfers touching one
  rank share that many times their link's bandwidth (:mod:`~pipedream.optimizer.transfers`);
  with an ``interface`` per rank and level a message also needs its sender's interface to
  send and its receiver's to receive (one message at a time each way): it takes the earliest
  window in which its link and both interfaces are free, after the messages sent before it
  the same way between its two ranks (:mod:`~pipedream.optimizer.busy`; in the transfer pool
  those through one direction of an interface share it);
* the runtime posts its receives ahead (on gloo), a few before each action by the rule of
  :mod:`~pipedream.schedules.posting`; posting one holds the receiving rank ``recv_ms`` there,
  an ``R`` event;
* before each action a rank waits until at most ``messages_in_flight`` of its sent messages
  have not left it, as the runtime reclaims its send buffers (the plan's
  :class:`~pipedream.schedules.Posting`, as the runtime chooses it:
  :func:`~pipedream.schedules.plan_posting`); a message leaves its sender when its transfer
  ends; a ``W`` event;
* ``A``: the replicas of a stage wait for each other, then spend a hierarchical ring allreduce
  ``sum over levels of 4 (k - 1) / k * P / (bandwidth * workers below)``, ``k`` the replicas'
  units at that level (one level: the cost model's ``4 (r - 1) P / (bandwidth r)``).

With a ``spread`` (:class:`~pipedream.formats.PassSpread`, how much the profiler's whole passes
varied), every forward and backward takes its time times a ratio drawn from the spread (seeded:
the same run every time): a stage that runs late holds up its neighbours, which fixed times do
not show, so a pipeline of varying stages is slower than one of their means. With a
``message_spread`` (:attr:`Network.message_spread`), every message's transfer likewise moves
its bytes times a ratio drawn from it: on a loaded host the time of one message differs from
the next's, and a late message holds up its receiver as a late stage does.

Actions run in global time order (a heap), so link contention is first come, first served.
The time per minibatch is the steady-state slope of the minibatches' completion times (the end
of their last backward at stage 0). The steady state is periodic, but its cycle can span
several minibatches even without replicas: with messages slower than compute, PipeDream's
``S`` minibatches in flight settle into a pattern such as 3 ms, 7 ms, 3 ms, 7 ms, and a
backlog of transfers can take dozens of minibatches to build up. So the slope is measured over
the second half of the run between the fill and the drain (each ``S`` times the replica
pattern's period, a bound on the minibatches in flight), over whole repetitions of the
shortest cycle (a multiple of that period) all of whose repetitions there take the same time
(:func:`steady_window`); without a length given, the simulation doubles the minibatches until
such a cycle shows, or until the average over that window, where none shows (transfers that
share a host or an interface in the transfer pool can keep a pipeline from ever repeating
itself exactly), moves by less than :data:`AVERAGE_TOLERANCE` from one run to the next. With
either spread there is no cycle: the time is the mean over the last
:data:`SPREAD_MINIBATCHES` minibatches before the drain, after as many more past the fill (a
backlog of transfers can take that long to build up).
Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipedream.errors import PlanningError
from pipedream.formats.plan import Plan
from pipedream.formats.profile import ActionOverhead, PassSpread, Profile
from pipedream.formats.topology import Topology
from pipedream.optimizer.busy import BusyTimes
from pipedream.optimizer.messages import MessageTime, message_kind
from pipedream.optimizer.stage_messages import stage_messages, stages_of_layers
from pipedream.optimizer.transfers import Transfer, TransferPool
from pipedream.schedules import (
    RECEIVE_WINDOW,
    Action,
    Op,
    PipelineSpec,
    Posting,
    build_tables,
    plan_posting,
    receives_posted_before,
    spec_from_plan,
    version_use,
)
from pipedream.schedules.validate import Message, message_of

__all__ = [
    "NORM_BYTES",
    "Event",
    "Network",
    "StageWork",
    "Timeline",
    "default_steps",
    "jittered",
    "message_bytes",
    "pipeline_edges",
    "simulate",
    "stage_work",
    "steady_window",
    "tied_bytes",
    "tied_pairs",
]

NORM_BYTES = 4.0
"""What a gradient clip's allreduce moves: one float32, a rank's squared gradient norm."""


@dataclass(frozen=True)
class StageWork:
    """What one stage costs per microbatch."""

    forward_ms: float
    """Forward time of the stage's layers."""
    backward_ms: float
    """Backward time of the stage's layers."""
    parameter_bytes: float
    """Parameters allreduced among the stage's replicas."""
    output_bytes: float
    """Activation bytes sent to the next stage (and gradient bytes received back), where
    ``sends`` is None."""
    update_ms: float = 0.0
    """Optimizer step over the stage's parameters."""
    copy_ms: float = 0.0
    """Copying the stage's parameters once (added to an update that creates a stashed version)."""
    accumulate_ms: float = 0.0
    """Adding one microbatch's gradients into ``.grad`` (every backward of a minibatch but its
    first)."""
    input_share: float = 0.5
    """The share of ``backward_ms`` that is the input-gradient half (I) where a schedule splits
    backwards; the weight-gradient half (W) is the rest. Half: a layer's weight gradient and
    its input gradient are one matrix product each of the same size."""
    tied_bytes: Mapping[int, float] = field(default_factory=dict)
    """Other stage -> bytes of the tied parameters this stage shares with it (owned by the
    earlier of the two): the copies' gradients go to the owner and every new version back,
    once per update each."""
    sends: Mapping[int, tuple[float, float]] | None = None
    """Later stage -> (activation bytes sent to it, gradient bytes it sends back) per
    microbatch, for a pipeline wired by the profile's values; None: the next stage only, with
    ``output_bytes`` each way."""

    def action_ms(self, op: Op) -> float:
        """A forward, backward (or one of its halves) or update of this stage, as profiled:
        before a spread, the adding of its gradients into ``.grad`` or a weight copy."""
        return {
            Op.FORWARD: self.forward_ms,
            Op.BACKWARD: self.backward_ms,
            Op.BACKWARD_INPUT: self.backward_ms * self.input_share,
            Op.BACKWARD_WEIGHT: self.backward_ms * (1 - self.input_share),
            Op.UPDATE: self.update_ms,
        }[op]


@dataclass(frozen=True)
class Network:
    """Bandwidths between ranks from the cluster's levels (innermost first)."""

    unit_sizes: tuple[int, ...]
    """Workers in one unit of each level (cumulative products of the levels' ``workers``)."""
    bandwidths: tuple[float, ...]
    """Bandwidth between the units of the level below, bytes/s, per level."""
    latency_ms: float = 0.0
    """Added to every message's arrival."""
    unit_capacity: float | None = None
    """Bytes/s that all transfers touching one innermost unit share (a host copying loopback
    messages with its CPUs, a server's network card); None: every link is independent."""
    send_ms: float = 0.0
    """Time posting one message holds the sending rank (its fixed part)."""
    send_ms_per_mib: float = 0.0
    """Time posting one message holds the sending rank, per MiB of the message."""
    duplex: float | None = None
    """What one link moves in both directions together, in multiples of its bandwidth: messages
    in opposite directions then move at once and share it (1: they share the link, 2: full
    duplex); None: a link carries one message at a time, either way."""
    recv_ms: float = 0.0
    """Time posting one receive ahead holds the receiving rank (gloo; NCCL posts none)."""
    per_rank: float | None = None
    """What one rank's transport moves in and out together, in multiples of a link's bandwidth
    (gloo: one thread per process carries all its messages, 1); None: no limit per rank."""
    interface: bool = False
    """Whether every rank has a network interface per level, as fast as that level's links,
    that sends one message at a time and receives one at a time: a message takes the earliest
    window in which its link and its sender's and receiver's interfaces are free, after the
    messages sent before it the same way between its two ranks; in a transfer pool
    (``unit_capacity``, ``duplex`` or ``per_rank``) the transfers through one direction of an
    interface share its bandwidth instead. False: every link on its own, one message at a
    time, first come first served."""
    message_spread: tuple[float, ...] | None = None
    """Ratios of one message's transfer time to the calibrated one (e.g. each repeat of a
    calibration over their median): every message moves its bytes times one drawn from them,
    as if that much bigger (its link and its host's capacity carry that many); None: every
    message moves exactly its bytes."""

    def __post_init__(self) -> None:
        assert self.send_ms >= 0 and self.send_ms_per_mib >= 0, (self.send_ms, self.send_ms_per_mib)
        assert self.recv_ms >= 0, self.recv_ms
        assert self.duplex is None or 1 <= self.duplex <= 2, self.duplex
        assert self.per_rank is None or self.per_rank > 0, self.per_rank
        assert self.message_spread is None or (
            self.message_spread and min(self.message_spread) > 0
        ), self.message_spread

    @classmethod
    def from_topology(
        cls,
        topology: Topology,
        *,
        latency_ms: float = 0.0,
        unit_capacity: float | None = None,
        send_ms: float = 0.0,
        send_ms_per_mib: float = 0.0,
        duplex: float | None = None,
        recv_ms: float = 0.0,
        per_rank: float | None = None,
        interface: bool = False,
        message_spread: tuple[float, ...] | None = None,
    ) -> Network:
        sizes, size = [], 1
        for level in topology.levels:
            size *= level.workers
            sizes.append(size)
        bandwidths = tuple(lv.bandwidth for lv in topology.levels)
        return cls(
            tuple(sizes),
            bandwidths,
            latency_ms=latency_ms,
            unit_capacity=unit_capacity,
            send_ms=send_ms,
            send_ms_per_mib=send_ms_per_mib,
            duplex=duplex,
            recv_ms=recv_ms,
            per_rank=per_rank,
            interface=interface,
            message_spread=message_spread,
        )

    def post_ms(self, num_bytes: float) -> float:
        """Time posting a message of ``num_bytes`` holds the sending rank."""
        return self.send_ms + num_bytes / 2**20 * self.send_ms_per_mib

    def level_of(self, ranks: Sequence[int]) -> int:
        """The innermost level one of whose units holds all of ``ranks``."""
        for level, size in enumerate(self.unit_sizes):
            if len({rank // size for rank in ranks}) == 1:
                return level
        return len(self.unit_sizes) - 1

    def units_of(self, a: int, b: int) -> tuple[int, ...]:
        """The innermost units of ranks ``a`` and ``b`` (one when they share it)."""
        size = self.unit_sizes[0]
        return tuple(sorted({a // size, b // size}))

    def transfer_ms(self, num_bytes: float, a: int, b: int) -> float:
        """Time the link between ranks ``a`` and ``b`` is busy with ``num_bytes``."""
        return num_bytes / self.bandwidths[self.level_of((a, b))] * 1e3

    def allreduce_ms(self, num_bytes: float, ranks: Sequence[int]) -> float:
        """Hierarchical ring allreduce of ``num_bytes`` among ``ranks`` (module docstring)."""
        total, below = 0.0, 1
        for level, size in enumerate(self.unit_sizes):
            inner = self.unit_sizes[level - 1] if level else 1
            groups: dict[int, set[int]] = {}
            for rank in ranks:
                groups.setdefault(rank // size, set()).add(rank // inner)
            k = max(len(units) for units in groups.values())
            if k > 1:
                total += 4.0 * (k - 1) / k * num_bytes / (self.bandwidths[level] * below) * 1e3
            below *= k
        return total


@dataclass(frozen=True)
class Event:
    """One action on one rank's timeline."""

    rank: int
    """The rank."""
    stage: int
    """Its stage."""
    kind: str
    """``F``, ``B`` (or its halves ``I`` and ``W``), ``A``, ``U``, ``S`` (posting a send),
    ``R`` (posting receives ahead) or ``H`` (held: waiting for earlier sends to leave; not
    busy)."""
    index: int
    """Microbatch (F, B, S; R: of the first receive posted) or update (A, U) index."""
    start_ms: float
    """Start time."""
    end_ms: float
    """End time."""


@dataclass(frozen=True)
class Timeline:
    """The simulated run."""

    events: tuple[Event, ...]
    """Compute, allreduce, update, send-posting, receive-posting and send-waiting events of
    every rank, by start time."""
    num_minibatches: int
    """Minibatches simulated."""
    completions_ms: tuple[float, ...]
    """When each minibatch's last backward (at stage 0) ended."""
    time_per_minibatch_ms: float
    """Steady-state time between consecutive minibatches."""
    measured: tuple[int, int]
    """The minibatches between whose completions the steady state was measured (between the
    fill and the drain, whole repetitions of the steady state's cycle)."""
    steady: bool = True
    """Whether a steady cycle showed (False: the run was too short for one, and the time is the
    average over the second half of the run, or over all of it; or its times were drawn)."""
    drawn: bool = False
    """Whether the forwards' and backwards' times, or the messages', were drawn from a spread
    (the time per minibatch is then the mean over the ``measured`` window)."""
    messages: tuple[MessageTime, ...] = ()
    """Every message: when its send was posted, when its receiver reached the receive and when
    that ended (``pipedream simulate --trace`` sets them beside the run's)."""

    @property
    def from_start(self) -> bool:
        """Whether the time is the average over the whole run from its start, the fill and
        the drain included: a run too short for a window after the fill (every other window,
        steady or drawn or not, begins after it, at minibatch 1 or later)."""
        return not self.steady and not self.drawn and self.measured[0] == 0

    @property
    def makespan_ms(self) -> float:
        return max(event.end_ms for event in self.events)

    def busy_fraction(self, rank: int) -> float:
        """Share of the run the rank spends computing, allreducing, updating or posting sends
        and receives (not waiting for its sends to leave)."""
        busy = sum(e.end_ms - e.start_ms for e in self.events if e.rank == rank and e.kind != "H")
        return busy / self.makespan_ms if self.makespan_ms > 0 else 1.0


def stage_work(plan: Plan, profile: Profile) -> list[StageWork]:
    """Per-stage costs of ``plan`` from ``profile`` (layer names must match).

    The runtime's cost per action (the profile's ``overhead_ms``) is added to every forward,
    backward and update, reading a microbatch from the dataset to every forward of the first
    stage (inputs) and of the last stage (targets), and the loss to every forward and backward of
    the last stage; a profile without them (imported, or written before they were measured)
    adds nothing. A plan that recomputes activations (``recompute``) runs each stage's forward
    again in its backward (split: in ``I``, which the input share then counts).
    """
    index = {name: i for i, name in enumerate(profile.layer_names)}
    overhead = profile.overhead or ActionOverhead(0.0, 0.0, 0.0)
    stage_of = stages_of_layers(plan, profile)
    messages = stage_messages(profile, stage_of)
    tied = tied_bytes(profile, stage_of)
    work = []
    for number, stage in enumerate(plan.stages):
        first, last = index[stage.first_layer], index[stage.last_layer]
        layers = profile.layers[first : last + 1]
        params = float(sum(layer.parameter_bytes for layer in layers))
        last_stage = number == len(plan.stages) - 1
        reads = (overhead.inputs_ms if number == 0 else 0.0) + (
            overhead.targets_ms + overhead.loss_forward_ms if last_stage else 0.0
        )
        loss_backward_ms = overhead.loss_backward_ms if last_stage else 0.0
        backward_ms = (
            sum(layer.backward_ms for layer in layers) + overhead.backward_ms + loss_backward_ms
        )
        again = sum(layer.forward_ms for layer in layers) if plan.recompute else 0.0
        work.append(
            StageWork(
                tied_bytes=tied.get(number, {}),
                forward_ms=sum(layer.forward_ms for layer in layers) + overhead.forward_ms + reads,
                backward_ms=backward_ms + again,
                # I is half of the backward, and the recomputed forward
                input_share=(backward_ms / 2 + again) / (backward_ms + again) if again else 0.5,
                parameter_bytes=params,
                output_bytes=float(profile.boundary_bytes(last)) if last < len(index) - 1 else 0,
                update_ms=sum(layer.update_ms or 0.0 for layer in layers) + overhead.update_ms,
                copy_ms=params / 2**20 * overhead.copy_ms_per_mib,
                accumulate_ms=params / 2**20 * overhead.accumulate_ms_per_mib,
                sends=None
                if messages is None
                else {
                    consumer: (
                        float(messages.activation_bytes[(number, consumer)]),
                        float(messages.gradient_bytes[(number, consumer)]),
                    )
                    for producer, consumer in messages.edges
                    if producer == number
                },
            )
        )
    return work


def tied_bytes(profile: Profile, stage_of: Sequence[int]) -> dict[int, dict[int, float]]:
    """Stage -> other stage -> bytes of the tied parameters the two share (the profile's
    ``tied`` entries whose layers ``stage_of``, a stage per layer, puts in several stages; the
    first owns them)."""
    index = {name: i for i, name in enumerate(profile.layer_names)}
    out: dict[int, dict[int, float]] = {}
    for tied in profile.tied:
        stages = sorted({stage_of[index[layer]] for layer in tied.layers})
        for copy in stages[1:]:
            for a, b in ((stages[0], copy), (copy, stages[0])):
                out.setdefault(a, {})[b] = out.get(a, {}).get(b, 0.0) + tied.bytes
    return out


def pipeline_edges(work: Sequence[StageWork]) -> tuple[tuple[int, int], ...] | None:
    """The (producer, consumer) stage pairs of ``work`` (the schedule's ``edges``); None for a
    chain (no stage has ``sends``)."""
    if all(w.sends is None for w in work):
        return None
    pairs: set[tuple[int, int]] = set()
    for stage, w in enumerate(work):
        if w.sends is not None:
            pairs.update((stage, consumer) for consumer in w.sends)
        elif stage + 1 < len(work):
            pairs.add((stage, stage + 1))
    return tuple(sorted(pairs))


def message_bytes(work: Sequence[StageWork], producer: int, consumer: int, gradient: bool) -> float:
    """Bytes of one activation message from ``producer`` to ``consumer`` (or of the gradient
    message back)."""
    sends = work[producer].sends
    if sends is None:
        return work[producer].output_bytes
    return sends[consumer][1 if gradient else 0]


def tied_pairs(work: Sequence[StageWork]) -> tuple[tuple[int, int], ...]:
    """The (owner, copy) stage pairs of ``work``'s tied parameters (the schedule's ``tied``)."""
    return tuple(sorted((s, p) for s, w in enumerate(work) for p in w.tied_bytes if p > s))


def _period(plan: Plan) -> int:
    """Minibatches after which the replica pattern repeats."""
    return plan.steps_multiple


def _margin(plan: Plan, network: Network | None = None, window: int = RECEIVE_WINDOW) -> int:
    """Minibatches of the pipeline's fill, and of its drain: ``S`` times the replica period.

    That bounds the minibatches in flight (``r`` replicas of the input stage with
    ``ceil(W / r)`` each under PipeDream), whose absence at the end of a run changes the
    completions before them: on VGG-16 over 4 workers, a 3-1 split, the last 6 minibatches
    complete faster than the steady state. Where posting a receive costs time, the ranks post
    none in their tables' last ``window`` actions (the posting's), which a longer run would
    fill: those actions lie within ``ceil(window / 2m)`` periods (every rank runs a forward and
    a backward per microbatch of at least one minibatch per period), added to the margin.
    """
    margin = plan.num_stages * _period(plan)
    if network is not None and network.recv_ms > 0:
        margin += _period(plan) * math.ceil(window / (2 * plan.microbatches))
    return margin


STEADY_TOLERANCE = 1e-3
"""Relative difference below which repetitions of a cycle count as taking the same time."""

MAX_DOUBLINGS = 4
"""How often a simulation without a given length doubles its minibatches to find the cycle."""

SPREAD_MINIBATCHES = 64
"""Minibatches before the drain over which a simulation with a spread averages, after as many
more past the fill (with 10% spread per action, the seeds of a 2-stage pipeline's simulation
agree within about 1%)."""


def steady_window(completions: Sequence[float], margin: int, period: int) -> tuple[int, int] | None:
    """The minibatches between whose completions the steady state is measured, or None.

    The window ends where the drain (the last ``margin`` minibatches) begins and spans the
    second half of what lies after the fill (the first ``margin``), at least three
    repetitions of a cycle: the shortest cycle (a multiple of ``period``) all of whose
    repetitions in the window take the same time. None: no cycle repeats that way (still a
    transient, or a run too short).
    """
    last = len(completions) - 1 - margin
    span = last - margin
    for cycle in range(period, span // 3 + 1, period):
        repetitions = max(3, span // 2 // cycle)
        times = [
            completions[last - k * cycle] - completions[last - (k + 1) * cycle]
            for k in range(repetitions)
        ]
        if max(times) - min(times) <= STEADY_TOLERANCE * max(abs(t) for t in times):
            return last - repetitions * cycle, last
    return None


def default_steps(plan: Plan, network: Network | None = None) -> int:
    """Enough minibatches for the fill, three periods of steady state and the drain (on
    ``network``: see :func:`_margin`)."""
    period = _period(plan)
    return period * math.ceil(max(8, 2 * _margin(plan, network) + 3 * period + 1) / period)


def simulate(
    plan: Plan,
    work: Sequence[StageWork],
    network: Network,
    *,
    num_minibatches: int | None = None,
    max_minibatches: int | None = None,
    spread: PassSpread | None = None,
    seed: int = 0,
) -> Timeline:
    """Run ``plan``'s tables for ``num_minibatches`` (a multiple of every replica count).

    Without ``num_minibatches``, from :func:`default_steps` on, doubling (at most
    :data:`MAX_DOUBLINGS` times, and never beyond ``max_minibatches``) until the steady
    state's cycle shows (module docstring); with a ``spread``, the fill, the drain and twice
    :data:`SPREAD_MINIBATCHES` between them, every forward and backward drawn from it with
    the random generator seeded by ``seed`` (and so with the network's ``message_spread``,
    every message).
    """
    if num_minibatches is not None:
        return _simulate(plan, work, network, num_minibatches, spread, seed)
    if _drawn(spread, network):
        period = _period(plan)
        steps = 2 * (_margin(plan, network) + SPREAD_MINIBATCHES)
        return _simulate(plan, work, network, period * math.ceil(steps / period), spread, seed)
    steps = default_steps(plan, network)
    timeline = _simulate(plan, work, network, steps)
    for _ in range(MAX_DOUBLINGS):
        steps *= 2
        if timeline.steady or (max_minibatches is not None and steps > max_minibatches):
            break
        longer = _simulate(plan, work, network, steps)
        if not longer.steady and _settled(timeline, longer):
            return longer
        timeline = longer
    return timeline


AVERAGE_TOLERANCE = 0.01
"""Relative difference below which the averages of two runs without a steady cycle, one twice
as long as the other, count as settled (no longer run is simulated)."""


def _settled(shorter: Timeline, longer: Timeline) -> bool:
    """Whether a run with no steady cycle and its double agree on the average time."""
    a, b = shorter.time_per_minibatch_ms, longer.time_per_minibatch_ms
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= AVERAGE_TOLERANCE * max(a, b)


JITTER = 0.05
"""How much :func:`jittered` varies every action and message: each takes its time times
``1 - JITTER`` or ``1 + JITTER``."""
FRAGILE = 0.03
"""How far the jittered time per minibatch may lie from the fixed one before ``pipedream
simulate`` calls the fixed timeline's steady state fragile."""


def jittered(
    plan: Plan,
    work: Sequence[StageWork],
    network: Network,
    *,
    jitter: float = JITTER,
    seed: int = 0,
) -> Timeline:
    """The plan simulated with every forward, backward and message taking its time times
    ``1 - jitter`` or ``1 + jitter`` (drawn, seeded): whether its steady state survives noise.

    A pipeline's microbatches can form chains that depend on each other only through the ranks
    they share: in a 2-stage ``2bw`` pipeline the even and the odd microbatches each make a
    cycle (activation, the second stage's forward and backward, gradient, the first stage's
    backward and next forward) whose period the tables fix, but not the offset between the two
    cycles. Fixed times keep whatever offset the fill left, which can be one where activations
    and gradients never share the link; the smallest noise makes the offset drift, and where
    the two directions then overlap they slow each other down. A real run has that noise, so
    where messages take a large share of the time the fixed timeline can be too fast and the
    jittered one comes closer to the run. Where there is no such freedom the jitter adds only
    what late actions cost stages without slack (a late stage holds up its neighbours; an early
    one cannot make up for it): a few percent for pipelines of equal stages, less where the
    stages differ and the faster ones have slack.
    """
    if not 0 <= jitter < 1:
        raise PlanningError(f"jitter {jitter}: must be at least 0 and below 1")
    ratios = (1 - jitter, 1 + jitter)
    noisy = dataclasses.replace(network, message_spread=ratios)
    return simulate(plan, work, noisy, spread=PassSpread(ratios, ratios), seed=seed)


def _drawn(spread: PassSpread | None, network: Network) -> bool:
    """Whether a simulation draws times from a spread (then it has no steady cycle)."""
    return spread is not None or network.message_spread is not None


def _simulate(
    plan: Plan,
    work: Sequence[StageWork],
    network: Network,
    num_minibatches: int,
    spread: PassSpread | None = None,
    seed: int = 0,
) -> Timeline:
    edges, tied = pipeline_edges(work), tied_pairs(work)
    spec = spec_from_plan(plan, 0, num_minibatches, edges, tied)
    tables = build_tables(spec)
    posting = plan_posting(plan, [num_minibatches], in_order=False, edges=edges, tied=tied)
    run = _Run(tables, work, network, spec, spread, random.Random(seed), posting)
    run.execute()
    m = plan.microbatches
    completions = []
    for t in range(num_minibatches):
        ends = [run.backward_end[(0, t * m + j)] for j in range(m)]
        completions.append(max(ends))
    margin, period = _margin(plan, network, posting.window), _period(plan)
    drawn = _drawn(spread, network)
    window = None if drawn else steady_window(completions, margin, period)
    last = num_minibatches - 1 - margin
    periods = max(1, (last - margin) // 2 // period)
    if drawn and last - margin >= period:  # drawn: the last 64, or half if more
        span = min(last - margin, max(SPREAD_MINIBATCHES, (last - margin) // 2))
        first = last - max(period, span // period * period)
    elif window is not None:
        first, last = window
    elif last - periods * period >= margin:  # no cycle: whole periods of the second half
        first = last - periods * period
    else:  # too short for a steady state: the average
        first, last = -1, num_minibatches - 1
    start = completions[first] if first >= 0 else 0.0
    per = (completions[last] - start) / (last - first)
    events = tuple(sorted(run.events, key=lambda e: (e.start_ms, e.rank)))
    return Timeline(
        events,
        num_minibatches,
        tuple(completions),
        per,
        (max(first, 0), last),
        window is not None,
        drawn=drawn,
        messages=tuple(run.message_times),
    )


class _Run:
    """The event loop: ranks advance through their tables in global time order."""

    def __init__(
        self,
        tables: dict[int, list[Action]],
        work: Sequence[StageWork],
        network: Network,
        spec: PipelineSpec,
        spread: PassSpread | None = None,
        rng: random.Random | None = None,
        posting: Posting | None = None,
    ) -> None:
        self.tables, self.work, self.network = tables, work, network
        self.posting = posting or Posting()
        self.spec = spec
        self.spread, self.rng = spread, rng or random.Random(0)
        self.position = {rank: 0 for rank in tables}
        self.clock = {rank: 0.0 for rank in tables}
        self.messages: dict[Message, float] = {}  # -> arrival time
        self.link_free: dict[tuple[int, int], float] = {}
        self.arrived: dict[tuple[int, int], dict[int, float]] = {}
        self.events: list[Event] = []
        self.backward_end: dict[tuple[int, int], float] = {}
        self.waiting: set[int] = set()  # ranks inside an allreduce that others have not reached
        self.heap: list[tuple[float, int]] = [(0.0, rank) for rank in sorted(tables)]
        self.queued = set(self.heap)  # a rank queued twice for one time would be asked twice
        self.pool = None
        self.busy = BusyTimes()  # with interfaces: links and (rank, level, sending)
        self.in_order: dict[tuple[int, int], float] = {}  # (sender, receiver): last end
        pooled = (network.unit_capacity, network.duplex, network.per_rank)
        if any(x is not None for x in pooled):
            per_unit = math.inf if network.unit_capacity is None else network.unit_capacity / 1e3
            self.pool = TransferPool(per_unit, network.duplex, network.per_rank, network.interface)
        self.pool_version = 0  # heap entries (t, -1 - version) are the pool's completions
        # per (rank, stage): a rank may run several stages, each with its own versions
        self.uses = {
            (rank, stage): version_use(table, initial_version=0, stage=stage)
            for rank, table in tables.items()
            for stage in {action.stage for action in table}
        }
        self.updates_done = dict.fromkeys(self.uses, 0)
        window = self.posting.window
        self.posts = {r: receives_posted_before(table, window) for r, table in tables.items()}
        # each rank's messages sent and not yet waited on, oldest first, and when each left it
        self.unwaited: dict[int, deque[Message]] = {r: deque() for r in tables}
        self.left: dict[Message, float] = {}
        self.sent: dict[Message, float] = {}  # -> when its post started
        self.message_times: list[MessageTime] = []
        for rank in tables:
            self.clock[rank] = self._reach(rank, 0.0)

    def execute(self) -> None:
        while self.heap:
            when, rank = heapq.heappop(self.heap)
            if rank < 0:
                if -1 - rank == self.pool_version:  # not superseded by a later start
                    self._transfers_done(when)
                continue
            self.queued.discard((when, rank))
            ready = self._ready(rank)
            if ready is None:
                continue  # parked: a send or the allreduce's last replica requeues it
            if ready > when:  # a stale entry: wait for its turn, to keep links first come
                self._queue(ready, rank)
                continue
            self._run_next(rank, ready)
        stuck = [r for r, pos in self.position.items() if pos < len(self.tables[r])]
        assert not stuck, f"the tables deadlock at ranks {stuck}"  # validated tables never do

    def _reach(self, rank: int, now: float) -> float:
        """``rank`` reaches its next action at ``now`` and posts the receives the runtime posts
        there (an ``R`` event); when it is free to run the action."""
        position = self.position[rank]
        table = self.tables[rank]
        if position >= len(table) or not self.network.recv_ms:
            return now
        # a message between two stages of the rank is handed over: nothing is posted for it
        receives = [p for p in self.posts[rank][position] if table[p].peer != rank]
        if not receives:
            return now
        end = now + len(receives) * self.network.recv_ms
        first = table[receives[0]]
        self.events.append(Event(rank, table[position].stage, "R", first.index, now, end))
        return end

    def _ready(self, rank: int) -> float | None:
        """When ``rank``'s next action can start (None: not yet known)."""
        table = self.tables[rank]
        if self.position[rank] >= len(table) or rank in self.waiting:
            return None
        ready = self._sends_reclaimed(rank)
        if ready is None:
            return None
        action = table[self.position[rank]]
        if action.op.is_receive:
            arrival = self.messages.get(message_of(rank, action))
            return None if arrival is None else max(ready, arrival)
        return ready

    def _sends_reclaimed(self, rank: int) -> float | None:
        """When ``rank`` has waited for its oldest sends beyond the runtime's bound (None: one
        of them is still moving, with no end known yet)."""
        unwaited = self.unwaited[rank]
        ready = self.clock[rank]
        in_flight = self.posting.messages_in_flight
        for key in itertools.islice(unwaited, max(0, len(unwaited) - in_flight)):
            left = self.left.get(key)
            if left is None:
                return None
            ready = max(ready, left)
        return ready

    def _reclaim(self, rank: int) -> None:
        """Forget the sends ``rank`` waited for before the action it starts now."""
        unwaited = self.unwaited[rank]
        while len(unwaited) > self.posting.messages_in_flight:
            del self.left[unwaited.popleft()]

    def _schedule_pool(self) -> None:
        assert self.pool is not None
        self.pool_version += 1
        due = self.pool.next_completion()
        if due is not None:
            heapq.heappush(self.heap, (due, -1 - self.pool_version))

    def _transfers_done(self, when: float) -> None:
        assert self.pool is not None
        for transfer in self.pool.complete(when):
            key: Message = transfer.key
            self.messages[key] = when + self.network.latency_ms
            self.left[key] = when
            self._wake(key[4])
            self._wake(key[2])  # its sender may wait to reclaim it
        self._schedule_pool()

    def _wake(self, rank: int) -> None:
        ready = self._ready(rank)
        if ready is not None:
            self._queue(ready, rank)

    def _queue(self, when: float, rank: int) -> None:
        """Ask again at ``when`` whether ``rank`` can run its next action."""
        if (when, rank) not in self.queued:
            self.queued.add((when, rank))
            heapq.heappush(self.heap, (when, rank))

    def _run_next(self, rank: int, now: float) -> None:
        """Run ``rank``'s next action at ``now``."""
        action = self.tables[rank][self.position[rank]]
        op, stage = action.op, action.stage
        self.position[rank] += 1
        reclaimed = self._sends_reclaimed(rank)
        assert reclaimed is not None and reclaimed <= now, (reclaimed, now)  # _ready waited
        if reclaimed > self.clock[rank]:
            self.events.append(Event(rank, stage, "H", action.index, self.clock[rank], reclaimed))
        self._reclaim(rank)
        if op.is_receive:
            key = message_of(rank, action)
            del self.messages[key]
            assert action.peer_stage is not None
            sent = self.sent.pop(key)
            message = MessageTime(action.peer_stage, stage, message_kind(op), sent, reclaimed, now)
            self.message_times.append(message)  # reached the receive once sends were reclaimed
        elif op.is_send and action.peer == rank:  # to another stage of the rank: handed over
            key = message_of(rank, action)
            self.sent[key] = self.messages[key] = now
        elif op.is_send:
            peer = action.peer or 0
            peer_stage = action.peer_stage
            assert peer_stage is not None
            link = (min(rank, peer), max(rank, peer))
            if op is Op.SEND_ACT:
                size = message_bytes(self.work, stage, peer_stage, gradient=False)
            elif op is Op.SEND_GRAD:
                size = message_bytes(self.work, peer_stage, stage, gradient=True)
            else:  # a tied parameter's gradient or new version
                size = self.work[stage].tied_bytes[peer_stage]
            key = message_of(rank, action)
            self.unwaited[rank].append(key)
            self.sent[key] = now
            moved = size  # the bytes its transfer takes as long as
            if self.network.message_spread is not None:
                moved *= self.rng.choice(self.network.message_spread)
            level = self.network.level_of(link)
            if self.pool is not None:
                rate = self.network.bandwidths[level] / 1e3  # bytes per ms
                units = self.network.units_of(rank, peer)
                transfer = Transfer(key, link, units, moved, rate, source=rank, level=level)
                self.pool.start(now, transfer)
                self._schedule_pool()
            else:
                duration = self.network.transfer_ms(moved, rank, peer)
                if self.network.interface:
                    # the earliest window with the link and both interfaces free, after the
                    # messages sent before it the same way between the two ranks
                    needs = (link, (rank, level, True), (peer, level, False))
                    self.busy.forget_before(needs, now)
                    after = max(now, self.in_order.get((rank, peer), 0.0))
                    start = self.busy.earliest(needs, after, duration)
                    self.busy.book(needs, start, start + duration)
                    self.in_order[rank, peer] = start + duration
                else:
                    start = max(now, self.link_free.get(link, 0.0))
                    self.link_free[link] = start + duration
                end = start + duration
                self.messages[key] = end + self.network.latency_ms
                self.left[key] = end
                self._wake(peer)
            posting = self.network.post_ms(size)
            if posting > 0:
                self.events.append(Event(rank, stage, "S", action.index, now, now + posting))
                now += posting
        elif op in (Op.ALLREDUCE, Op.CLIP):  # a clip: every rank adds one number
            clip = op is Op.CLIP
            group = sorted(self.tables) if clip else self.spec.stage_ranks[stage]
            arrivals = self.arrived.setdefault((-1 if clip else stage, action.index), {})
            arrivals[rank] = now
            if len(arrivals) < len(group):
                self.waiting.add(rank)
                return
            start = max(arrivals.values())
            size = NORM_BYTES if clip else self.work[stage].parameter_bytes
            end = start + self.network.allreduce_ms(size, group)
            for member in group:
                own = min(self.spec.stages_of_rank(member)) if clip else stage  # its C's stage
                self.events.append(Event(member, own, "A", action.index, start, end))
                self.clock[member] = self._reach(member, end)
                self.waiting.discard(member)
                self._wake(member)
            return
        else:
            work = self.work[stage]
            duration = work.action_ms(op)
            if self.spread is not None and op is not Op.UPDATE:
                ratios = self.spread.forward if op is Op.FORWARD else self.spread.backward
                duration *= self.rng.choice(ratios)
            weights_done = op in (Op.BACKWARD, Op.BACKWARD_WEIGHT)
            if weights_done and action.index % self.spec.microbatches:
                duration += work.accumulate_ms  # .grad holds the earlier ones
            if op is Op.UPDATE:
                self.updates_done[rank, stage] += 1  # this update creates version updates_done
                if self.uses[rank, stage].needs_copy(self.updates_done[rank, stage]):
                    duration += self.work[stage].copy_ms
            self.events.append(Event(rank, stage, op.value, action.index, now, now + duration))
            now += duration
            if weights_done:  # the microbatch's backward is complete
                self.backward_end[(stage, action.index)] = now
        self.clock[rank] = self._reach(rank, now)
        self._wake(rank)
