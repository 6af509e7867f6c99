"""freeze_startup_heap moves what is alive to the permanent generation and leaves later
objects collectable."""

from __future__ import annotations

import gc
import weakref

from pdserve.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_startup_heap() -> None:
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        later = _Node()
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None  # allocated after the freeze: still collected
    finally:
        gc.unfreeze()
