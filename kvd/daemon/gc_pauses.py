"""The garbage collector of a long-running daemon: what start-up made is frozen, and each
collection's pause is timed.

Start-up leaves ~190,000 objects (torch, pyzmq, aiohttp and the rest) that live as long as
the process, and a full collection walked them all in 130-140 ms, on the event loop. Once
the daemon is ready, ``freeze_startup`` takes them out of the collector's sight
(``gc.freeze``), so a collection walks only the working set; CPython's thresholds stay as
they are. ``GcPauses`` times every collection (``gc.callbacks``): in wall time, which is
what the loop waits, and in the collecting thread's CPU time, which is the collector's own
work (on a loaded host the two differ by the time the thread was not running).
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any


def freeze_startup() -> int:
    """Collect what start-up left as garbage, then freeze everything left; the number of
    objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Each collection's pause, as it ends: counts by generation and the longest."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]  # by generation
        self.longest_s = 0.0
        self.longest_cpu_s = 0.0  # the collecting thread's CPU time in its longest
        # As counted when frozen: gc.get_freeze_count() walks them all (~1 ms for 230,000,
        # which a status call once paid, and a tool polling status with each transfer too)
        self.frozen_objects = 0
        self._began = self._began_cpu = 0.0

    def install(self) -> None:
        gc.callbacks.append(self._on_collection)

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began, self._began_cpu = time.perf_counter(), time.thread_time()
            return
        pause = time.perf_counter() - self._began
        self.collections[info["generation"]] += 1
        if pause > self.longest_s:
            self.longest_s = pause
            self.longest_cpu_s = time.thread_time() - self._began_cpu

    def stats(self) -> dict[str, Any]:
        return {"collections": list(self.collections), "longest_pause_s": self.longest_s,
                "longest_pause_cpu_s": self.longest_cpu_s,
                "frozen_objects": self.frozen_objects}
