"""Accept loops that outlive a shortage: of descriptors, of kernel memory, of patience.

An ``accept`` fails for reasons that pass: the process is out of descriptors (``EMFILE``),
the system is (``ENFILE``), the kernel is short of memory (``ENOBUFS``, ``ENOMEM``), or the
connection was reset while it waited in the backlog (``ECONNABORTED``, ``EPROTO``). None of
them is the listener's fault, and a loop that ended on one would leave the port open and
deaf for good. ``Acceptor`` logs the failure (at most once per ``_REPORT_EVERY_S``, saying
how many it did not log, and the open-file limit when that is what ran out), waits a moment
that grows while the shortage lasts (the connection stays in the backlog, and the listener
would report it ready again at once), and accepts again. Only the listener's own end (it
was closed) ends the loop.

Why not ``loop.create_server``: uvloop closes a server, silently, on any error its accept
reports (libuv sheds connections itself on ``EMFILE`` while a spare descriptor lasts, then
reports it).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_REPORT_EVERY_S = 10.0
_FIRST_PAUSE_S = 0.05
_LONGEST_PAUSE_S = 1.0
# A connection reset in the backlog: nothing ran short, take the next one at once.
_PASSING = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR})


class Throttled:
    """A warning logged at most once per ``every_s``; the next one says how many were not
    (thread-safe: the segment socket's accept runs in a thread)."""

    def __init__(self, logger: logging.Logger, every_s: float = _REPORT_EVERY_S) -> None:
        self._log = logger
        self._every_s = every_s
        self._last = -every_s
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._every_s:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        if held:
            msg += " (%d more like it in the last %gs, not logged)"
            args = (*args, held, self._every_s)
        self._log.warning(msg, *args)


def accept_error(exc: OSError) -> str:
    """What went wrong, for the log; the open-file limit when that is what ran out."""
    if exc.errno == errno.EMFILE:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return f"{exc} (open file limit {soft}: raise LimitNOFILE)"
    return str(exc)


class Acceptor:
    """Accepts on a non-blocking listening ``sock`` until closed, handing each connection
    (socket, address) to ``on_accept`` on the loop; ``what`` names the socket in the log."""

    def __init__(self, sock: socket.socket, what: str,
                 on_accept: Callable[[socket.socket, Any], None]) -> None:
        self.sock = sock
        self.what = what
        self._on_accept = on_accept
        self._loop = asyncio.get_running_loop()
        self._failed = Throttled(log)
        self._task = self._loop.create_task(self._run(), name=f"kvd-accept-{what}")

    def close(self) -> None:
        """Stop accepting, and close the listening socket."""
        self._task.cancel()  # (removes the loop's reader of the socket at once)
        self.sock.close()

    async def wait_closed(self) -> None:
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        pause = _FIRST_PAUSE_S
        while True:
            try:
                conn, addr = await self._loop.sock_accept(self.sock)
            except OSError as exc:
                if self.sock.fileno() < 0:
                    return  # the listener was closed: the owner is stopping
                if exc.errno in _PASSING:
                    continue
                self._failed.warning("%s: accept failed: %s; accepting again in %gs",
                                     self.what, accept_error(exc), pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, _LONGEST_PAUSE_S)
                continue
            pause = _FIRST_PAUSE_S
            try:
                self._on_accept(conn, addr)
            except Exception:  # a bug in one connection's start must not stop the socket
                log.exception("%s: could not take a connection", self.what)
                conn.close()
