"""Decode worker: waits for a request's KV from kvd, then generates greedily.

``POST /decode {"key", "prompt_len", "max_tokens", "timeout_s"}`` ->
``{"tokens", "get_s", "kv_bytes"}``. The get is posted as soon as the request arrives: if
it is waiting first, the KV lands straight in its blocks; if the KV came first, it waited
in the daemon's pool. No KV within ``timeout_s``: HTTP 504 ``{"error": <reason>}``; any
other kvd error: 502.

    python decode_worker.py --port 8201 --socket /run/kvd/kvd.sock --model-dir ./model
"""

from __future__ import annotations

import time

from aiohttp import web
from model import cache_from_kv, check_lengths, decode
from paged_kv import OutOfBlocks, blocks_needed
from worker import (
    WORKER,
    BadInput,
    Worker,
    error,
    kvd_error,
    make_app,
    parse_args,
    read_body,
    serve,
)

import kvd

routes = web.RouteTableDef()


class BadKv(Exception):
    pass


def decode_from_blocks(w: Worker, blocks: list[int], prompt_len: int,
                       max_tokens: int) -> list[int]:
    """On the compute thread: rebuild the cache from ``blocks`` and generate."""
    first, stored_len = w.kv.read_meta(blocks)
    if stored_len != prompt_len:
        raise BadKv(f"the KV holds {stored_len} tokens, the request says {prompt_len}")
    cache = cache_from_kv(w.model, w.kv.read(blocks, prompt_len, w.model.device))
    return decode(w.model, cache, first, prompt_len, max_tokens)


@routes.post("/decode")
async def handle_decode(request: web.Request) -> web.Response:
    w = request.app[WORKER]
    try:
        body = await read_body(request, {"key": str, "prompt_len": int, "max_tokens": int,
                                         "timeout_s": float})
    except BadInput as exc:
        return error(400, str(exc))
    prompt_len, max_tokens = body["prompt_len"], body["max_tokens"]
    problem = check_lengths(w.model, prompt_len, max_tokens)
    if problem or body["timeout_s"] <= 0:
        return error(400, problem or "timeout_s must be positive")
    try:
        with w.blocks.hold(blocks_needed(prompt_len)) as blocks:
            started = time.perf_counter()
            nbytes = await w.client.get(body["key"], w.region, blocks,
                                        timeout_s=body["timeout_s"])
            get_s = time.perf_counter() - started
            tokens = await w.compute(decode_from_blocks, w, blocks, prompt_len, max_tokens)
    except OutOfBlocks as exc:
        return error(503, str(exc))
    except BadKv as exc:
        return error(502, str(exc))
    except kvd.KvdError as exc:
        return kvd_error(exc)
    return web.json_response({"tokens": tokens, "get_s": get_s, "kv_bytes": nbytes})


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    serve(make_app("decode", args, routes), args.host, args.port)


if __name__ == "__main__":
    main()
