"""Actions: the instructions of a schedule's per-rank tables.

A schedule is data: one list of :class:`Action` per rank. The distributed executor, the
single-process reference executor and the simulator all interpret the same tables.

Compact string form (used in tests and printed grids)::

    "1F3"      stage 1, forward of microbatch 3
    "1B3"      stage 1, backward of microbatch 3
    "1U0"      stage 1, optimizer update closing minibatch 0
    "1RF3"     stage 1 receives the activations of microbatch 3 (from stage 0)
    "1SF3"     stage 1 sends the activations of microbatch 3 (to stage 2)
    "1RB3"     stage 1 receives the output gradient of microbatch 3 (from stage 2)
    "1SB3"     stage 1 sends the input gradient of microbatch 3 (to stage 0)
    "1A0"      stage 1 averages its gradients of minibatch 0 with its replicas (allreduce)
    "1I3"      stage 1, input-gradient half of the backward of microbatch 3 (zero-bubble "B")
    "1W3"      stage 1, weight-gradient half of the backward of microbatch 3 (zero-bubble "W")
    "0C2"      the rank of stage 0 takes part in update 2's global gradient norm (every rank)

A backward is either one ``B`` or an ``I`` and a later ``W``: ``I`` computes the gradients of
the stage's inputs (what the previous stage waits for, sent right after it), ``W`` those of the
stage's weights, which nothing waits for until the update, so a schedule can run it in a bubble.

A rank may run several stages (interleaved and V schedules): every action names its stage, and
every message names the stages at both ends (``peer_stage``), so two stage pairs between the
same two ranks never mix up their messages.

Tied parameters (one tensor used by layers of several stages, such as a language model's
embedding and output head) belong to the first of those stages, their *owner*; each later stage
holds a copy, sends the gradient of its copy to the owner before the owner's update and
receives every new version of the owner's tensor::

    "3SG0"     stage 3 sends its tied copies' gradient of update 0 to their owner
    "0RG0"     stage 0 (the owner) receives it and adds it to its own, before update 0
    "0SW1"     stage 0 sends version 1 of the tied tensors (made by update 0) to the copies
    "3RW1"     stage 3 receives version 1, right before its first forward that uses it

A run whose updates wait for the whole model's gradient norm (``--clip-grad-norm``, fp16's loss
scale) has one ``C`` per rank and update, named after the rank's first stage: every rank adds
its stages' squared gradient norms in one allreduce over all ranks, after every gradient of the
update is complete on the rank and before its first ``U``
(:mod:`pipedream.schedules.global_norm`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = [
    "MATCHING_RECEIVE",
    "MESSAGE_KIND",
    "RECEIVES",
    "SENDS",
    "Action",
    "Op",
    "parse_action",
]


class Op(enum.Enum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    UPDATE = "U"
    ALLREDUCE = "A"
    CLIP = "C"
    RECV_ACT = "RF"
    SEND_ACT = "SF"
    RECV_GRAD = "RB"
    SEND_GRAD = "SB"
    SEND_TIED_GRAD = "SG"
    RECV_TIED_GRAD = "RG"
    SEND_WEIGHTS = "SW"
    RECV_WEIGHTS = "RW"

    # Members are singletons that compare by identity, so the identity's hash serves; Enum's own
    # hashes the name in Python, and a simulation hashes actions and messages millions of times.
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)

    @property
    def is_backward(self) -> bool:
        """A backward or one of its halves."""
        return self in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)

    @property
    def is_comm(self) -> bool:
        return self in SENDS or self in RECEIVES

    @property
    def is_send(self) -> bool:
        return self in SENDS

    @property
    def is_receive(self) -> bool:
        return self in RECEIVES


_LONG_NAMES = {
    Op.FORWARD: "forward of microbatch",
    Op.BACKWARD: "backward of microbatch",
    Op.BACKWARD_INPUT: "input-gradient backward of microbatch",
    Op.BACKWARD_WEIGHT: "weight-gradient backward of microbatch",
    Op.UPDATE: "optimizer update of minibatch",
    Op.ALLREDUCE: "gradient allreduce of minibatch",
    Op.CLIP: "global gradient norm (over all ranks) of update",
    Op.RECV_ACT: "receive of the activations of microbatch",
    Op.SEND_ACT: "send of the activations of microbatch",
    Op.RECV_GRAD: "receive of the gradient of microbatch",
    Op.SEND_GRAD: "send of the gradient of microbatch",
    Op.SEND_TIED_GRAD: "send of the tied copies' gradient of update",
    Op.RECV_TIED_GRAD: "receive of the tied copies' gradient of update",
    Op.SEND_WEIGHTS: "send of the tied tensors' version",
    Op.RECV_WEIGHTS: "receive of the tied tensors' version",
}
"""Each op in words, for :meth:`Action.describe` (built once: an action's description is
formatted on the hot path only when a wait or an error needs it)."""


@dataclass(frozen=True)
class Action:
    """One step of one rank's table."""

    op: Op
    """What to do."""
    stage: int
    """Stage the action belongs to."""
    index: int
    """Microbatch index (F, B, sends and receives of activations and gradients), update index
    (U, A, C: the stage's update number), minibatch (SG, RG: the minibatch whose tied gradient
    they move, which update ``minibatch // replicas`` applies), or weight version (SW, RW)."""
    peer: int | None = None
    """Global rank on the other end (sends and receives only)."""
    version: int | None = None
    """Weight version the F or B uses (number of this stage's updates it is based on)."""
    peer_stage: int | None = None
    """Stage on the other end (sends and receives only)."""

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.index}"

    def describe(self) -> str:
        """Long form for error messages: ``forward of microbatch 3 at stage 1``."""
        text = f"{_LONG_NAMES[self.op]} {self.index} at stage {self.stage}"
        if self.peer is not None:
            text += f" ({'from' if self.op.value.startswith('R') else 'to'} rank {self.peer})"
        return text


SENDS = frozenset({Op.SEND_ACT, Op.SEND_GRAD, Op.SEND_TIED_GRAD, Op.SEND_WEIGHTS})
"""The ops that send a message."""
RECEIVES = frozenset({Op.RECV_ACT, Op.RECV_GRAD, Op.RECV_TIED_GRAD, Op.RECV_WEIGHTS})
"""The ops that receive a message."""
MATCHING_RECEIVE = {
    Op.SEND_ACT: Op.RECV_ACT,
    Op.SEND_GRAD: Op.RECV_GRAD,
    Op.SEND_TIED_GRAD: Op.RECV_TIED_GRAD,
    Op.SEND_WEIGHTS: Op.RECV_WEIGHTS,
}
"""The receive that matches each send."""
MESSAGE_KIND = {
    Op.SEND_ACT: "act",
    Op.RECV_ACT: "act",
    Op.SEND_GRAD: "grad",
    Op.RECV_GRAD: "grad",
    Op.SEND_TIED_GRAD: "tied-grad",
    Op.RECV_TIED_GRAD: "tied-grad",
    Op.SEND_WEIGHTS: "weights",
    Op.RECV_WEIGHTS: "weights",
}
"""The kind of message each send and receive moves (its channel and tags)."""

_PATTERN = re.compile(r"^(\d+)(RF|SF|RB|SB|SG|RG|SW|RW|F|B|I|W|U|A|C)(\d+)$")


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)`` (without peer and version)."""
    match = _PATTERN.match(text)
    if not match:
        raise ValueError(f"not an action: {text!r}")
    return Action(Op(match.group(2)), int(match.group(1)), int(match.group(3)))
