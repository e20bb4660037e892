"""``kvd bench``: move data through this daemon to a peer and back, and time it.

Each round puts ``--size`` bytes (``--blocks`` blocks) from a region of this client to the
peer daemon ``--to`` (stored in its pool), then pulls them back into another region, so the
bytes cross both daemons and both directions, and the peer's pool is freed by the pull.
The bytes that come back are compared with the ones that left.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from kvd.config import parse_size
from kvd.errors import BadRequest


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def run_bench(args: argparse.Namespace, client: Any) -> int:
    import torch

    from kvd.client import shared_empty, shared_zeros

    size = parse_size(args.size)
    if args.blocks < 1 or size % args.blocks or size // args.blocks == 0:
        raise BadRequest(f"--size {args.size} does not split into {args.blocks} equal blocks")
    block = size // args.blocks
    with client:
        src = shared_empty((args.blocks, block), torch.uint8)
        src.view(-1)[: (size // 8) * 8].view(torch.int64).copy_(torch.arange(size // 8))
        dst = shared_zeros((args.blocks, block), torch.uint8)
        r_src, r_dst = client.register("kvd-bench-src", [src]), client.register(
            "kvd-bench-dst", [dst])
        blocks = list(range(args.blocks))
        put_s, pull_s = [], []
        timeout = max(60.0, size / 50e6)
        for i in range(args.repeat):
            key = f"kvd-bench-{client.epoch}-{time.monotonic_ns()}-{i}"
            t0 = time.perf_counter()
            client.put(key, r_src, blocks, to=args.to, timeout_s=timeout).wait(timeout + 5)
            t1 = time.perf_counter()
            client.pull(key, args.to, r_dst, blocks, timeout_s=timeout)
            t2 = time.perf_counter()
            put_s.append(t1 - t0)
            pull_s.append(t2 - t1)
            if not args.json:
                print("\r" + _bar(i + 1, args.repeat), end="", file=sys.stderr, flush=True)
        if not args.json:
            print(file=sys.stderr)
        intact = torch.equal(src, dst)
        client.unregister(r_src)
        client.unregister(r_dst)
    result = {"to": args.to, "bytes": size, "blocks": args.blocks, "repeat": args.repeat,
              "intact": intact}
    for name, times in (("put", put_s), ("pull", pull_s)):
        ordered = sorted(times)
        result[f"{name}_gbps_median"] = round(size / statistics.median(times) / 1e9, 3)
        result[f"{name}_gbps_best"] = round(size / ordered[0] / 1e9, 3)
        result[f"{name}_ms_p50"] = round(statistics.median(times) * 1e3, 3)
        result[f"{name}_ms_p99"] = round(ordered[min(len(ordered) - 1,
                                                     int(0.99 * len(ordered)))] * 1e3, 3)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(f"{args.repeat} x {size / 2**20:.1f} MiB in {args.blocks} blocks to {args.to} "
              f"and back; bytes {'intact' if intact else 'DIFFER'}")
        for name in ("put", "pull"):
            print(f"  {name:<5} {result[f'{name}_gbps_median']:7.3f} GB/s median "
                  f"({result[f'{name}_gbps_best']:.3f} best), latency p50 "
                  f"{result[f'{name}_ms_p50']:.2f} ms, p99 {result[f'{name}_ms_p99']:.2f} ms")
    return 0 if intact else 1
