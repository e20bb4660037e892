"""Timeline marks: where one transfer's time goes, across processes and threads.

A development aid for latency work, not a setting: no config key turns it on. While a
process records (a daemon started with ``KVD_TIMELINE_DIR=DIR`` in its environment, read
once at start by ``start_from_environment``, or ``start()`` called in a client),
``mark(name)`` appends the time (``time.perf_counter``: CLOCK_MONOTONIC, comparable between
processes of one host), the name and the thread to a list, written as JSON to
``<dir>/<pid>.json`` when recording stops (``stop()``, at a clean daemon exit, or at
interpreter exit). While not recording, a mark costs a function call. ``tools/timeline.py``
runs transfers with it on and prints, per mark, its median offset from the start of each
transfer: that is how the per-hop costs in docs/architecture.md's *Decisions* were found.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Mapping

# The one KVD_* variable besides the config's own that a daemon reads (kvd/config.py lets
# it through its check for misspelt ones).
ENV = "KVD_TIMELINE_DIR"

_marks: list[tuple[float, str, str]] | None = None
_dir = ""


def start(directory: str) -> None:
    """Record marks from now on; they go to ``directory`` when recording stops."""
    global _marks, _dir
    os.makedirs(directory, exist_ok=True)
    if _marks is None:
        atexit.register(stop)
    _dir, _marks = directory, []


def start_from_environment(env: Mapping[str, str] | None = None) -> bool:
    """Record if ``KVD_TIMELINE_DIR`` (in ``env``, default ``os.environ``) names a directory;
    True if recording started. An empty value is unset."""
    directory = (os.environ if env is None else env).get(ENV, "")
    if not directory:
        return False
    start(directory)
    return True


def recording() -> bool:
    """Whether marks are being recorded (for a mark that costs more than a call to make)."""
    return _marks is not None


def mark(name: str) -> None:
    marks = _marks
    if marks is not None:  # list.append is atomic: any thread may mark
        marks.append((time.perf_counter(), name, threading.current_thread().name))


def stop() -> None:
    """Stop recording and write what was recorded (idempotent)."""
    global _marks
    marks, _marks = _marks, None
    if marks is None:
        return
    path = os.path.join(_dir, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "marks": marks}, f)
    os.replace(path + ".tmp", path)
