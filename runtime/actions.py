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
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["Action", "Op", "parse_action"]


class Op(enum.Enum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"
    UPDATE = "U"
    ALLREDUCE = "A"
    RECV_ACT = "RF"
    SEND_ACT = "SF"
    RECV_GRAD = "RB"
    SEND_GRAD = "SB"

    @property
    def is_compute(self) -> bool:
        return self in (Op.FORWARD, Op.BACKWARD)

    @property
    def is_comm(self) -> bool:
        return self in (Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD)


@dataclass(frozen=True)
class Action:
    """One step of one rank's table."""

    op: Op
    """What to do."""
    stage: int
    """Stage the action belongs to."""
    index: int
    """Microbatch index (F, B, sends, receives) or minibatch index (U, A)."""
    peer: int | None = None
    """Global rank on the other end (sends and receives only)."""
    version: int | None = None
    """Weight version the F or B uses (number of this stage's updates it is based on)."""

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.index}"

    def describe(self) -> str:
        """Long form for error messages: ``forward of microbatch 3 at stage 1``."""
        names = {
            Op.FORWARD: "forward of microbatch",
            Op.BACKWARD: "backward of microbatch",
            Op.UPDATE: "optimizer update of minibatch",
            Op.ALLREDUCE: "gradient allreduce of minibatch",
            Op.RECV_ACT: "receive of the activations of microbatch",
            Op.SEND_ACT: "send of the activations of microbatch",
            Op.RECV_GRAD: "receive of the gradient of microbatch",
            Op.SEND_GRAD: "send of the gradient of microbatch",
        }
        text = f"{names[self.op]} {self.index} at stage {self.stage}"
        if self.peer is not None:
            text += f" ({'from' if self.op.value.startswith('R') else 'to'} rank {self.peer})"
        return text


_PATTERN = re.compile(r"^(\d+)(RF|SF|RB|SB|F|B|U|A)(\d+)$")


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)`` (without peer and version)."""
    match = _PATTERN.match(text)
    if not match:
        raise ValueError(f"not an action: {text!r}")
    return Action(Op(match.group(2)), int(match.group(1)), int(match.group(3)))
