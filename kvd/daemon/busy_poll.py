"""Keep the event loop turning while work flows (busy polling).

On a virtual machine a loop that sleeps in its poll between messages pays for every
wake-up: the first Python after it runs several times slower than hot (docs/architecture.md,
"Busy polling where there is a GPU"). While transfers flow, ``BusyPoll`` keeps one callback
queued, so the loop polls with a zero timeout: messages are seen at once and the core stays
hot. It spins for ``window_s`` after the last message, then the loop sleeps as usual.

A spinning loop holds the GIL nearly all the time (it lets go only inside each
zero-timeout poll, too briefly for a waiting thread to take it), so the loop stops
spinning while any work it handed to a thread (a copy, an NCCL job, a TCP send or receive)
is unfinished, and starts again at the next message. (An NCCL channel's worker keeps
itself awake between jobs instead: ``transport.nccl_channel``.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any


class BusyPoll:
    """Spins ``loop`` for ``window_s`` after each :meth:`touch`; ``window_s`` 0: never."""

    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float) -> None:
        self._loop = loop
        self.window_s = window_s
        self._until = 0.0
        self._spinning = False
        # Futures of work handed to threads; set.add / discard are atomic under the GIL,
        # so worker threads may discard theirs without a lock.
        self._threads: set[concurrent.futures.Future[Any]] = set()
        self.turns = 0  # zero-timeout turns of the loop, for stats and tests

    @property
    def spinning(self) -> bool:
        return self._spinning

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    def touch(self) -> None:
        """Work arrived: spin until ``window_s`` from now (unless a thread is working)."""
        if not self.enabled:
            return
        self._until = self._loop.time() + self.window_s
        if not self._spinning and not self._threads:
            self._spinning = True
            self._loop.call_soon(self._turn)

    def thread_work(self, fut: concurrent.futures.Future[Any]) -> None:
        """Work handed to a thread: no spinning until ``fut`` is done."""
        if not self.enabled or fut.done():
            return
        self._threads.add(fut)
        fut.add_done_callback(self._threads.discard)

    def stats(self) -> dict[str, Any]:
        return {"window_s": self.window_s, "turns": self.turns,
                "threads_working": len(self._threads)}

    def _turn(self) -> None:
        if self._threads or self._loop.time() >= self._until:
            self._spinning = False  # the next touch starts again
            return
        self.turns += 1
        self._loop.call_soon(self._turn)
