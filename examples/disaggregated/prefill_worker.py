"""Prefill worker: runs the prompt, writes its KV into blocks, pushes them to the decode
worker's daemon.

``POST /prefill {"key", "prompt_token_ids", "decode_daemon"}`` ->
``{"first_token", "kv_bytes", "put_s"}``; ``put_s`` is from the put to the decode daemon's
confirmation that every byte arrived.

    python prefill_worker.py --port 8101 --socket /run/kvd/kvd.sock --model-dir ./model
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from aiohttp import web
from model import check_lengths, check_tokens, prefill
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

# Unclaimed KV (its decode request failed) is freed by the decode daemon after this long.
PUT_TTL_S = 60.0
PUT_TIMEOUT_S = 30.0

routes = web.RouteTableDef()


def prefill_into_blocks(w: Worker, prompt_ids: Sequence[int], blocks: list[int]) -> int:
    """On the compute thread: prefill, copy the cache into ``blocks``, return the first
    token."""
    first, cache = prefill(w.model, prompt_ids)
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    w.kv.write(blocks, kv, first)
    return first


@routes.post("/prefill")
async def handle_prefill(request: web.Request) -> web.Response:
    w = request.app[WORKER]
    try:
        body = await read_body(request, {"key": str, "prompt_token_ids": list,
                                         "decode_daemon": str})
    except BadInput as exc:
        return error(400, str(exc))
    key, prompt_ids = body["key"], body["prompt_token_ids"]
    problem = check_lengths(w.model, len(prompt_ids), 1) or check_tokens(w.model, prompt_ids)
    if problem:
        return error(400, problem)
    try:
        with w.blocks.hold(blocks_needed(len(prompt_ids))) as blocks:
            first = await w.compute(prefill_into_blocks, w, prompt_ids, blocks)
            started = time.perf_counter()
            transfer = await w.client.put(key, w.region, blocks, to=body["decode_daemon"],
                                          ttl_s=PUT_TTL_S, timeout_s=PUT_TIMEOUT_S)
            try:
                nbytes = await transfer.wait()
            except BaseException:
                # The blocks go back to the free list only once nothing reads them.
                if not transfer.done():
                    with contextlib.suppress(kvd.KvdError):
                        await transfer.cancel(timeout_s=10)
                raise
            put_s = time.perf_counter() - started
    except OutOfBlocks as exc:
        return error(503, str(exc))
    except kvd.KvdError as exc:
        return kvd_error(exc)
    return web.json_response({"first_token": first, "kv_bytes": nbytes, "put_s": put_s})


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    serve(make_app("prefill", args, routes), args.host, args.port)


if __name__ == "__main__":
    main()
