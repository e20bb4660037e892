"""What the prefill and the decode worker share: their flags, the model, the KV blocks
registered with the local kvd daemon (once per process, at startup), one compute thread,
and the aiohttp plumbing (``GET /healthz``, JSON errors)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from aiohttp import web
from model import COMPUTE_THREADS, load_model
from paged_kv import NUM_BLOCKS, BlockAllocator, PagedKV

import kvd

T = TypeVar("T")


@dataclass
class Worker:
    name: str
    model: Any
    kv: PagedKV
    blocks: BlockAllocator
    client: kvd.AsyncKvdClient
    region: kvd.Region
    executor: ThreadPoolExecutor

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run model work on the compute thread; the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


WORKER = web.AppKey("worker", Worker)


class BadInput(Exception):
    pass


class NoDaemon(Exception):
    """No kvd daemon answers at ``socket_path``: the worker cannot start."""

    def __init__(self, socket_path: str) -> None:
        super().__init__(socket_path)
        self.socket_path = socket_path


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--socket", default=os.environ.get("KVD_SOCKET_PATH"),
                   help="the local kvd daemon's socket (default: $KVD_SOCKET_PATH, else "
                        "kvd's default path)")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cpu",
                   help="where the model runs (the KV blocks are CPU shared memory until "
                        "kvd's GPU transport lands)")
    p.add_argument("--num-blocks", type=int, default=NUM_BLOCKS)
    return p.parse_args(argv)


def make_app(name: str, args: argparse.Namespace,
             routes: Iterable[web.RouteDef]) -> web.Application:
    app = web.Application()

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        torch.set_num_threads(COMPUTE_THREADS)
        executor = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-compute")
        client = kvd.AsyncKvdClient(args.socket, name=name)
        try:
            try:  # first: without a daemon the worker has nothing to do
                await client.connect()
            except kvd.DaemonUnavailable:
                raise NoDaemon(client.socket_path) from None
            loop = asyncio.get_running_loop()
            model = await loop.run_in_executor(executor, load_model, args.model_dir,
                                               args.device)
            kv = PagedKV.for_model(model, args.num_blocks)
            region = await kv.register(client)  # once per process
            app[WORKER] = Worker(name, model, kv, BlockAllocator(kv.num_blocks), client,
                                 region, executor)
            yield
        finally:
            await client.aclose()
            executor.shutdown(wait=True)

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/healthz", healthz)
    app.router.add_routes(routes)
    return app


async def healthz(request: web.Request) -> web.Response:
    w = request.app[WORKER]
    return web.json_response({"ok": True, "worker": w.name, "kvd_node": w.client.node_id,
                              "free_blocks": w.blocks.num_free})


def error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)


def kvd_error(exc: kvd.KvdError) -> web.Response:
    """A kvd timeout is 504 (the KV did not come in time), any other kvd error 502."""
    if isinstance(exc, kvd.KvdTimeout):
        return error(504, str(exc))
    return error(502, f"{type(exc).__name__}: {exc}")


async def read_body(request: web.Request, fields: dict[str, type]) -> dict[str, Any]:
    """The JSON body with these fields, each of its type (lists: of ints)."""
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadInput(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadInput("body must be a JSON object")
    for name, kind in fields.items():
        value = body.get(name)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = body[name] = float(value)
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if kind is list:
            ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not ok:
            what = "a list of ints" if kind is list else kind.__name__
            raise BadInput(f"field {name!r} must be {what}")
    return body


def serve(app: web.Application, host: str, port: int) -> None:
    try:
        web.run_app(app, host=host, port=port, print=None, access_log=None)
    except NoDaemon as exc:
        print(f"no kvd daemon at {exc.socket_path}: start one with "
              f"`kvd serve --socket-path {exc.socket_path}`", file=sys.stderr)
        sys.exit(1)
