"""Control-plane latency of kvd against a raw round trip of the same message sizes.

Run: ``python benchmarks/control_plane.py [--quick] [--json] [--iterations N] [--warmup N]``

What it measures, all sequential (one request in flight), over Unix sockets:

* **raw**: the transport kvd's local socket uses, bare: a Unix stream socket with a 4-byte
  length before each message (``kvd.framing``), echo server in a separate process (as
  the daemon is), once with a blocking client and once with asyncio streams under uvloop.
  Payloads have the encoded sizes of kvd's messages: "ping" sends the size of a ``Ping``
  request and gets a ``Pong``-sized reply back; "op" cycles through the sizes of
  ``Offload``, ``Get`` and ``Delete`` requests and their ``Done`` replies.
* **zmq**: the same sizes through pyzmq (DEALER client, ROUTER echo server, blocking and
  ``zmq.asyncio``), kvd's transport until 2026-11-30: for reference, no ratio, and only
  when pyzmq is installed. ZeroMQ's I/O thread at each end makes each message three
  thread wake-ups instead of one; that is why kvd left it (docs/architecture.md).
* **kvd**: a ``kvd serve`` subprocess with ``kvd.KvdClient`` and ``kvd.AsyncKvdClient``
  (uvloop): ``ping()``, and a 64 KiB ``offload`` + ``get`` + ``delete`` of one block
  between two registered shared-memory regions, with a fresh key per iteration (the
  bytes are checked once before timing).

How to read the ratios: ``kvd ping p50 / raw ping p50`` is what the daemon and the client
library add on top of the transport (decode, dispatch, encode, futures) for one round
trip; 1.0 would be free. ``offload+get+delete`` is three round trips plus two 64 KiB
copies, so its ratio is against 3x the raw "op" p50. The target is "daemon ping p50 <= 2x
raw round trip"; it is reported, never enforced. Numbers on a small machine are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop
from daemons import stop_daemon  # benchmarks/daemons.py (run as a script)

from kvd.framing import HEADER, frame

try:  # for reference only: kvd does not use it
    import zmq
    import zmq.asyncio
except ImportError:
    zmq = None  # type: ignore[assignment]
from kvd.protocol import Delete, Done, Get, Offload, Ping, Pong, encode

BLOCK_BYTES = 64 * 1024
TARGET_RATIO = 2.0
TARGET = f"daemon ping p50 <= {TARGET_RATIO:g}x raw round trip"
now_ns = time.perf_counter_ns


def key_of(tag: str, i: int) -> str:
    return f"bench-{tag}-{i:07d}"


def message_sizes(node_id: str, epoch: int) -> dict[str, int]:
    """Encoded sizes of the messages the kvd loops exchange (typical 3-byte req_id)."""
    rid, key = 1000, key_of("sync", 0)
    return {
        "ping": len(encode(Ping(req_id=rid))),
        "pong": len(encode(Pong(req_id=rid, node_id=node_id, epoch=epoch, draining=False))),
        "offload": len(encode(Offload(req_id=rid, key=key, region_id=1, blocks=bytes(4)))),
        "get": len(encode(Get(req_id=rid, key=key, region_id=1, blocks=bytes(4), timeout_s=5.0))),
        "delete": len(encode(Delete(req_id=rid, key=key))),
        "done_bytes": len(encode(Done(req_id=rid, nbytes=BLOCK_BYTES))),
        "done_empty": len(encode(Done(req_id=rid, nbytes=0))),
    }


def stats(lat_ns: list[int], total_ns: int) -> dict[str, float]:
    s = sorted(lat_ns)

    def pct_us(q: float) -> float:  # nearest-rank percentile
        return s[min(len(s) - 1, round(q * (len(s) - 1)))] / 1e3

    return {"p50_us": pct_us(0.50), "p99_us": pct_us(0.99), "ops_s": len(s) * 1e9 / total_ns}


def time_sync(fn: Callable[[int], Any], iterations: int, warmup: int) -> dict[str, float]:
    for i in range(warmup):
        fn(i)
    lat = [0] * iterations
    gc.collect()
    start = now_ns()
    for i in range(iterations):
        t0 = now_ns()
        fn(warmup + i)
        lat[i] = now_ns() - t0
    return stats(lat, now_ns() - start)


async def time_async(fn: Callable[[int], Awaitable[Any]], iterations: int,
                     warmup: int) -> dict[str, float]:
    # One deadline for the whole loop: a per-call timeout would tax the raw baseline.
    async with asyncio.timeout(60 + (warmup + iterations) * 0.01):
        for i in range(warmup):
            await fn(i)
        lat = [0] * iterations
        gc.collect()
        start = now_ns()
        for i in range(iterations):
            t0 = now_ns()
            await fn(warmup + i)
            lat[i] = now_ns() - t0
        return stats(lat, now_ns() - start)


# ---------------------------------------------------------------- pyzmq, for reference


def echo_server(endpoint: str, ready: Any) -> None:
    """ROUTER echo: the first 4 bytes of a request give the size of the reply."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 1000)  # only to notice an orphaned server
    sock.bind(endpoint)
    ready.set()
    parent, replies = os.getppid(), dict[int, bytes]()
    while True:
        try:
            ident, payload = sock.recv_multipart()
        except zmq.Again:
            if os.getppid() != parent:
                break
            continue
        n = int.from_bytes(payload[:4], "little")
        sock.send_multipart([ident, replies.get(n) or replies.setdefault(n, bytes(n))])
    sock.close()
    ctx.term()


def payloads(sizes: dict[str, int], what: str) -> list[bytes]:
    pairs = {"ping": [("ping", "pong")],
             "op": [("offload", "done_bytes"), ("get", "done_bytes"), ("delete", "done_empty")]}
    return [sizes[rep].to_bytes(4, "little") + bytes(sizes[req] - 4) for req, rep in pairs[what]]


def zmq_sync(endpoint: str, sizes: dict[str, int], what: str, n: int, warmup: int) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDTIMEO, 5000), (zmq.RCVTIMEO, 5000)):
        sock.setsockopt(opt, value)
    sock.connect(endpoint)
    msgs = payloads(sizes, what)
    try:
        def rtt(i: int) -> None:
            sock.send(msgs[i % len(msgs)])
            sock.recv()
        return time_sync(rtt, n, warmup)
    finally:
        sock.close()
        ctx.term()


async def zmq_async(endpoint: str, sizes: dict[str, int], what: str, n: int,
                    warmup: int) -> dict:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    msgs = payloads(sizes, what)
    try:
        async def rtt(i: int) -> None:
            await sock.send(msgs[i % len(msgs)])
            await sock.recv()
        return await time_async(rtt, n, warmup)
    finally:
        sock.close()
        ctx.term()


# ---------------------------------------------------------------- raw baseline


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed")
        buf += part
    return bytes(buf)


def _read_frame(conn: socket.socket) -> bytes:
    (n,) = HEADER.unpack(_read_exactly(conn, HEADER.size))
    return _read_exactly(conn, n)


def plain_echo_server(path: str, ready: Any) -> None:
    """Unix-socket echo with the same rule as ``echo_server``, one client at a time."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    srv.settimeout(1.0)  # only to notice an orphaned server
    ready.set()
    parent, replies = os.getppid(), dict[int, bytes]()
    while os.getppid() == parent:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        with conn:
            try:
                while True:
                    payload = _read_frame(conn)
                    n = int.from_bytes(payload[:4], "little")
                    reply = replies.get(n) or replies.setdefault(n, frame(bytes(n)))
                    conn.sendall(reply)
            except ConnectionError:
                pass
    srv.close()


def raw_sync(path: str, sizes: dict[str, int], what: str, n: int, warmup: int) -> dict:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5.0)
    conn.connect(path)
    msgs = [frame(m) for m in payloads(sizes, what)]
    try:
        def rtt(i: int) -> None:
            conn.sendall(msgs[i % len(msgs)])
            _read_frame(conn)
        return time_sync(rtt, n, warmup)
    finally:
        conn.close()


async def raw_async(path: str, sizes: dict[str, int], what: str, n: int,
                    warmup: int) -> dict:
    reader, writer = await asyncio.open_unix_connection(path)
    msgs = [frame(m) for m in payloads(sizes, what)]
    try:
        async def rtt(i: int) -> None:
            writer.write(msgs[i % len(msgs)])
            (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            await reader.readexactly(size)
        return await time_async(rtt, n, warmup)
    finally:
        writer.close()


# ---------------------------------------------------------------- kvd


def start_daemon(tmp: str) -> tuple[subprocess.Popen[bytes], str, str, int]:
    from kvd import KvdClient, KvdError

    path, log_path = os.path.join(tmp, "kvd.sock"), os.path.join(tmp, "daemon.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--socket-path", path,
           "--pool-size-bytes", "256MiB", "--log-level", "warning", "--peer-port", "0",
           "--data-port", "0", "--http-port", "0"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path):
            try:
                with KvdClient(path, name="bench-probe", timeout_s=1.0) as c:
                    c.ping()
                    return proc, path, c.node_id, c.epoch
            except KvdError:
                pass
        time.sleep(0.05)
    with open(log_path, errors="replace") as f:
        raise RuntimeError(f"kvd daemon not ready (exit code {proc.poll()}):\n{f.read()}")


def tensors() -> tuple[Any, Any]:
    """Source (random bytes) and destination (zeros) of one 64 KiB block each."""
    import torch

    from kvd import shared_zeros

    src, dst = (shared_zeros((1, BLOCK_BYTES), torch.uint8) for _ in range(2))
    src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))
    return src, dst


def check_bytes(src: Any, dst: Any, moved: int, label: str) -> None:
    if moved != BLOCK_BYTES or not bool((src == dst).all()):
        raise RuntimeError(f"{label}: get delivered {moved} bytes that do not match the source")


def kvd_sync(path: str, n_ping: int, n_op: int, warmup: int) -> dict[str, dict]:
    from kvd import KvdClient

    with KvdClient(path, name="bench-sync", timeout_s=10.0) as c:
        src, dst = tensors()
        r_src, r_dst = c.register("bench-src", [src]), c.register("bench-dst", [dst])
        c.offload(key_of("sync", -1), r_src, [0])
        check_bytes(src, dst, c.get(key_of("sync", -1), r_dst, [0], timeout_s=5), "sync")
        c.delete(key_of("sync", -1))

        def op(i: int) -> None:
            c.offload(key_of("sync", i), r_src, [0])
            c.get(key_of("sync", i), r_dst, [0], timeout_s=5)
            c.delete(key_of("sync", i))
        return {"ping": time_sync(lambda i: c.ping(), n_ping, warmup),
                "op": time_sync(op, n_op, warmup)}


async def kvd_async(path: str, n_ping: int, n_op: int, warmup: int) -> dict[str, dict]:
    from kvd import AsyncKvdClient

    async with AsyncKvdClient(path, name="bench-async", timeout_s=10.0) as c:
        src, dst = tensors()
        r_src, r_dst = await c.register("bench-src", [src]), await c.register("bench-dst", [dst])
        await c.offload(key_of("async", -1), r_src, [0])
        check_bytes(src, dst, await c.get(key_of("async", -1), r_dst, [0], timeout_s=5), "async")
        await c.delete(key_of("async", -1))

        async def op(i: int) -> None:
            await c.offload(key_of("async", i), r_src, [0])
            await c.get(key_of("async", i), r_dst, [0], timeout_s=5)
            await c.delete(key_of("async", i))
        return {"ping": await time_async(lambda i: c.ping(), n_ping, warmup),
                "op": await time_async(op, n_op, warmup)}


def start_echo(server: Callable[[str, Any], None], address: str) -> Any:
    """``server(address, ready)`` in a separate process, once it listens."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=server, args=(address, ready), daemon=True)
    proc.start()
    deadline = time.monotonic() + 30
    while not ready.wait(0.1):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{server.__name__} did not start (exit code {proc.exitcode})")
    return proc


def stop_echo(proc: Any) -> None:
    if proc is None:
        return
    proc.terminate()
    proc.join(10)
    if proc.exitcode is None:
        proc.kill()
        proc.join(5)


# ---------------------------------------------------------------- report


def report(res: dict[str, dict], sizes: dict[str, int], args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {}
    for name, st in res.items():
        out.update({f"{name}_{k}": round(v, 2) for k, v in st.items()})
    for mode in ("sync", "async"):
        raw_ping, raw_op = res[f"raw_{mode}_ping"]["p50_us"], res[f"raw_{mode}_op"]["p50_us"]
        out[f"ratio_{mode}_ping_p50"] = round(res[f"kvd_{mode}_ping"]["p50_us"] / raw_ping, 2)
        out[f"ratio_{mode}_op_p50"] = round(res[f"kvd_{mode}_op"]["p50_us"] / (3 * raw_op), 2)
        if f"zmq_{mode}_ping" in res:
            out[f"ratio_zmq_{mode}_ping_vs_raw_p50"] = round(
                res[f"zmq_{mode}_ping"]["p50_us"] / raw_ping, 2)
        out[f"target_met_{mode}"] = out[f"ratio_{mode}_ping_p50"] <= TARGET_RATIO
    out.update(target=TARGET, iterations={"ping": args.iterations, "op": args.op_iterations,
                                          "warmup": args.warmup}, message_sizes=sizes)

    print(f"kvd control plane, sequential (1 in flight); {args.iterations} ping / "
          f"{args.op_iterations} offload+get+delete iterations, {args.warmup} warm-up")
    print("message bytes: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    print(f"\n{'measurement':<44}{'p50 µs':>10}{'p99 µs':>10}{'ops/s':>10}  ratio (p50)")
    labels = {"ping": ("RTT, ping/pong sizes", "kvd ping()"),
              "op": ("RTT, offload/get/delete sizes", "kvd offload+get+delete 64KiB")}
    for mode in ("sync", "async"):
        for what in ("ping", "op"):
            for src, label in (("raw", "raw " + labels[what][0]),
                               ("zmq", "pyzmq " + labels[what][0]), ("kvd", labels[what][1])):
                if f"{src}_{mode}_{what}" not in res:
                    continue
                st = res[f"{src}_{mode}_{what}"]
                ratio = ""
                if src == "kvd":
                    basis = "raw RTT" if what == "ping" else "3x raw RTT"
                    ratio = f"{out[f'ratio_{mode}_{what}_p50']:.2f}x vs {basis}"
                elif src == "zmq" and what == "ping":
                    ratio = f"{out[f'ratio_zmq_{mode}_ping_vs_raw_p50']:.2f}x vs raw RTT"
                print(f"{mode + ' ' + label:<44}{st['p50_us']:>10.1f}{st['p99_us']:>10.1f}"
                      f"{st['ops_s']:>10.0f}  {ratio}")
        print()
    for mode in ("sync", "async"):
        met = "MET" if out[f"target_met_{mode}"] else "NOT MET"
        print(f"target ({mode}): {TARGET}: {out[f'ratio_{mode}_ping_p50']:.2f}x -> {met}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="also print one JSON line at the end")
    ap.add_argument("--quick", action="store_true", help="about 1/10 of the default work")
    ap.add_argument("--iterations", type=int, help="ping iterations (default 5000)")
    ap.add_argument("--op-iterations", type=int, help="offload+get iterations (default 1000)")
    ap.add_argument("--warmup", type=int, help="warm-up iterations per loop (default 500)")
    args = ap.parse_args()
    scale = 10 if args.quick else 1
    args.iterations = args.iterations or 5000 // scale
    args.op_iterations = args.op_iterations or max(1, 1000 * args.iterations // 5000)
    args.warmup = 500 // scale if args.warmup is None else args.warmup

    tmp = tempfile.mkdtemp(prefix="kvd-b-", dir="/tmp")  # short: ipc paths max ~100 bytes
    daemon = echo = None
    n, n_op, w = args.iterations, args.op_iterations, args.warmup
    try:
        daemon, path, node_id, epoch = start_daemon(tmp)
        sizes = message_sizes(node_id, epoch)

        res = {}
        plain_path = f"{tmp}/plain.sock"
        echo = start_echo(plain_echo_server, plain_path)
        for what, count in (("ping", n), ("op", n_op)):
            res[f"raw_sync_{what}"] = raw_sync(plain_path, sizes, what, count, w)
            res[f"raw_async_{what}"] = uvloop.run(raw_async(plain_path, sizes, what, count, w))
        stop_echo(echo)
        echo = None

        if zmq is not None:
            endpoint = f"ipc://{tmp}/echo.sock"
            echo = start_echo(echo_server, endpoint)
            for what, count in (("ping", n), ("op", n_op)):
                res[f"zmq_sync_{what}"] = zmq_sync(endpoint, sizes, what, count, w)
                res[f"zmq_async_{what}"] = uvloop.run(
                    zmq_async(endpoint, sizes, what, count, w))
            stop_echo(echo)
            echo = None

        for what, st in kvd_sync(path, n, n_op, w).items():
            res[f"kvd_sync_{what}"] = st
        for what, st in uvloop.run(kvd_async(path, n, n_op, w)).items():
            res[f"kvd_async_{what}"] = st
    finally:
        stop_echo(echo)
        stop_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)

    out = report(res, sizes, args)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
