"""Keep Python's cyclic garbage collector from pausing the training loop.

Python collects cycles when enough objects have been allocated; every so often it scans all
tracked objects (a full collection). With torch, the workload and the runtime loaded that is
some 170,000 objects, scanned at a moment no one chooses: the action during which it runs can
take several times its usual length, and the next stage waits for it.

:func:`frozen_heap` collects once, then moves every object alive (modules, parameters,
optimizer, imported code: what lives for the whole run) to the permanent generation
(``gc.freeze``), so later collections only scan what the loop itself creates, a small
fraction of that. Nothing is leaked: frozen objects stay alive anyway, and
``gc.unfreeze`` on the way out hands them back to the collector.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen_heap"]


@contextmanager
def frozen_heap() -> Iterator[int]:
    """Collect, freeze what is alive for the ``with`` block; yields the objects frozen."""
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()
