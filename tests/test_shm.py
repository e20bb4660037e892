"""Client-side shared memory: a segment's descriptor goes with its last tensor, and the
bookkeeping never waits for itself."""

from __future__ import annotations

import gc
import threading

import torch

from kvd import shared_empty
from kvd.client import shm


def test_a_segment_collected_while_its_own_thread_holds_the_books() -> None:
    """A segment's descriptor is closed by a finalizer, and finalizers run wherever the
    garbage collector does: also inside ``shm``'s own ``with _lock``, when an allocation
    there collects a cycle that held another segment (a whole test run once hung so, in
    ``shared_empty``). Here the collection is forced inside the lock."""
    t = shared_empty(64, torch.uint8)
    seg_id = shm._segments[t.untyped_storage().data_ptr()].id
    cycle: list[object] = [t]
    cycle.append(cycle)  # only the collector frees it
    del t, cycle

    def collect_inside_the_lock() -> None:
        with shm._lock:
            gc.collect()

    worker = threading.Thread(target=collect_inside_the_lock, daemon=True)  # (a stuck one
    worker.start()                                    # must not keep pytest from exiting)
    worker.join(10)
    assert not worker.is_alive(), "the finalizer waited for the lock its own thread held"
    assert seg_id not in shm._by_id, "the collected segment is still on the books"
