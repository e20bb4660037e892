"""The proxy: one completion = one prefill worker + one decode worker, the KV moved by kvd.

``POST /v1/completions {"prompt_token_ids": [...], "max_tokens": n}`` ->
``{"tokens", "prefill", "decode", "kv_bytes", "kv_move_s", "key"}``.

For each request it takes a fresh transfer key and the next prefill and the next decode
worker (round robin over each list: xPyD), and sends both requests at once: the decode
worker posts its get, the prefill worker pushes the KV to the decode worker's daemon. Every
call has a timeout; the proxy never waits longer than the decode worker's KV timeout plus
``--http-timeout-s``.

Errors: the decode worker got no KV in time -> 504 with its reason and what happened to the
prefill; a bad request -> 400; anything else -> 502 with the reason.

    python proxy.py --port 8000 --prefill http://127.0.0.1:8101 \\
        --decode http://127.0.0.1:8201=127.0.0.1:14579     # decode URL = its kvd peer address
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web


@dataclass(frozen=True)
class DecodeTarget:
    url: str
    kvd_peer: str  # host:port of the decode worker's daemon, where prefill puts the KV

    @classmethod
    def parse(cls, spec: str) -> DecodeTarget:
        url, sep, peer = spec.partition("=")
        if not sep or not url or not peer:
            raise argparse.ArgumentTypeError(f"expected URL=HOST:PORT, got {spec!r}")
        return cls(url.rstrip("/"), peer)


@dataclass
class Reply:
    status: int  # 0: no HTTP answer
    body: dict[str, Any]

    @property
    def reason(self) -> str:
        return str(self.body.get("error", f"HTTP {self.status}"))


class Proxy:
    def __init__(self, prefill: list[str], decode: list[DecodeTarget], kv_timeout_s: float,
                 http_timeout_s: float) -> None:
        self.prefill_urls = [u.rstrip("/") for u in prefill]
        self.decode_targets = decode
        self._next_prefill = itertools.cycle(self.prefill_urls)
        self._next_decode = itertools.cycle(decode)
        self.kv_timeout_s = kv_timeout_s
        self.http_timeout_s = http_timeout_s
        self.session: aiohttp.ClientSession | None = None

    async def post(self, url: str, payload: dict[str, Any], timeout_s: float) -> Reply:
        """POST JSON; never raises, never waits past ``timeout_s``."""
        assert self.session is not None
        try:
            async with self.session.post(url, json=payload,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                try:
                    body = await r.json(content_type=None)
                except ValueError:
                    body = {"error": f"HTTP {r.status}: {(await r.text())[:200]!r}"}
                if not isinstance(body, dict):
                    body = {"error": f"HTTP {r.status}: unexpected body {body!r:.200}"}
                return Reply(r.status, body)
        except TimeoutError:
            return Reply(0, {"error": f"no answer within {timeout_s:g}s"})
        except aiohttp.ClientError as exc:
            return Reply(0, {"error": f"{type(exc).__name__}: {exc}"})

    async def complete(self, prompt_ids: list[int], max_tokens: int) -> tuple[int, dict[str, Any]]:
        key = uuid.uuid4().hex
        p, d = next(self._next_prefill), next(self._next_decode)
        decode = asyncio.create_task(self.post(
            f"{d.url}/decode",
            {"key": key, "prompt_len": len(prompt_ids), "max_tokens": max_tokens,
             "timeout_s": self.kv_timeout_s},
            self.kv_timeout_s + self.http_timeout_s))
        prefill = asyncio.create_task(self.post(
            f"{p}/prefill",
            {"key": key, "prompt_token_ids": prompt_ids, "decode_daemon": d.kvd_peer},
            self.http_timeout_s))
        pre = await prefill
        if pre.status == 400:  # the request itself is bad: no KV will ever come
            decode.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await decode
            return 400, {"error": f"prefill worker {p}: {pre.reason}"}
        dec = await decode
        prefill_said = (f"prefill {p} failed: {pre.reason}" if pre.status != 200
                        else f"prefill {p} sent it")
        if dec.status == 504:
            return 504, {"error": f"decode worker {d.url}: {dec.reason} ({prefill_said})"}
        if dec.status == 400:
            return 400, {"error": f"decode worker {d.url}: {dec.reason}"}
        if dec.status != 200:
            return 502, {"error": f"decode worker {d.url}: {dec.reason} ({prefill_said})"}
        if pre.status != 200:
            return 502, {"error": f"decode worker {d.url} got KV but {prefill_said}"}
        tokens = dec.body["tokens"]
        if tokens[:1] != [pre.body["first_token"]]:
            return 502, {"error": f"first token differs: prefill {pre.body['first_token']}, "
                                  f"decode {tokens[:1]}"}
        return 200, {"tokens": tokens, "prefill": p, "decode": d.url, "key": key,
                     "kv_bytes": pre.body["kv_bytes"], "kv_move_s": pre.body["put_s"],
                     "get_s": dec.body["get_s"]}


PROXY = web.AppKey("proxy", Proxy)
routes = web.RouteTableDef()


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"error": "body is not JSON"}, status=400)
    ids = body.get("prompt_token_ids") if isinstance(body, dict) else None
    max_tokens = body.get("max_tokens", 16) if isinstance(body, dict) else None
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        return web.json_response({"error": "prompt_token_ids must be a non-empty list of ints"},
                                 status=400)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return web.json_response({"error": "max_tokens must be a positive int"}, status=400)
    status, out = await request.app[PROXY].complete(ids, max_tokens)
    return web.json_response(out, status=status)


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    return web.json_response({"ok": True, "prefill": proxy.prefill_urls,
                              "decode": [d.url for d in proxy.decode_targets]})


def make_app(proxy: Proxy) -> web.Application:
    app = web.Application()
    app[PROXY] = proxy

    async def session(app: web.Application) -> AsyncIterator[None]:
        async with aiohttp.ClientSession() as s:
            proxy.session = s
            yield

    app.cleanup_ctx.append(session)
    app.router.add_routes(routes)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill worker (repeat for more)")
    p.add_argument("--decode", action="append", required=True, type=DecodeTarget.parse,
                   metavar="URL=HOST:PORT",
                   help="a decode worker and its kvd daemon's peer address (repeat for more)")
    p.add_argument("--kv-timeout-s", type=float, default=5.0,
                   help="how long a decode worker waits for a request's KV")
    p.add_argument("--http-timeout-s", type=float, default=30.0,
                   help="how long a worker may take to compute, on top of the KV wait")
    args = p.parse_args(argv)
    proxy = Proxy(args.prefill, args.decode, args.kv_timeout_s, args.http_timeout_s)
    web.run_app(make_app(proxy), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
