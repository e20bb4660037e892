"""A disaggregated-serving proxy for vLLM instances that move their KV cache with kvd.

Clients talk to it as to one OpenAI-compatible vLLM server (``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``). For each completion it picks the next
prefill and the next decode instance (round robin over each list, independently) and:

1. sends the client's request to prefill with ``max_tokens: 1`` (and
   ``max_completion_tokens: 1`` for chat), ``stream: false``, no ``stream_options`` and
   ``kv_transfer_params: {"do_remote_decode": true}``, plus ``"kvd_push_to": <decode's kvd
   daemon>`` in the push flow; prefill computes the prompt's KV, which its ``KvdConnector``
   hands to kvd, and answers with ``kv_transfer_params`` saying where the KV is;
2. sends the client's original request to decode with ``kv_transfer_params`` = exactly what
   prefill returned (none if prefill returned none: decode then recomputes the prompt, and
   the proxy logs a warning); decode loads the KV through kvd and generates;
3. passes decode's answer back unchanged, chunk by chunk when the client asked for
   ``stream: true``.

Errors: an upstream that cannot be reached -> 502, one that does not answer within
``--timeout-s`` -> 504 (both with a JSON error naming it); a prefill error status is passed
to the client as it came (decode is not called); decode's answer, error or not, is passed
as it came; a body that is not a JSON object -> 400.

Run it (examples/vllm/README.md has the whole setup)::

    kvd vllm-proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    # push flow: each decode also needs its kvd daemon's peer address; each prefill's
    # (optional) lets decode fail at once, not at its timeout, if that daemon is gone
    kvd vllm-proxy --port 8000 --flow push \\
        --prefill http://127.0.0.1:8100 --prefill-kvd 127.0.0.1:14579 \\
        --decode http://127.0.0.1:8200 --decode-kvd 127.0.0.1:14589

It ships with kvd (aiohttp is one of kvd's own dependencies) and imports nothing of vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("kvd-vllm-proxy")

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class DecodeTarget:
    url: str
    kvd: str | None  # its kvd daemon's peer address (host:port); needed for the push flow


class Answer(Exception):
    """Stop handling the request and send ``response`` to the client."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def error(status: int, message: str, upstream: str | None = None) -> web.Response:
    """An OpenAI-style JSON error."""
    kind = {400: "invalid_request_error", 502: "bad_gateway", 504: "gateway_timeout"}
    err: dict[str, Any] = {"message": message, "type": kind.get(status, "proxy_error"),
                           "code": status}
    if upstream is not None:
        err["upstream"] = upstream
    return web.json_response({"error": err}, status=status)


def passthrough(resp: aiohttp.ClientResponse, body: bytes) -> web.Response:
    """An upstream's answer as it came: status, content type, body."""
    content_type = resp.headers.get("Content-Type", "application/json")
    return web.Response(body=body, status=resp.status, headers={"Content-Type": content_type})


class Proxy:
    def __init__(self, prefill: list[str], decode: list[DecodeTarget], flow: str,
                 timeout_s: float, prefill_kvd: dict[str, str] | None = None) -> None:
        self.prefill = prefill
        self.prefill_kvd = prefill_kvd or {}  # prefill URL -> its kvd daemon's peer address
        self.decode = decode
        self.flow = flow
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.timeout_s = timeout_s
        self._next_prefill = itertools.cycle(prefill)
        self._next_decode = itertools.cycle(decode)
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ app life

    async def start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the app has not started"
        return self._session

    # ------------------------------------------------------------------ upstream calls

    async def _request(self, role: str, method: str, url: str, headers: dict[str, str],
                       payload: dict[str, Any] | None = None) -> aiohttp.ClientResponse:
        """Send a request and wait for the status line; errors become 502/504 answers."""
        try:
            return await self.session.request(method, url, json=payload, headers=headers)
        except asyncio.TimeoutError as exc:
            raise Answer(error(504, f"{role} {url} did not answer within {self.timeout_s:g} s",
                               url)) from exc
        except aiohttp.ClientError as exc:
            raise Answer(error(502, f"cannot reach {role} {url}: {exc}", url)) from exc

    async def _read(self, role: str, url: str, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except asyncio.TimeoutError as exc:
            raise Answer(error(504, f"{role} {url} did not finish its answer within "
                                    f"{self.timeout_s:g} s", url)) from exc
        except aiohttp.ClientError as exc:
            raise Answer(error(502, f"{role} {url} broke off its answer: {exc}", url)) from exc

    async def run_prefill(self, url: str, path: str, body: dict[str, Any],
                          headers: dict[str, str], push_to: str | None,
                          key: str | None = None) -> Any:
        """Prefill the prompt; return the ``kv_transfer_params`` prefill answered with."""
        payload = dict(body)
        payload["max_tokens"] = 1
        if path.endswith("/chat/completions"):
            payload["max_completion_tokens"] = 1
        payload["stream"] = False
        payload.pop("stream_options", None)
        payload.pop("min_tokens", None)  # would clash with max_tokens 1
        params: dict[str, Any] = {"do_remote_decode": True}
        if push_to is not None:
            params["kvd_push_to"] = push_to
        if key is not None:
            params["kvd_key"] = key
        payload["kv_transfer_params"] = params
        resp = await self._request("prefill", "POST", url + path, headers, payload)
        async with resp:
            data = await self._read("prefill", url, resp)
        if resp.status != 200:
            raise Answer(passthrough(resp, data))
        try:
            answer = json.loads(data)
        except ValueError as exc:
            raise Answer(error(502, f"prefill {url} answered 200 with a body that is not "
                                    f"JSON: {data[:200]!r}", url)) from exc
        return answer.get("kv_transfer_params") if isinstance(answer, dict) else None

    async def send_decode(self, request: web.Request, target: DecodeTarget,
                          body: dict[str, Any], headers: dict[str, str],
                          kv_params: dict[str, Any] | None) -> aiohttp.ClientResponse:
        """Send the original request plus ``kv_params``; the response, not yet read."""
        payload = dict(body)
        if kv_params is None:
            payload.pop("kv_transfer_params", None)
        else:
            payload["kv_transfer_params"] = kv_params
        return await self._request("decode", "POST", target.url + request.path, headers,
                                   payload)

    async def run_decode(self, request: web.Request, target: DecodeTarget,
                         body: dict[str, Any], headers: dict[str, str],
                         kv_params: dict[str, Any] | None) -> web.StreamResponse:
        """Send the original request plus prefill's params; relay decode's answer as it is."""
        resp = await self.send_decode(request, target, body, headers, kv_params)
        return await self.relay(request, target, body, resp)

    async def run_push(self, request: web.Request, prefill: str, target: DecodeTarget,
                       body: dict[str, Any], headers: dict[str, str], rid: str,
                       ) -> tuple[web.StreamResponse, float]:
        """Push flow: decode gets the request at the same time as prefill, under a key the
        proxy chose, so it is already waiting when prefill's daemon pushes the blocks.
        Decode's answer is relayed once prefill has succeeded; if prefill fails, decode's
        request is dropped (vLLM aborts it) and prefill's error is the answer."""
        key = f"proxy/{rid}"
        start = time.monotonic()
        params: dict[str, Any] = {"do_remote_prefill": True, "kvd_flow": "push",
                                  "kvd_key": key}
        if prefill in self.prefill_kvd:  # decode's wait then ends at once if it is gone
            params["kvd_source"] = self.prefill_kvd[prefill]
        waiting = asyncio.create_task(self.send_decode(request, target, body, headers,
                                                       params))
        try:
            kv_params = await self.run_prefill(prefill, request.path, body, headers,
                                               target.kvd, key)
        except BaseException:
            waiting.cancel()
            with contextlib.suppress(BaseException):
                (await waiting).close()
            raise
        prefill_s = time.monotonic() - start
        resp = await waiting
        if not isinstance(kv_params, dict):
            # Prefill sent nothing: decode would wait for blocks that never come.
            resp.close()
            log.warning("%s: prefill %s returned no kv_transfer_params (%r); decode %s "
                        "will recompute the prompt", rid, prefill, kv_params, target.url)
            return await self.run_decode(request, target, body, headers, None), prefill_s
        return await self.relay(request, target, body, resp), prefill_s

    async def relay(self, request: web.Request, target: DecodeTarget, body: dict[str, Any],
                    resp: aiohttp.ClientResponse) -> web.StreamResponse:
        """Decode's answer to the client as it comes (streamed if the client asked)."""
        async with resp:
            if not body.get("stream"):
                return passthrough(resp, await self._read("decode", target.url, resp))
            out = web.StreamResponse(status=resp.status, headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache"})
            await out.prepare(request)
            try:
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
            except (asyncio.TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                # Too late for an error status: cut the client's connection so that it sees
                # a truncated stream rather than a complete one.
                log.warning("stream from decode %s to the client broke off: %r",
                            target.url, exc)
                if request.transport is not None:
                    request.transport.close()
                return out
            await out.write_eof()
            return out

    # ------------------------------------------------------------------ handlers

    async def completion(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            return error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "request body must be a JSON object")

        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}  # the same id in both instances' logs
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        prefill, decode = next(self._next_prefill), next(self._next_decode)
        start = time.monotonic()
        prefill_s = float("nan")
        response: web.StreamResponse
        try:
            if self.flow == "push":
                response, prefill_s = await self.run_push(request, prefill, decode, body,
                                                          headers, rid)
            else:
                kv_params = await self.run_prefill(prefill, request.path, body, headers, None)
                prefill_s = time.monotonic() - start
                if not isinstance(kv_params, dict):
                    log.warning("%s: prefill %s returned no kv_transfer_params (%r); decode "
                                "%s will recompute the prompt", rid, prefill, kv_params,
                                decode.url)
                    kv_params = None
                response = await self.run_decode(request, decode, body, headers, kv_params)
        except Answer as answer:
            response = answer.response
        log.info("%s %s prefill=%s decode=%s prefill_s=%.3f total_s=%.3f status=%d", rid,
                 request.path, prefill, decode.url, prefill_s, time.monotonic() - start,
                 response.status)
        return response

    async def models(self, request: web.Request) -> web.Response:
        url = self.decode[0].url
        headers = {}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        try:
            resp = await self._request("decode", "GET", url + "/v1/models", headers)
            async with resp:
                return passthrough(resp, await self._read("decode", url, resp))
        except Answer as answer:
            return answer.response

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({
            "ok": True, "flow": self.flow, "prefill": self.prefill,
            "prefill_kvd": self.prefill_kvd,
            "decode": [{"url": d.url, "kvd": d.kvd} for d in self.decode]})


def make_app(proxy: Proxy) -> web.Application:
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    for path in COMPLETION_PATHS:
        app.router.add_post(path, proxy.completion)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/healthz", proxy.healthz)
    return app


def peer_address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvd vllm-proxy",
        description="Proxy for disaggregated prefill/decode vLLM instances using kvd.")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (8000)")
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill vLLM instance, e.g. http://127.0.0.1:8100 (repeatable)")
    parser.add_argument("--prefill-kvd", action="append", default=[], type=peer_address,
                        metavar="HOST:PORT",
                        help="the peer address of a prefill instance's kvd daemon, paired in "
                             "order with --prefill; push flow, optional: decode then fails a "
                             "load at once, not at its timeout, when that daemon is gone")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode vLLM instance (repeatable)")
    parser.add_argument("--decode-kvd", action="append", default=[], type=peer_address,
                        metavar="HOST:PORT",
                        help="the peer address of a decode instance's kvd daemon, paired in "
                             "order with --decode; required for each --decode with --flow push")
    parser.add_argument("--flow", choices=("pull", "push"), default="pull",
                        help="pull: decode's daemon fetches the KV from prefill's (default); "
                             "push: prefill's daemon sends it to decode's")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="limit for each upstream call, a streamed answer included (300)")
    args = parser.parse_args(argv)
    if args.prefill_kvd and len(args.prefill_kvd) != len(args.prefill):
        parser.error(f"{len(args.prefill_kvd)} --prefill-kvd for {len(args.prefill)} "
                     "--prefill: give one per --prefill, in the same order")
    if args.decode_kvd and len(args.decode_kvd) != len(args.decode):
        parser.error(f"{len(args.decode_kvd)} --decode-kvd for {len(args.decode)} --decode: "
                     "give one per --decode, in the same order")
    if args.flow == "push" and not args.decode_kvd:
        parser.error("--flow push needs --decode-kvd HOST:PORT for every --decode")
    if args.timeout_s <= 0:
        parser.error("--timeout-s must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    kvd = args.decode_kvd or [None] * len(args.decode)
    decode = [DecodeTarget(url.rstrip("/"), peer)
              for url, peer in zip(args.decode, kvd, strict=True)]
    prefill = [url.rstrip("/") for url in args.prefill]
    proxy = Proxy(prefill, decode, args.flow, args.timeout_s,
                  dict(zip(prefill, args.prefill_kvd, strict=False)))
    log.info("proxy on http://%s:%d, flow %s, prefill %s, decode %s", args.host, args.port,
             args.flow, proxy.prefill, [(d.url, d.kvd) for d in decode])
    web.run_app(make_app(proxy), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
