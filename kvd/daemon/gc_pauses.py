"""The garbage collector of a long-running daemon: what start-up made is frozen, and each
collection's pause is measured.

Importing torch, pyzmq, aiohttp and the rest leaves about 190,000 objects that live as long
as the process, and each full collection of CPython's walks them all: 130-140 ms on the CPU
machine, on the event loop, so every transfer through the daemon waits it out (in a mesh of
64 daemons these pauses set the tail). Once the daemon has started, ``freeze_startup`` takes
them out of the collector's sight (``gc.freeze``): a later collection walks only what was
made since, the daemon's working set (a full one then takes microseconds to a few
milliseconds). CPython's thresholds are left as they are.

``GcPauses`` times every collection in the process (``gc.callbacks``), for
``kvd_gc_pause_seconds`` and the status report's longest pause.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from typing import Any


def freeze_startup() -> int:
    """Collect what start-up left as garbage, then freeze everything left; the number of
    objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Each collection's pause, by generation, as it ends (``observe``), and the longest."""

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self._observe = observe
        self.collections = [0, 0, 0]  # by generation
        self.longest_s = 0.0
        self._began = 0.0

    def install(self) -> None:
        gc.callbacks.append(self._on_collection)

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        pause = time.perf_counter() - self._began
        generation = int(info["generation"])
        self.collections[generation] += 1
        self.longest_s = max(self.longest_s, pause)
        self._observe(generation, pause)

    def stats(self) -> dict[str, Any]:
        return {"collections": list(self.collections), "longest_pause_s": self.longest_s,
                "frozen_objects": gc.get_freeze_count()}
