"""The systemd notify protocol, on the ``NOTIFY_SOCKET`` datagram socket.

``READY=1`` once every listener is up and the pool is allocated, ``STATUS=`` lines,
``WATCHDOG=1`` from the event loop every half ``WATCHDOG_USEC`` (so a stuck loop gets the
service restarted), ``STOPPING=1`` when draining starts. Without ``NOTIFY_SOCKET`` (not run
by systemd) every call is a no-op.

``StartupSteps``: the start-up's steps, each logged with its time since the process started
and its own duration, the same words in ``STATUS=``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
startup_log = logging.getLogger("kvd.startup")


class Notifier:
    SEND_WAIT_S = 1.0

    def __init__(self) -> None:
        address = os.environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self._address = address
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        self.watchdog_s: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self._watchdog: asyncio.Task[None] | None = None

    def send(self, *lines: str, wait: bool = True) -> None:
        """One datagram. A receiver that reads late (its queue holds a few datagrams)
        holds it ``SEND_WAIT_S`` at most, or not at all without ``wait``."""
        if self._sock is None:
            return
        data = "\n".join(lines).encode()
        try:
            try:
                self._sock.sendto(data, self._address)
            except BlockingIOError:
                if not wait:
                    raise
                poller = select.poll()
                poller.register(self._sock, select.POLLOUT)
                if not poller.poll(self.SEND_WAIT_S * 1e3):
                    raise
                self._sock.sendto(data, self._address)
        except OSError as exc:  # systemd went away, or is behind: nothing to tell
            log.debug("sd_notify failed: %s", exc)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        """Best effort: a start-up step's progress never waits for the receiver (the
        next line says where it stands anyway)."""
        self.send(f"STATUS={status}", wait=False)

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def start_watchdog(self) -> None:
        if self._sock is None or self.watchdog_s is None:
            return
        interval = self.watchdog_s / 2

        async def ping() -> None:
            while True:
                self.send("WATCHDOG=1")
                await asyncio.sleep(interval)

        self._watchdog = asyncio.get_running_loop().create_task(ping(), name="kvd-watchdog")

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _process_started_at() -> float:
    """The process's start on the ``time.monotonic()`` clock, from ``/proc/self/stat``
    (so the interpreter's own start and the imports count); where that cannot be read,
    the moment this module was imported."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # starttime: clock ticks after boot (field 22 of proc(5))
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - age if 0.0 <= age < 3600.0 else now


def _clock_from_process_start() -> None:
    global _PROCESS_STARTED_AT
    _PROCESS_STARTED_AT = _process_started_at()


_PROCESS_STARTED_AT = 0.0
_clock_from_process_start()
# A process forked from this one (as the tests fork `kvd serve`) started when it was forked.
os.register_at_fork(after_in_child=_clock_from_process_start)


def since_process_start() -> float:
    """Seconds since this process started."""
    return time.monotonic() - _PROCESS_STARTED_AT


class StartupSteps:
    """The start-up's steps as the operator sees them: each in the log with its time
    (seconds since the process started) and its own duration, and each said to systemd
    (``STATUS=``), so that a slow start shows where it is.

    A step that runs in a worker thread (taking the host pool) reports with ``progress``
    (any thread), logged at every tenth of the way; ``tick``, called every second or so
    meanwhile, repeats where it stands when ``QUIET_S`` passed without a line (a part with
    no progress of its own: pinning the pool is one call)."""

    QUIET_S = 5.0

    def __init__(self, notifier: Notifier | None = None) -> None:
        # Who is told each step's status: systemd, and whoever the daemon adds.
        self.tell: list[Callable[[str], None]] = [notifier.status] if notifier else []
        self._lock = threading.Lock()
        self._step = ""
        self._step_began = time.monotonic()
        self._last_line = time.monotonic()
        self._tenth = -1
        self.progress_text = ""  # where the running step stands (for /readyz)

    def line(self, text: str) -> None:
        """One start-up line: ``+2.15s <text>``, the time since the process started."""
        startup_log.info("+%.2fs %s", since_process_start(), text)
        with self._lock:
            self._last_line = time.monotonic()

    def begin(self, status: str, announce: bool = False) -> None:
        """A step starts: systemd's STATUS says ``status``; ``announce`` logs it too (the
        steps that can take long)."""
        with self._lock:
            self._step, self._step_began = status, time.monotonic()
            self._tenth, self.progress_text = -1, ""
        self._status(status)
        if announce:
            self.line(status)

    def done(self, text: str, began: float | None = None) -> float:
        """The step ``begin`` started (or the one that started at ``began``, on the
        monotonic clock) is done: logs ``text`` with its duration, and returns that."""
        took = time.monotonic() - (self._step_began if began is None else began)
        self.line(f"{text} (took {took:.2f}s)")
        return took

    def progress(self, text: str, tenth: int | None = None) -> None:
        """Where the running step stands (any thread); logged when ``tenth`` (0-10: how
        far, where it can be told) passes a new mark, or when it is a new part (None)."""
        with self._lock:
            new_part = tenth is None and text != self.progress_text
            due = new_part or (tenth is not None and tenth > self._tenth)
            if tenth is not None:
                self._tenth = max(self._tenth, tenth)
            self.progress_text = text
        if due:
            self._say(text)

    def tick(self) -> None:
        """Repeat where the running step stands if nothing was said for ``QUIET_S``."""
        with self._lock:
            quiet = time.monotonic() - self._last_line >= self.QUIET_S
            text = self.progress_text
        if quiet and text:
            self._say(text)

    def _say(self, text: str) -> None:
        with self._lock:
            step, so_far = self._step, time.monotonic() - self._step_began
        self.line(f"{text}, {so_far:.1f}s so far")
        self._status(f"{step}: {text}")

    def _status(self, status: str) -> None:
        for tell in self.tell:
            tell(status)
