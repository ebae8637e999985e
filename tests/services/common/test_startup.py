"""freeze_heap: what a process loaded before serving is out of the garbage collector's walks."""

from __future__ import annotations

import gc

from services.common.startup import freeze_heap


def test_what_was_loaded_is_frozen_and_what_serving_allocates_is_not():
    loaded = [{"i": i} for i in range(1000)]
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= len(loaded)
        tracked = {id(o) for o in gc.get_objects()}
        assert id(loaded) not in tracked and id(loaded[0]) not in tracked  # no collection walks them
        later = [{"j": 1}]
        assert id(later) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
