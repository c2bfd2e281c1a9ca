"""Every schedule pipedream knows, by name. Adding one is a new module of this package that
builds its :class:`~pipedream.schedules.schedule.Schedule`, listed here, plus its literal test."""

from __future__ import annotations

from pipedream.errors import ScheduleError
from pipedream.schedules.gpipe import GPIPE
from pipedream.schedules.interleaved_1f1b import INTERLEAVED_1F1B
from pipedream.schedules.onefoneb import ONE_F_ONE_B
from pipedream.schedules.pipedream import PIPEDREAM
from pipedream.schedules.schedule import Schedule
from pipedream.schedules.twobw import TWO_BW
from pipedream.schedules.vertical_sync import PIPEDREAM_VS
from pipedream.schedules.zero_bubble import ZB_H1, ZBV

__all__ = ["SCHEDULES", "lookup"]

SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (PIPEDREAM, PIPEDREAM_VS, TWO_BW, ONE_F_ONE_B, GPIPE, INTERLEAVED_1F1B, ZB_H1, ZBV)
}
"""The schedules by name, in the order the docs list them."""


def lookup(name: str) -> Schedule:
    """The schedule called ``name`` (:class:`ScheduleError` naming the known ones if none)."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(
            f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}"
        ) from None
