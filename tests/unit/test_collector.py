"""frozen_heap: what lives before the loop is kept out of the collector's scans, then handed
back."""

from __future__ import annotations

import gc

from pipedream.runtime.gc_freeze import frozen_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_heap_is_frozen_inside_and_handed_back_after() -> None:
    before = [_Cycle() for _ in range(1000)]
    with frozen_heap() as frozen:
        assert frozen >= len(before) and gc.get_freeze_count() >= len(before)
        tracked = {id(obj) for obj in gc.get_objects()}  # what a collection scans
        assert not any(id(obj) in tracked for obj in before)
        garbage = _Cycle()
        del garbage
        assert gc.collect() >= 1  # cycles made inside are still collected
    assert gc.get_freeze_count() == 0
    del before
    assert gc.collect() >= 1000  # the frozen cycles are collectable again
