"""Zero-bubble orders from a unit-time list schedule (``zbv``'s).

Zero-bubble schedules split every backward into an input-gradient half ``I`` (what the stage
before waits for) and a weight-gradient half ``W`` (what only the update waits for), and run
the ``W`` s where 1F1B idles. Where no simple rule places them (the V, two stages per rank),
the order is made here by running one minibatch of the pipeline in unit time
(``F = I = W = 1``), as Qi et al. (ICLR 2024) make theirs by simulation:
whenever a rank is free it runs, in this order of preference,

1. the ``I`` of one of its stages whose output gradient has arrived (the latest stage first:
   it is nearest the loss, and the earlier stages wait for it),
2. the ``F`` of one of its stages whose input has arrived, if fewer than ``limit``
   microbatch-stages hold activations on the rank (from its ``F`` to its ``W``; the latest
   stage first),
3. its oldest pending ``W``,

else it waits a unit. Each stage's microbatches go through ``F`` and ``I`` in order. What each
rank ran, in that order, is its order. The result depends only on the placement, the number of
stages and microbatches and the limit, never on measured times.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedream.schedules.actions import Op

__all__ = ["unit_time_orders"]


def unit_time_orders(
    placement: Sequence[int], microbatches: int, limit: int
) -> dict[int, list[tuple[Op, int, int]]]:
    """Rank -> its ``(op, stage, microbatch)`` order for one minibatch of ``microbatches``,
    stage ``s`` running on rank ``placement[s]``, at most ``limit`` microbatch-stages holding
    activations per rank at once (``limit >= 1``)."""
    assert limit >= 1, limit
    return _UnitTime(placement, microbatches, limit).run()


class _UnitTime:
    """The state of the unit-time run: what is done, and when it was done."""

    def __init__(self, placement: Sequence[int], microbatches: int, limit: int) -> None:
        self.last = len(placement) - 1
        self.microbatches = microbatches
        self.limit = limit
        self.ranks = sorted(set(placement))
        self.stages_of = {  # latest stage first
            r: [s for s in reversed(range(len(placement))) if placement[s] == r] for r in self.ranks
        }
        self.forward_end: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> time done
        self.input_end: dict[tuple[int, int], int] = {}
        self.next_forward = [0] * len(placement)
        self.next_input = [0] * len(placement)
        self.pending = {r: list[tuple[int, int]]() for r in self.ranks}  # I done, W not yet
        self.in_flight = dict.fromkeys(self.ranks, 0)
        self.orders: dict[int, list[tuple[Op, int, int]]] = {r: [] for r in self.ranks}

    def run(self) -> dict[int, list[tuple[Op, int, int]]]:
        remaining = 3 * len(self.next_forward) * self.microbatches
        now = 0
        while remaining:
            chosen = [(r, c) for r in self.ranks if (c := self._choose(r, now)) is not None]
            # a round that runs nothing finishes nothing: every later round would be the same
            assert chosen, f"the unit-time run is stuck at time {now}: limit {self.limit} too low"
            for rank, choice in chosen:
                self._run(rank, choice, now)
            remaining -= len(chosen)
            now += 1
        return self.orders

    def _choose(self, rank: int, now: int) -> tuple[Op, int, int] | None:
        for stage in self.stages_of[rank]:
            j = self.next_input[stage]
            if j < self.next_forward[stage] and self._ready(self._input_needs(stage, j), now):
                return (Op.BACKWARD_INPUT, stage, j)
        if self.in_flight[rank] < self.limit:
            for stage in self.stages_of[rank]:
                j = self.next_forward[stage]
                needs = (stage - 1, j) if stage > 0 else None
                if j < self.microbatches and self._ready_forward(needs, now):
                    return (Op.FORWARD, stage, j)
        if self.pending[rank]:
            stage, j = self.pending[rank][0]
            return (Op.BACKWARD_WEIGHT, stage, j)
        return None

    def _input_needs(
        self, stage: int, j: int
    ) -> tuple[dict[tuple[int, int], int], tuple[int, int]]:
        """The last stage's I needs its own F; every other stage's I the next stage's I."""
        if stage == self.last:
            return self.forward_end, (stage, j)
        return self.input_end, (stage + 1, j)

    @staticmethod
    def _ready(needs: tuple[dict[tuple[int, int], int], tuple[int, int]], now: int) -> bool:
        done, key = needs
        return key in done and done[key] <= now

    def _ready_forward(self, needs: tuple[int, int] | None, now: int) -> bool:
        return needs is None or (needs in self.forward_end and self.forward_end[needs] <= now)

    def _run(self, rank: int, choice: tuple[Op, int, int], now: int) -> None:
        op, stage, j = choice
        self.orders[rank].append(choice)
        if op is Op.FORWARD:
            self.forward_end[stage, j] = now + 1
            self.next_forward[stage] += 1
            self.in_flight[rank] += 1
        elif op is Op.BACKWARD_INPUT:
            self.input_end[stage, j] = now + 1
            self.next_input[stage] += 1
            self.pending[rank].append((stage, j))
        else:
            self.pending[rank].pop(0)
            self.in_flight[rank] -= 1
