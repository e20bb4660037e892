"""HTTP for operators: ``/metrics``, ``/healthz``, ``/readyz``, ``/v1/status``, ``/v1/peers``.

Embedded with aiohttp's ``AppRunner``/``TCPSite`` (``run_app`` would take over the loop and
the signals). It starts first, so ``/healthz`` answers and ``/readyz`` says why the daemon
is not ready while the pool is still being allocated.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvd.config import Config
from kvd.errors import ConfigError

log = logging.getLogger(__name__)


class HttpServer:
    def __init__(self, config: Config, daemon: Any) -> None:
        self.config = config
        self.daemon = daemon
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/v1/peers", self._peers)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self.address = ""

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.http_host, self.config.http_port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigError(f"http_port: cannot listen on {self.config.http_host}:"
                              f"{self.config.http_port}: {exc.strerror}") from None
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        port = sockets[0].getsockname()[1] if sockets else self.config.http_port
        self.address = f"{self.config.http_host}:{port}"
        log.info("http listening address=%s", self.address)

    async def close(self) -> None:
        await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.daemon.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})  # answering at all means the loop is alive

    async def _readyz(self, request: web.Request) -> web.Response:
        reasons = self.daemon.not_ready_reasons()
        status = 503 if reasons else 200
        return web.json_response({"ready": not reasons, "reasons": reasons}, status=status)

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.daemon.status())

    async def _peers(self, request: web.Request) -> web.Response:
        return web.json_response(self.daemon.status().get("peer", {}))
