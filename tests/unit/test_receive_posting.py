"""Where the executor posts its receives ahead (one rule for the runtime and the simulator)."""

from __future__ import annotations

from pipedream.schedules import RECEIVE_WINDOW, PipelineSpec, build_tables, receives_posted_before


def test_each_receive_is_posted_once_within_the_window_ahead() -> None:
    spec = PipelineSpec(
        schedule="1f1b", stage_ranks=((0,), (1,)), microbatches=2, num_minibatches=2
    )
    tables = build_tables(spec)
    assert " ".join(str(a) for a in tables[0]) == (
        "0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0U0 0F2 0SF2 0F3 0SF3 0RB2 0B2 0RB3 0B3 0U1"
    )
    assert " ".join(str(a) for a in tables[1]) == (
        "1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1U0 1RF2 1F2 1B2 1SB2 1RF3 1F3 1B3 1SB3 1U1"
    )
    # before position p: the receives below p + 3 not posted yet
    assert receives_posted_before(tables[0], window=3) == [
        (), (), (4,), (), (6,), (), (), (), (), (), (), (13,), (), (15,), (), (), (), (),
    ]  # fmt: skip
    assert receives_posted_before(tables[1], window=3) == [
        (0,), (), (4,), (), (), (), (), (9,), (), (), (), (13,), (), (), (), (), (), (),
    ]  # fmt: skip
    # the runtime's window covers these short tables: all receives before the first action
    assert RECEIVE_WINDOW >= 18
    assert receives_posted_before(tables[0])[0] == (4, 6, 13, 15)
    assert receives_posted_before(tables[1])[0] == (0, 4, 9, 13)
    assert not any(receives_posted_before(tables[1])[1:])


def test_a_window_of_one_posts_each_receive_right_before_it() -> None:
    spec = PipelineSpec(
        schedule="gpipe", stage_ranks=((0,), (1,), (2,)), microbatches=4, num_minibatches=3
    )
    for table in build_tables(spec).values():
        posts = receives_posted_before(table, window=1)
        receives = [p for p, a in enumerate(table) if a.op.value in ("RF", "RB")]
        assert [p for p, before in enumerate(posts) if before] == receives
        assert all(before in ((), (p,)) for p, before in enumerate(posts))
