"""Action tables in unit time: how long a schedule takes when every computation costs a fixed
time and messages are instant (what the schedules' bubble formulas assume), and how many
microbatches' activations a rank holds at most. Pure code, no torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pipedream.schedules.actions import Action, Op
from pipedream.schedules.validate import message_of

__all__ = ["peak_held_bytes", "peak_in_flight", "unit_time_makespan"]


def unit_time_makespan(
    tables: Mapping[int, Sequence[Action]], cost: Callable[[Op], float]
) -> float:
    """Every rank runs its table in order: compute takes ``cost(op)``, a send is instant, a
    receive waits for its send. The time the last rank finishes."""
    clock = dict.fromkeys(tables, 0.0)
    position = dict.fromkeys(tables, 0)
    sent: dict[object, float] = {}
    moved = True
    while moved:
        moved = False
        for rank, table in tables.items():
            while position[rank] < len(table):
                action = table[position[rank]]
                if action.op.is_send:
                    sent[message_of(rank, action)] = clock[rank]
                elif action.op.is_receive:
                    key = message_of(rank, action)
                    if key not in sent:
                        break
                    clock[rank] = max(clock[rank], sent.pop(key))
                elif action.op.is_compute:
                    clock[rank] += cost(action.op)
                position[rank] += 1
                moved = True
    assert all(position[r] == len(t) for r, t in tables.items()), "deadlock"
    return max(clock.values())


def peak_in_flight(table: Sequence[Action]) -> int:
    """Most microbatch-stages holding activations at once on a rank: from a forward to the
    end of its backward (B, or W for a split one)."""
    held = peak = 0
    for action in table:
        if action.op is Op.FORWARD:
            held += 1
            peak = max(peak, held)
        elif action.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
            held -= 1
    return peak


def peak_held_bytes(
    table: Sequence[Action], held: Mapping[int, float], deferred: Mapping[int, float]
) -> float:
    """Most bytes a rank's microbatches hold at once, walking its table in order.

    A forward of stage ``s`` takes ``held[s]`` (the activations its backward needs) until its
    backward ``B`` ends, or, split, until its ``W``; between ``I`` and ``W`` it also holds
    ``deferred[s]`` (what ``I`` leaves for ``W``: the gradients of the outputs of the modules
    whose weights wait)."""
    now = peak = 0.0
    for action in table:
        stage = action.stage
        if action.op is Op.FORWARD:
            now += held[stage]
            peak = max(peak, now)
        elif action.op is Op.BACKWARD_INPUT:
            now += deferred[stage]
            peak = max(peak, now)
        elif action.op is Op.BACKWARD:
            now -= held[stage]
        elif action.op is Op.BACKWARD_WEIGHT:
            now -= held[stage] + deferred[stage]
    return peak
