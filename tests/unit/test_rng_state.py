"""The random generators a stage draws from: replayed for a recomputed forward, and seeded at
every segment from the run's seed, the rank and the segment's first minibatch."""

from __future__ import annotations

import torch
from torch import nn

from pipedream.runtime.checkpoint import stage_payload
from pipedream.runtime.rng_state import capture, replayed, seed_segment, segment_seed

CPU = torch.device("cpu")


def test_a_replayed_block_draws_again_and_leaves_the_generator_where_it_was() -> None:
    torch.manual_seed(5)
    state = capture(CPU)
    first = torch.rand(4)
    after_first = torch.get_rng_state()
    with replayed(state):
        again = torch.rand(4)
    assert torch.equal(again, first)
    assert torch.equal(torch.get_rng_state(), after_first)
    assert state.cuda is None


def test_each_segment_of_each_rank_has_its_own_seed_from_the_runs() -> None:
    """What a rank draws in a segment depends on the run's seed, the rank and where the
    segment starts, not on what ran before: a resumed run draws what the uninterrupted one
    drew, and the replicas of a stage draw different dropout masks."""

    def draws(seed: int, rank: int, first: int) -> torch.Tensor:
        torch.rand(7)  # whatever ran before
        seed_segment(seed, rank, first)
        return torch.rand(4)

    assert torch.equal(draws(0, 1, 4), draws(0, 1, 4))
    others = [draws(1, 1, 4), draws(0, 2, 4), draws(0, 1, 6)]
    assert not any(torch.equal(draws(0, 1, 4), other) for other in others)
    assert segment_seed(0, 1, 4) == segment_seed(0, 1, 4) < 2**63


def test_checkpoints_hold_no_generator_state() -> None:
    """Replica 0 alone writes a stage's file: a generator state in it would be replica 0's,
    restored on every replica (they drew the same masks after a resume)."""
    payload = stage_payload(nn.Linear(2, 2), None, stage=0, step=4, data_position=4)
    assert "rng" not in payload and "cuda_rng" not in payload
