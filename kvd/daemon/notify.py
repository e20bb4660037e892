"""The systemd notify protocol, on the ``NOTIFY_SOCKET`` datagram socket.

``READY=1`` once every listener is up and the pool is allocated, ``STATUS=`` lines,
``WATCHDOG=1`` from the event loop every half ``WATCHDOG_USEC`` (so a stuck loop gets the
service restarted), ``STOPPING=1`` when draining starts. Without ``NOTIFY_SOCKET`` (not run
by systemd) every call is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self._address = address
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_s: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *lines: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:  # systemd went away: nothing to tell
            log.debug("sd_notify failed: %s", exc)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

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
