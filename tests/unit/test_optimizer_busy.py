"""Busy times of shared resources (pipedream.optimizer.busy): the earliest common window."""

from __future__ import annotations

from pipedream.optimizer.busy import BusyTimes


def test_a_window_fits_in_a_gap_that_every_resource_leaves() -> None:
    busy = BusyTimes()
    busy.book(["link"], 0.0, 10.0)
    busy.book(["link"], 30.0, 40.0)
    busy.book(["nic"], 12.0, 15.0)
    # 10 ms after 5: the link is free from 10 to 30, the nic from 15: 15..25 fits
    assert busy.earliest(["link", "nic"], 5.0, 10.0) == 15.0
    # 20 ms do not fit before 30: after the link's second interval
    assert busy.earliest(["link", "nic"], 5.0, 20.0) == 40.0
    assert busy.earliest(["other"], 5.0, 20.0) == 5.0
    # a window may end where an interval begins
    assert busy.earliest(["link"], 10.0, 20.0) == 10.0


def test_booked_windows_block_later_ones_and_forgotten_ones_do_not() -> None:
    busy = BusyTimes()
    busy.book(["a", "b"], 0.0, 10.0)
    assert busy.earliest(["b"], 0.0, 1.0) == 10.0
    busy.forget_before(["a"], 10.0)
    assert busy.earliest(["a"], 0.0, 1.0) == 0.0  # forgotten: nothing later reaches back
    assert busy.earliest(["b"], 0.0, 1.0) == 10.0
