"""Control-plane latency of kvd against a raw pyzmq round trip of the same message sizes.

Run: ``python benchmarks/control_plane.py [--quick] [--json] [--iterations N] [--warmup N]``

What it measures, all sequential (one request in flight), alternated in rounds in one run
(the machine is shared and noisy: each figure gets the same mix of quiet and busy moments):

* **raw pyzmq** (the baseline): a DEALER client and a ROUTER echo server in a separate
  process (as the daemon is), over ``ipc://``, the transport kvd's local socket uses. The
  sync client blocks in ``recv``; the async one reads its socket's ``zmq.FD`` with
  ``add_reader`` under uvloop, as kvd's async client does. Payloads have the encoded
  sizes of kvd's messages: "ping" sends the size of a ``Ping`` request and gets a
  ``Pong``-sized reply back; "op" cycles through the sizes of ``Offload``, ``Get`` and
  ``Delete`` requests and their ``Done`` replies.
* **plain Unix socket**, for reference: the same sizes over a Unix stream socket with a
  4-byte length before each message, blocking client, echo server in a separate process.
  ZeroMQ's I/O thread at each end is what costs the difference.
* **kvd**: a ``kvd serve`` subprocess with ``kvd.KvdClient`` and ``kvd.AsyncKvdClient``
  (uvloop): ``ping()``, and a 64 KiB ``offload`` + ``get`` + ``delete`` of one block
  between two registered shared-memory regions, with a fresh key per iteration (the
  bytes are checked once before timing).

How to read the ratios: ``ping_p50_vs_raw_zmq`` is kvd's sync ping p50 over raw pyzmq's
sync p50: what the daemon and the client library add on top of the transport (decode,
dispatch, encode, futures, thread-safety) for one round trip; 1.0 would be free. The
goal is <= 1.5; it is reported, never enforced. ``offload+get+delete`` is three round
trips plus two 64 KiB copies, so its ratio is against 3x the raw "op" p50.
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
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop
import zmq
from daemons import stop_daemon  # benchmarks/daemons.py (run as a script)

from kvd.protocol import Delete, Done, Get, Offload, Ping, Pong, encode

BLOCK_BYTES = 64 * 1024
GOAL_RATIO = 1.5
GOAL = f"kvd ping p50 <= {GOAL_RATIO:g}x raw pyzmq DEALER/ROUTER round trip"
ROUNDS = 5  # each figure is measured in this many slices, alternated with the others
HEADER = struct.Struct(">I")  # the plain socket's length prefix
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


class Timings:
    """Latencies of each measurement, gathered over the rounds."""

    def __init__(self) -> None:
        self.lat: dict[str, list[int]] = {}
        self.total_ns: dict[str, int] = {}

    def add(self, name: str, lat: list[int], total_ns: int) -> None:
        self.lat.setdefault(name, []).extend(lat)
        self.total_ns[name] = self.total_ns.get(name, 0) + total_ns

    def stats(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, lat in self.lat.items():
            s = sorted(lat)

            def pct_us(q: float, s: list[int] = s) -> float:  # nearest-rank percentile
                return s[min(len(s) - 1, round(q * (len(s) - 1)))] / 1e3

            out[name] = {"p50_us": pct_us(0.50), "p99_us": pct_us(0.99),
                         "ops_s": len(s) * 1e9 / self.total_ns[name]}
        return out


def time_sync(t: Timings, name: str, fn: Callable[[int], Any], iterations: int,
              warmup: int, first: int) -> None:
    for i in range(warmup):
        fn(first + i)
    lat = [0] * iterations
    gc.collect()
    start = now_ns()
    for i in range(iterations):
        t0 = now_ns()
        fn(first + warmup + i)
        lat[i] = now_ns() - t0
    t.add(name, lat, now_ns() - start)


async def time_async(t: Timings, name: str, fn: Callable[[int], Awaitable[Any]],
                     iterations: int, warmup: int, first: int) -> None:
    # One deadline for the whole loop: a per-call timeout would tax the raw baseline.
    async with asyncio.timeout(60 + (warmup + iterations) * 0.01):
        for i in range(warmup):
            await fn(first + i)
        lat = [0] * iterations
        gc.collect()
        start = now_ns()
        for i in range(iterations):
            t0 = now_ns()
            await fn(first + warmup + i)
            lat[i] = now_ns() - t0
        t.add(name, lat, now_ns() - start)


def payloads(sizes: dict[str, int], what: str) -> list[bytes]:
    pairs = {"ping": [("ping", "pong")],
             "op": [("offload", "done_bytes"), ("get", "done_bytes"), ("delete", "done_empty")]}
    return [sizes[rep].to_bytes(4, "little") + bytes(sizes[req] - 4) for req, rep in pairs[what]]


# ---------------------------------------------------------------- echo servers


def zmq_echo_server(endpoint: str, ready: Any) -> None:
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
    """Unix-socket echo with the same rule as ``zmq_echo_server``, one client at a time."""
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
                    reply = replies.get(n) or replies.setdefault(
                        n, HEADER.pack(n) + bytes(n))
                    conn.sendall(reply)
            except ConnectionError:
                pass
    srv.close()


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


# ---------------------------------------------------------------- the clients


def zmq_sync_rtt(sock: zmq.Socket[Any], msgs: list[bytes]) -> Callable[[int], None]:
    def rtt(i: int) -> None:
        sock.send(msgs[i % len(msgs)])
        sock.recv()
    return rtt


class ZmqAsync:
    """A raw DEALER read on the loop through ``zmq.FD`` and ``add_reader`` (drained until
    ``zmq.EVENTS`` shows no message, checked again after each send)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.loop = asyncio.get_running_loop()
        self.waiter: asyncio.Future[bytes] | None = None
        self.loop.add_reader(self.sock.getsockopt(zmq.FD), self._read)

    def _read(self) -> None:
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            data = self.sock.recv(zmq.NOBLOCK)
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(data)

    async def rtt(self, msg: bytes) -> bytes:
        self.waiter = self.loop.create_future()
        self.sock.send(msg, zmq.NOBLOCK)
        self._read()  # (the send may have taken the edge of a reply)
        return await self.waiter

    def close(self) -> None:
        self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
        self.sock.close()


def plain_sync_rtt(conn: socket.socket, msgs: list[bytes]) -> Callable[[int], None]:
    def rtt(i: int) -> None:
        conn.sendall(msgs[i % len(msgs)])
        _read_frame(conn)
    return rtt


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


def run_sync(t: Timings, path: str, endpoint: str, plain_path: str, sizes: dict[str, int],
             args: argparse.Namespace) -> None:
    from kvd import KvdClient

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDTIMEO, 5000), (zmq.RCVTIMEO, 5000)):
        dealer.setsockopt(opt, value)
    dealer.connect(endpoint)
    plain = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    plain.settimeout(5.0)
    plain.connect(plain_path)
    try:
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

            framed = {what: [HEADER.pack(len(m)) + m for m in payloads(sizes, what)]
                      for what in ("ping", "op")}
            fns: dict[str, tuple[Callable[[int], Any], int]] = {
                "zmq_sync_ping": (zmq_sync_rtt(dealer, payloads(sizes, "ping")),
                                  args.iterations),
                "kvd_sync_ping": (lambda i: c.ping(), args.iterations),
                "plain_sync_ping": (plain_sync_rtt(plain, framed["ping"]), args.iterations),
                "zmq_sync_op": (zmq_sync_rtt(dealer, payloads(sizes, "op")),
                                args.op_iterations),
                "kvd_sync_op": (op, args.op_iterations),
                "plain_sync_op": (plain_sync_rtt(plain, framed["op"]), args.op_iterations),
            }
            for r in range(ROUNDS):
                for name, (fn, count) in fns.items():
                    time_sync(t, name, fn, max(1, count // ROUNDS),
                              args.warmup if r == 0 else args.warmup // 10, r * 10**6)
    finally:
        dealer.close()
        plain.close()
        ctx.term()


async def run_async(t: Timings, path: str, endpoint: str, sizes: dict[str, int],
                    args: argparse.Namespace) -> None:
    from kvd import AsyncKvdClient

    ctx = zmq.Context()
    raw = ZmqAsync(ctx, endpoint)
    try:
        async with AsyncKvdClient(path, name="bench-async", timeout_s=10.0) as c:
            src, dst = tensors()
            r_src = await c.register("bench-src", [src])
            r_dst = await c.register("bench-dst", [dst])
            await c.offload(key_of("async", -1), r_src, [0])
            check_bytes(src, dst, await c.get(key_of("async", -1), r_dst, [0], timeout_s=5),
                        "async")
            await c.delete(key_of("async", -1))

            async def op(i: int) -> None:
                await c.offload(key_of("async", i), r_src, [0])
                await c.get(key_of("async", i), r_dst, [0], timeout_s=5)
                await c.delete(key_of("async", i))

            ping_msgs, op_msgs = payloads(sizes, "ping"), payloads(sizes, "op")
            fns: dict[str, tuple[Callable[[int], Awaitable[Any]], int]] = {
                "zmq_async_ping": (lambda i: raw.rtt(ping_msgs[0]), args.iterations),
                "kvd_async_ping": (lambda i: c.ping(), args.iterations),
                "zmq_async_op": (lambda i: raw.rtt(op_msgs[i % 3]), args.op_iterations),
                "kvd_async_op": (op, args.op_iterations),
            }
            for r in range(ROUNDS):
                for name, (fn, count) in fns.items():
                    await time_async(t, name, fn, max(1, count // ROUNDS),
                                     args.warmup if r == 0 else args.warmup // 10, r * 10**6)
    finally:
        raw.close()
        ctx.term()


# ---------------------------------------------------------------- report


def report(res: dict[str, dict], sizes: dict[str, int], args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {}
    for name, st in res.items():
        out.update({f"{name}_{k}": round(v, 2) for k, v in st.items()})
    for mode in ("sync", "async"):
        base_ping = res[f"zmq_{mode}_ping"]["p50_us"]
        base_op = res[f"zmq_{mode}_op"]["p50_us"]
        out[f"ratio_{mode}_ping_p50"] = round(res[f"kvd_{mode}_ping"]["p50_us"] / base_ping, 2)
        out[f"ratio_{mode}_op_p50"] = round(res[f"kvd_{mode}_op"]["p50_us"] / (3 * base_op), 2)
    out["ping_p50_vs_raw_zmq"] = out["ratio_sync_ping_p50"]
    out["goal_met"] = out["ping_p50_vs_raw_zmq"] <= GOAL_RATIO
    out["ratio_zmq_vs_plain_ping_p50"] = round(
        res["zmq_sync_ping"]["p50_us"] / res["plain_sync_ping"]["p50_us"], 2)
    out.update(goal=GOAL, rounds=ROUNDS, iterations={
        "ping": args.iterations, "op": args.op_iterations, "warmup": args.warmup},
        message_sizes=sizes)

    print(f"kvd control plane, sequential (1 in flight), alternated in {ROUNDS} rounds; "
          f"{args.iterations} ping / {args.op_iterations} offload+get+delete iterations")
    print("message bytes: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    print(f"\n{'measurement':<46}{'p50 µs':>10}{'p99 µs':>10}{'ops/s':>10}  ratio (p50)")
    labels = {"ping": ("RTT, ping/pong sizes", "kvd ping()"),
              "op": ("RTT, offload/get/delete sizes", "kvd offload+get+delete 64KiB")}
    for mode in ("sync", "async"):
        for what in ("ping", "op"):
            for src, label in (("zmq", "raw pyzmq " + labels[what][0]),
                               ("plain", "plain socket " + labels[what][0]),
                               ("kvd", labels[what][1])):
                name = f"{src}_{mode}_{what}"
                if name not in res:
                    continue
                st = res[name]
                ratio = ""
                if src == "kvd":
                    basis = "raw pyzmq" if what == "ping" else "3x raw pyzmq"
                    ratio = f"{out[f'ratio_{mode}_{what}_p50']:.2f}x vs {basis}"
                print(f"{mode + ' ' + label:<46}{st['p50_us']:>10.1f}{st['p99_us']:>10.1f}"
                      f"{st['ops_s']:>10.0f}  {ratio}")
        print()
    met = "MET" if out["goal_met"] else "NOT MET"
    print(f"goal: {GOAL}: {out['ping_p50_vs_raw_zmq']:.2f}x -> {met}")
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
    daemon = zmq_echo = plain_echo = None
    try:
        daemon, path, node_id, epoch = start_daemon(tmp)
        sizes = message_sizes(node_id, epoch)
        endpoint, plain_path = f"ipc://{tmp}/echo.sock", f"{tmp}/plain.sock"
        zmq_echo = start_echo(zmq_echo_server, endpoint)
        plain_echo = start_echo(plain_echo_server, plain_path)
        t = Timings()
        run_sync(t, path, endpoint, plain_path, sizes, args)
        uvloop.run(run_async(t, path, endpoint, sizes, args))
    finally:
        stop_echo(zmq_echo)
        stop_echo(plain_echo)
        stop_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)

    out = report(t.stats(), sizes, args)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
