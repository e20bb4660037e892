"""``kvd bench``: move data through this daemon to a peer and back, and time it.

Each round puts ``--size`` bytes (``--blocks`` blocks) from a region of this client to the
peer daemon ``--to`` (stored in its pool), then pulls them back into another region, so the
bytes cross both daemons and both directions, and the peer's pool is freed by the pull.
The bytes that come back are compared with the ones that left.

Before the regions are made (seconds for a large ``--size``: torch, shared memory, filling
it), one small block goes to the peer and back: the peer answers, and the link to it is up,
so this daemon knows the peer's host pool and a ``--size`` that cannot fit is refused at
once. The progress bar is drawn only when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from types import TracebackType
from typing import Any, TextIO

from kvd.config import format_size
from kvd.errors import BadRequest

PROBE_BYTES = 4096


class Progress:
    """A one-line progress bar on a terminal: ``steps`` steps (a put or a pull each), redrawn
    at each step and every ``interval_s`` between (so it moves within a long transfer, its
    part of the current step estimated from the steps done), with the time taken and an ETA.
    Nothing is drawn when ``stream`` is not a terminal (a file or a pipe gets no frames). On
    an error the line is erased, so that the error starts a line of its own."""

    def __init__(self, steps: int, stream: TextIO = sys.stderr, interval_s: float = 0.2,
                 width: int = 30) -> None:
        self.steps, self.stream, self.interval_s, self.width = steps, stream, interval_s, width
        self.enabled = stream.isatty()
        self._done = 0
        self._started = self._step_started = time.monotonic()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        # Stopped by __exit__ (the flag and a wake-up, then a bounded join): it sleeps at
        # most interval_s at a time, so the join does not wait on it.
        self._thread = threading.Thread(target=self._run, name="kvd-bench-progress")

    def __enter__(self) -> Progress:
        self._started = self._step_started = time.monotonic()
        if self.enabled:
            self._thread.start()
        return self

    def step(self) -> None:
        with self._lock:
            self._done += 1
            self._step_started = time.monotonic()
        self._wake.set()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(5)
        if exc is None:
            self.stream.write("\r" + self.frame() + "\n")
        else:
            self.stream.write("\r\x1b[2K")  # erase the bar: the error gets a clean line
        self.stream.flush()

    def frame(self, now: float | None = None) -> str:
        """The bar as it stands: ``[####......] 3/10 transfers, 4.2s, ETA 9.8s``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            done, step_started = self._done, self._step_started
        elapsed = now - self._started
        progress = float(done)
        eta = "?"
        if done:
            per_step = (step_started - self._started) / done
            if done < self.steps and per_step > 0:
                progress += min((now - step_started) / per_step, 0.99)
            eta = f"{max(per_step * (self.steps - progress), 0.0):.1f}s"
        filled = int(self.width * progress / max(self.steps, 1))
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.steps} "
                f"transfers, {elapsed:.1f}s, ETA {eta}")

    def _run(self) -> None:
        while not self._stop:
            self.stream.write("\r" + self.frame() + "\x1b[K")
            self.stream.flush()
            self._wake.wait(self.interval_s)
            self._wake.clear()


def _peer_link(client: Any, to: str) -> dict[str, Any] | None:
    links: list[dict[str, Any]] = client.stats().get("peer", {}).get("links", [])
    return next((link for link in links if link.get("address") == to), None)


def _probe_peer(client: Any, to: str, timeout_s: float) -> None:
    """One small block to the peer and back: it answers (else this raises), and the link to
    it is up."""
    import torch

    from kvd.client import shared_zeros

    probe = shared_zeros((1, PROBE_BYTES), torch.uint8)
    region = client.register("kvd-bench-probe", [probe])
    try:
        key = f"kvd-bench-probe-{client.epoch}-{time.monotonic_ns()}"
        client.put(key, region, [0], to=to, timeout_s=timeout_s).wait(timeout_s + 5)
        client.pull(key, to, region, [0], timeout_s=timeout_s)
    finally:
        client.unregister(region)


def check_peer_fits(client: Any, to: str, size: int, timeout_s: float) -> None:
    """Raise BadRequest if ``size`` bytes cannot fit in the peer's host pool (where each put
    waits for its pull), as the link to it reports; links the peer first if need be."""
    link = _peer_link(client, to)
    if link is None:
        _probe_peer(client, to, timeout_s)
        link = _peer_link(client, to)
    capacity = int((link or {}).get("pool_capacity_bytes") or 0)  # 0: not told
    if capacity and size > capacity:
        raise BadRequest(
            f"--size {format_size(size)} does not fit in the host pool of {to} "
            f"({format_size(capacity)}), which holds each put until it is pulled back: "
            f"give --size {format_size(capacity)} or less")


def run_bench(args: argparse.Namespace, client: Any) -> int:
    size, blocks_n = args.size, args.blocks
    if size % blocks_n or size // blocks_n == 0:
        raise BadRequest(f"--size {format_size(size)} does not split into --blocks {blocks_n} "
                         f"equal blocks")
    block = size // blocks_n
    timeout = max(60.0, size / 50e6)
    with client:
        check_peer_fits(client, args.to, size, timeout)
        import torch

        from kvd.client import shared_empty, shared_zeros

        src = shared_empty((blocks_n, block), torch.uint8)
        src.view(-1)[: (size // 8) * 8].view(torch.int64).copy_(torch.arange(size // 8))
        dst = shared_zeros((blocks_n, block), torch.uint8)
        r_src, r_dst = client.register("kvd-bench-src", [src]), client.register(
            "kvd-bench-dst", [dst])
        blocks = list(range(blocks_n))
        put_s, pull_s = [], []
        with Progress(2 * args.repeat) as progress:
            for i in range(args.repeat):
                key = f"kvd-bench-{client.epoch}-{time.monotonic_ns()}-{i}"
                t0 = time.perf_counter()
                client.put(key, r_src, blocks, to=args.to, timeout_s=timeout).wait(timeout + 5)
                t1 = time.perf_counter()
                progress.step()
                client.pull(key, args.to, r_dst, blocks, timeout_s=timeout)
                t2 = time.perf_counter()
                progress.step()
                put_s.append(t1 - t0)
                pull_s.append(t2 - t1)
        intact = torch.equal(src, dst)
        client.unregister(r_src)
        client.unregister(r_dst)
    result = {"to": args.to, "bytes": size, "blocks": blocks_n, "repeat": args.repeat,
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
        print(f"{args.repeat} x {size / 2**20:.1f} MiB in {blocks_n} blocks to {args.to} "
              f"and back; bytes {'intact' if intact else 'DIFFER'}")
        for name in ("put", "pull"):
            print(f"  {name:<5} {result[f'{name}_gbps_median']:7.3f} GB/s median "
                  f"({result[f'{name}_gbps_best']:.3f} best), latency p50 "
                  f"{result[f'{name}_ms_p50']:.2f} ms, p99 {result[f'{name}_ms_p99']:.2f} ms")
    return 0 if intact else 1
