"""HTTP for operators: ``/metrics``, ``/healthz``, ``/readyz``, ``/v1/status``, ``/v1/peers``.

Embedded with aiohttp's ``AppRunner`` (``run_app`` would take over the loop and the
signals). It starts first, so ``/healthz`` answers and ``/readyz`` says why the daemon
is not ready while the pool is still being allocated.

The listening sockets are bound here and accepted on by ``Acceptor`` (each connection
handed to aiohttp's protocol factory, ``runner.server``), not by a ``TCPSite``: uvloop's
server drops the connections waiting in its backlog when the process is out of
descriptors, and closes itself for good on other accept errors. A liveness probe that
came during a moment of exhaustion would go unanswered, and an orchestrator restart a
healthy daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvd.config import Config
from kvd.daemon.accepting import Acceptor
from kvd.daemon.futures import keep_task
from kvd.errors import ConfigError

log = logging.getLogger(__name__)


class HttpServer:
    def __init__(self, config: Config, registry: CollectorRegistry,
                 status: Callable[[], dict[str, Any]], not_ready: Callable[[], list[str]]
                 ) -> None:
        self.config = config
        self._registry = registry
        self._daemon_status = status
        self._not_ready = not_ready
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/v1/peers", self._peers)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._acceptors: list[Acceptor] = []
        self._admitting: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self) -> None:
        host, port = self.config.http_host, self.config.http_port
        try:
            listeners = _listen(host, port)
        except OSError as exc:
            raise ConfigError(f"http_port: cannot listen on {host}:{port}: "
                              f"{exc.strerror}") from None
        try:
            await self._runner.setup()
        except BaseException:
            for listener in listeners:
                listener.close()
            raise
        self._acceptors = [Acceptor(s, "http_port", self._take) for s in listeners]
        self.address = f"{host}:{listeners[0].getsockname()[1]}"
        log.info("http listening address=%s", self.address)

    async def close(self) -> None:
        """No new connections, then aiohttp's own shutdown of those it serves."""
        for acceptor in self._acceptors:
            acceptor.close()
        for task in self._admitting:
            task.cancel()
        await asyncio.gather(*(a.wait_closed() for a in self._acceptors), *self._admitting,
                             return_exceptions=True)
        await self._runner.cleanup()

    def _take(self, sock: socket.socket, _addr: Any) -> None:
        keep_task(self._admitting, self._admit(sock))

    async def _admit(self, sock: socket.socket) -> None:
        server = self._runner.server
        try:
            if server is None:  # (cleaned up meanwhile: the daemon is stopping)
                raise ConnectionAbortedError("http server stopped")
            await asyncio.get_running_loop().connect_accepted_socket(server, sock)
        except (OSError, asyncio.CancelledError) as exc:
            log.debug("http connection not taken: %r", exc)
            sock.close()
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})  # answering at all means the loop is alive

    async def _readyz(self, request: web.Request) -> web.Response:
        reasons = self._not_ready()
        status = 503 if reasons else 200
        return web.json_response({"ready": not reasons, "reasons": reasons}, status=status)

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self._daemon_status())

    async def _peers(self, request: web.Request) -> web.Response:
        return web.json_response(self._daemon_status().get("peer", {}))


def _listen(host: str, port: int) -> list[socket.socket]:
    """Non-blocking listeners on every address ``host`` names (as ``loop.create_server``
    binds them: ``localhost`` is IPv4 and IPv6). ``port`` 0 gives each listener a free
    port of its own, and the address reported is the first's (as with ``create_server``)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # (or it takes the IPv4 port too, and the next fails)
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    return listeners
