"""Daemon-to-daemon TCP throughput of kvd against raw loopback TCP with the same chunking.

Run: ``python benchmarks/tcp_transfer.py [--quick] [--json] [--sizes 64MiB,1GiB] [--repeat N]
[--encrypt]``

With ``--encrypt`` both sides encrypt the bytes with TLS 1.3. The daemons run with CurveZMQ
on the peer plane (a key pair each, made for the run with ``kvd keygen``'s code, and one
allow-list naming both, so their peer ports are picked before they start) and
``encrypt_data`` on: their data connections are TLS with a throwaway certificate each,
pinned by fingerprint over the CURVE link. The raw baseline wraps its two sockets the same
way: the receiver presents a self-signed certificate made for the run (``cryptography``),
the sender pins its SHA-256 fingerprint. The run checks that kvd's link reports its data
connection encrypted (or, without ``--encrypt``, plain).

What it measures, one transfer in flight at a time, on this machine's loopback:

* **raw**: two processes, plain blocking sockets with TCP_NODELAY, one connection kept
  for the whole run (as kvd keeps its data connection). The sender ``sendmsg``-s
  memoryviews of a preallocated buffer in chunks of 4 MiB (kvd's default
  ``tcp_chunk_bytes``) after an 8-byte length header; the receiver ``recvmsg_into``-s a
  preallocated buffer in chunks of 4 MiB and answers with a 1-byte ack after the last
  byte (with ``--encrypt``: ``sendall`` and ``recv_into`` on the TLS sockets, in the
  same chunks). Neither side copies in Python. The time is taken on the sender from just
  before the header goes out to the ack coming back: one transfer plus one small round
  trip.
* **kvd**: two ``kvd serve`` subprocesses (a, b) with a client on each. The sender
  registers a ``kvd.shared_empty`` region of 16 MiB blocks, the receiver one of the same
  shape. Two flows, a fresh key each time:

  (a) *put -> get, get posted first*: a thread on b posts ``get`` and the bench waits
      until b reports ``waiting_gets == 1``; the time runs from ``put(..., to=b)`` to
      the later of ``put(...).wait()`` and the return of that ``get``. The bytes land
      straight in the receiver's blocks. This is the disaggregated-prefill path.
  (b) *put, then get*: ``put(...).wait()`` into b's pool (nobody waiting), then ``get``
      on b (a pool -> blocks copy), timed end to end.

  Each time includes what kvd adds to moving the bytes: the client -> daemon request,
  the offer/accept between the daemons, and the replies.

Before timing, one untimed transfer per size and flow warms the path up, and its bytes
are checked (raw: CRC32 on both sides; kvd: the destination compared to the source); a
mismatch stops the run with an error. Throughput is GB/s (1e9 bytes per second) of the
payload; "best" is the fastest of ``--repeat`` runs, "median" the median.

How to read the ratios: ``kvd / raw`` is the share of what bare sockets achieve here with
the same chunking that kvd delivers, control plane included; 1.0 would be free. The target
is "kvd flow (a) >= 80% of raw", judged on the medians; it is reported, never enforced.
On loopback both sides share the CPUs (and the memory bandwidth), so a machine with few
cores understates what separate hosts would see and the numbers are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from daemons import stop_daemon  # benchmarks/daemons.py (run as a script)

MiB, GiB = 2**20, 2**30
CHUNK_BYTES = 4 * MiB  # kvd's default tcp_chunk_bytes
BLOCK_BYTES = 16 * MiB  # kvd region block size
DEFAULT_SIZES = "64MiB,1GiB"
TARGET_RATIO = 0.8
TARGET = f"kvd flow (a) median >= {TARGET_RATIO:.0%} of raw median"
IO_TIMEOUT_S = 60.0
LEN = 8  # raw header: payload length, little endian; then 1 byte: 1 = reply with a CRC32
ENCRYPTED = " encrypted (raw: TLS 1.3; kvd: CurveZMQ peer plane, TLS 1.3 data connections)"
now = time.perf_counter


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def timeout_for(nbytes: int) -> float:
    """Generous per-transfer deadline: 30 s plus 50 MB/s."""
    return 30.0 + nbytes / 50e6


def summarize(times_s: list[float], nbytes: int) -> dict[str, float]:
    best, median = min(times_s), statistics.median(times_s)
    return {"best_s": best, "median_s": median,
            "best_gbps": nbytes / best / 1e9, "median_gbps": nbytes / median / 1e9}


def machine() -> dict[str, Any]:
    model = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"node": platform.node(), "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)), "cpu_model": model or "unknown",
            "python": platform.python_version(), "kernel": platform.release()}


# ---------------------------------------------------------------- raw TCP baseline


@dataclass(frozen=True)
class RawTls:
    """The raw baseline's TLS identity, shaped like kvd's encrypted data connections
    (daemon/auth.py ``make_data_tls``): the receiver presents a self-signed EC P-256
    certificate, the sender pins its SHA-256 fingerprint and presents none."""

    pem_file: str  # the receiver's key and certificate
    fingerprint: bytes  # SHA-256 of the certificate (DER)

    @classmethod
    def make(cls, directory: str) -> RawTls:
        from kvd.daemon.auth import write_self_signed

        os.makedirs(directory, exist_ok=True)
        pem_file = os.path.join(directory, "raw.pem")
        return cls(pem_file, write_self_signed(pem_file, "bench raw", days=1))

    def wrap_sender(self, sock: socket.socket) -> ssl.SSLSocket:
        """TLS 1.3 client side; the receiver's certificate must be the pinned one."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # pinned by fingerprint below, as kvd does
        tls = ctx.wrap_socket(sock)
        der = tls.getpeercert(binary_form=True)
        if not der or hashlib.sha256(der).digest() != self.fingerprint:
            tls.close()
            raise ConnectionError("raw receiver presented a certificate that is not pinned")
        return tls


def wrap_receiver(sock: socket.socket, pem_file: str) -> ssl.SSLSocket:
    """TLS 1.3 server side with the run's certificate (no client certificate asked)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(pem_file)
    return ctx.wrap_socket(sock, server_side=True)


def curve_flags(directory: str, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each daemon's flags for CurveZMQ and encrypted data connections: its key pair
    (``kvd keygen``'s code), a peer port picked now, and one allow-list naming every
    daemon by key and ``127.0.0.1:port`` (the list names addresses, so the ports cannot
    be left to the daemons)."""
    from kvd.daemon.auth import write_keys

    os.makedirs(directory, exist_ok=True)
    allowed = os.path.join(directory, "allowed_keys")
    flags: dict[str, tuple[str, ...]] = {}
    with open(allowed, "w", encoding="utf-8") as f:
        for name in names:
            _, secret_file, public = write_keys(directory, name)
            port = free_port()
            f.write(f"{public} 127.0.0.1:{port}\n")
            flags[name] = ("--curve-secret-key-file", secret_file,
                           "--curve-allowed-keys-file", allowed,
                           "--peer-port", str(port), "--encrypt-data", "true")
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def recv_exactly(sock: socket.socket, view: memoryview, chunk: int) -> bool:
    """Fill ``view`` with ``recvmsg_into`` in chunks (``recv_into`` under TLS); False on a
    clean EOF before any byte."""
    got = 0
    while got < len(view):
        piece = view[got:got + min(chunk, len(view) - got)]
        n = (sock.recv_into(piece) if isinstance(sock, ssl.SSLSocket)
             else sock.recvmsg_into([piece])[0])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n
    return True


def send_exactly(sock: socket.socket, view: memoryview, chunk: int) -> None:
    sent = 0
    while sent < len(view):
        piece = view[sent:sent + min(chunk, len(view) - sent)]
        if isinstance(sock, ssl.SSLSocket):
            sock.sendall(piece)
            sent += len(piece)
        else:
            sent += sock.sendmsg([piece])


def raw_receiver(pipe: Any, max_bytes: int, chunk: int, tls_pem_file: str | None) -> None:
    """Child process: accept one connection (TLS with ``tls_pem_file``'s certificate when
    given), receive transfers until EOF, ack each."""
    buf = memoryview(bytearray(max_bytes))
    header = memoryview(bytearray(LEN + 1))
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(IO_TIMEOUT_S)
        pipe.send(srv.getsockname()[1])
        sock, _ = srv.accept()
    if tls_pem_file is not None:
        sock.settimeout(IO_TIMEOUT_S)
        sock = wrap_receiver(sock, tls_pem_file)
    with sock:
        # Under TLS a socket timeout costs a poll per record (~16 KiB): ~0.9 against ~1.3
        # GB/s on the 2-core machine. The baseline goes without; a dead peer still ends
        # it (EOF), and the parent kills a stuck child.
        sock.settimeout(None if tls_pem_file is not None else IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while recv_exactly(sock, header, chunk):
            n, check = int.from_bytes(header[:LEN], "little"), header[LEN]
            if not recv_exactly(sock, buf[:n], chunk):
                raise ConnectionError("peer closed before the payload")
            sock.sendall(zlib.crc32(buf[:n]).to_bytes(4, "little") if check else b"\x01")


def start_raw_receiver(max_bytes: int, tls: RawTls | None = None
                       ) -> tuple[Any, socket.socket]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=raw_receiver, daemon=True, args=(
        child, max_bytes, CHUNK_BYTES, None if tls is None else tls.pem_file))
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while not parent.poll(0.1):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"raw receiver did not start (exit code {proc.exitcode})")
        port = parent.recv()
        sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
        if tls is not None:
            sock = tls.wrap_sender(sock)
    except BaseException:
        stop_raw_receiver(proc)
        raise
    sock.settimeout(None if tls is not None else IO_TIMEOUT_S)  # see raw_receiver
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return proc, sock


def stop_raw_receiver(proc: Any) -> None:
    if proc is None:
        return
    proc.join(10)  # it exits on EOF once the sender's socket is closed
    if proc.exitcode is None:
        proc.terminate()
        proc.join(10)
    if proc.exitcode is None:
        proc.kill()
        proc.join(5)


def pattern_buffer(nbytes: int) -> memoryview:
    import numpy as np

    buf = bytearray(nbytes)
    words = np.frombuffer(buf, dtype=np.int64)
    words[:] = np.arange(len(words), dtype=np.int64)
    return memoryview(buf)


def raw_bench(sizes: list[int], repeat: int, tls: RawTls | None = None
              ) -> dict[int, list[float]]:
    """Seconds per transfer (including the 1-byte ack) for each size."""
    proc = sock = None
    times: dict[int, list[float]] = {}
    try:
        proc, sock = start_raw_receiver(max(sizes), tls)
        src = pattern_buffer(max(sizes))
        ack = bytearray(4)

        def transfer(n: int, check: bool) -> bytes:
            sock.sendall(n.to_bytes(LEN, "little") + bytes([check]))
            send_exactly(sock, src[:n], CHUNK_BYTES)
            want = 4 if check else 1
            if not recv_exactly(sock, memoryview(ack)[:want], want):
                raise ConnectionError("raw receiver closed the connection")
            return bytes(ack[:want])

        for n in sizes:
            crc = int.from_bytes(transfer(n, check=True), "little")  # warm-up + check
            if crc != zlib.crc32(src[:n]):
                raise RuntimeError(f"raw {fmt_size(n)}: receiver CRC32 {crc:#x} does not "
                                   f"match the sender's {zlib.crc32(src[:n]):#x}")
            gc.collect()
            times[n] = []
            for _ in range(repeat):
                t0 = now()
                transfer(n, check=False)
                times[n].append(now() - t0)
    finally:
        if sock is not None:
            sock.close()
        stop_raw_receiver(proc)
    return times


# ---------------------------------------------------------------- kvd


def start_daemon(root: str, name: str, pool_bytes: int, *extra: str
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """A ``kvd serve`` under ``root/name`` answering pings, and its socket path. Flags in
    ``extra`` come last and so override the defaults here (``--peer-port``)."""
    from kvd import KvdClient, KvdError

    tmp = os.path.join(root, name)
    os.makedirs(tmp)
    path, log_path = os.path.join(tmp, "kvd.sock"), os.path.join(tmp, "daemon.log")
    # (a measurement's development settings, KVD_DEV, are kept)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_") or k == "KVD_DEV"}
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--socket-path", path,
           "--node-id", f"bench-{name}", "--peer-port", "0", "--data-port", "0",
           "--http-port", "0", "--pool-size-bytes", str(pool_bytes), "--log-level", "warning",
           *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path):
            try:
                with KvdClient(path, name="bench-probe", timeout_s=1.0) as c:
                    c.ping()
                    return proc, path
            except KvdError:
                pass
        time.sleep(0.05)
    with open(log_path, errors="replace") as f:
        log_text = f.read()
    stop_daemon(proc)
    raise RuntimeError(f"kvd daemon {name} not ready (exit code {proc.poll()}):\n{log_text}")


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.001)


class KvdPair:
    """Daemons a (sender) and b (receiver), a client on a, and two on b: one to get with,
    one to watch ``stats()`` while the other is blocked in a get."""

    def __init__(self, a_path: str, b_path: str) -> None:
        from kvd import KvdClient

        self.tx = KvdClient(a_path, name="bench-tx", timeout_s=30.0)
        self.rx = KvdClient(b_path, name="bench-rx", timeout_s=30.0)
        self.watch = KvdClient(b_path, name="bench-watch", timeout_s=30.0)
        self.clients = [self.tx, self.rx, self.watch]
        for c in self.clients:
            c.connect()
        self.to = self.watch.stats()["peer"]["address"]
        self.keys = 0
        self.b_split: list[tuple[float, float]] = []  # flow (b): (put s, get s) per run

    def data_encrypted(self) -> bool:
        """Whether a's link to b carries its data connection over TLS."""
        links = [link for link in self.tx.stats()["peer"]["links"]
                 if link["address"] == self.to]
        if len(links) != 1:
            raise RuntimeError(f"daemon a has {len(links)} links to {self.to}, expected 1")
        return bool(links[0]["data_encrypted"])

    def close(self) -> None:
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.close()

    def key(self, flow: str, nbytes: int) -> str:
        self.keys += 1
        return f"bench-{flow}-{fmt_size(nbytes)}-{self.keys:06d}"

    def flow_a(self, r_src: Any, r_dst: Any, blocks: list[int], nbytes: int) -> float:
        """Get posted first, then put: seconds from put to both having returned."""
        key, limit = self.key("a", nbytes), timeout_for(nbytes)
        got: dict[str, Any] = {}

        def getter() -> None:
            try:
                got["n"] = self.rx.get(key, r_dst, blocks, timeout_s=limit)
            except BaseException as exc:
                got["error"] = exc
            got["t"] = now()

        thread = threading.Thread(target=getter, name="bench-get")
        thread.start()
        try:
            wait_until(lambda: "t" in got or self.watch.stats()["waiting_gets"] == 1, 10,
                       "the receiver's get to be waiting")
            t0 = now()
            sent = self.tx.put(key, r_src, blocks, to=self.to, timeout_s=limit).wait(limit)
            t_put = now()
        finally:
            thread.join(limit + 10)
        if thread.is_alive():
            raise RuntimeError(f"flow (a) {key}: get did not return within {limit + 10:g}s")
        if "error" in got:
            raise RuntimeError(f"flow (a) {key}: get failed: {got['error']!r}") from got["error"]
        if sent != nbytes or got["n"] != nbytes:
            raise RuntimeError(f"flow (a) {key}: put moved {sent}, get {got['n']} bytes; "
                               f"expected {nbytes}")
        return max(t_put, got["t"]) - t0

    def flow_b(self, r_src: Any, r_dst: Any, blocks: list[int], nbytes: int) -> float:
        """Put into the receiver's pool, then get from it: seconds end to end."""
        key, limit = self.key("b", nbytes), timeout_for(nbytes)
        t0 = now()
        sent = self.tx.put(key, r_src, blocks, to=self.to, timeout_s=limit).wait(limit)
        t_put = now()
        n = self.rx.get(key, r_dst, blocks, timeout_s=limit)
        t_get = now()
        if sent != nbytes or n != nbytes:
            raise RuntimeError(f"flow (b) {key}: put moved {sent}, get {n} bytes; "
                               f"expected {nbytes}")
        self.b_split.append((t_put - t0, t_get - t_put))
        return t_get - t0


def kvd_bench(root: str, sizes: list[int], repeat: int,
              curve: dict[str, tuple[str, ...]] | None = None
              ) -> dict[str, dict[int, list[float]]]:
    """Seconds per transfer for flows (a) and (b), and flow (b)'s put and get parts.
    ``curve``: the daemons' CurveZMQ flags by name (``curve_flags``), which encrypt their
    data connections; checked on the link after the run."""
    import torch

    from kvd import shared_empty

    times: dict[str, dict[int, list[float]]] = {"a": {}, "b": {}, "b_put": {}, "b_get": {}}
    pool = 2 * max(sizes) + 256 * MiB
    a = b = pair = None
    try:
        a, a_path = start_daemon(root, "a", pool, *(curve["a"] if curve else ()))
        b, b_path = start_daemon(root, "b", pool, *(curve["b"] if curve else ()))
        pair = KvdPair(a_path, b_path)
        for n in sizes:
            block = min(BLOCK_BYTES, n)
            shape = (n // block, block)
            blocks = list(range(shape[0]))
            src, dst = shared_empty(shape, torch.uint8), shared_empty(shape, torch.uint8)
            src.view(torch.int64).copy_(
                torch.arange(src.numel() // 8, dtype=torch.int64).view(shape[0], -1))
            r_src = pair.tx.register(f"src-{fmt_size(n)}", [src])
            r_dst = pair.rx.register(f"dst-{fmt_size(n)}", [dst])
            for flow, run in (("a", pair.flow_a), ("b", pair.flow_b)):
                dst.zero_()
                run(r_src, r_dst, blocks, n)  # warm-up + check
                if not torch.equal(src, dst):
                    bad = (src != dst).any(dim=1).nonzero().flatten().tolist()
                    raise RuntimeError(f"kvd flow ({flow}) {fmt_size(n)}: destination differs "
                                       f"from the source in blocks {bad[:16]}")
                gc.collect()
                pair.b_split.clear()
                times[flow][n] = [run(r_src, r_dst, blocks, n) for _ in range(repeat)]
            times["b_put"][n] = [put for put, _ in pair.b_split]
            times["b_get"][n] = [get for _, get in pair.b_split]
            pair.tx.unregister(r_src)
            pair.rx.unregister(r_dst)
            del src, dst
            gc.collect()
        if pair.data_encrypted() != (curve is not None):
            raise RuntimeError(f"kvd's data connection is {'plain' if curve else 'encrypted'}"
                               f", but this run {'encrypts' if curve else 'does not encrypt'}")
    except BaseException:
        for name in ("a", "b"):
            with contextlib.suppress(OSError), open(os.path.join(root, name, "daemon.log"),
                                                    errors="replace") as f:
                print(f"--- daemon {name} log:\n{f.read()[-4000:]}", file=sys.stderr)
        raise
    finally:
        if pair is not None:
            pair.close()
        stop_daemon(a)
        stop_daemon(b)
    return times


# ---------------------------------------------------------------- report


def report(raw: dict[int, list[float]], kvd: dict[str, dict[int, list[float]]],
           sizes: list[int], args: argparse.Namespace) -> dict:
    host = machine()
    out: dict[str, Any] = {"target": TARGET, "repeat": args.repeat, "machine": host,
                           "encrypt": bool(args.encrypt),
                           "chunk_bytes": CHUNK_BYTES, "block_bytes": BLOCK_BYTES,
                           "sizes": [fmt_size(n) for n in sizes]}
    rows = []
    for n in sizes:
        label = fmt_size(n)
        st = {"raw": summarize(raw[n], n), "a": summarize(kvd["a"][n], n),
              "b": summarize(kvd["b"][n], n)}
        for name, s in st.items():
            prefix = "raw" if name == "raw" else f"kvd_{name}"
            out.update({f"{prefix}_{label}_{k}": round(v, 6 if k.endswith("_s") else 3)
                        for k, v in s.items()})
        for flow in ("a", "b"):
            for stat in ("best", "median"):
                out[f"ratio_{flow}_{label}_{stat}"] = round(
                    st[flow][f"{stat}_gbps"] / st["raw"][f"{stat}_gbps"], 3)
        for part in ("put", "get"):  # where flow (b)'s time goes
            out[f"kvd_b_{label}_{part}_median_s"] = round(
                statistics.median(kvd[f"b_{part}"][n]), 6)
        out[f"target_met_{label}"] = out[f"ratio_a_{label}_median"] >= TARGET_RATIO
        rows.append((label, st))
    out["target_met"] = all(out[f"target_met_{fmt_size(n)}"] for n in sizes)

    print(f"kvd TCP transfer{ENCRYPTED if args.encrypt else ''}, daemon to daemon over "
          f"loopback; {args.repeat} timed runs per "
          f"size and flow after one checked warm-up; chunks {fmt_size(CHUNK_BYTES)}, "
          f"kvd blocks {fmt_size(BLOCK_BYTES)}")
    print(f"machine: {host['node']}, {host['cpu_model']}, {host['cpus']} CPUs "
          f"({host['cpus_usable']} usable), Python {host['python']}, Linux {host['kernel']}")
    print("GB/s = 1e9 bytes/s, best / median; raw includes a 1-byte ack round trip")
    print(f"\n{'size':<8}{'raw GB/s':>16}{'kvd (a) GB/s':>16}{'kvd (b) GB/s':>16}"
          f"{'(a)/raw':>16}{'(b)/raw':>16}")
    for label, st in rows:
        cells = [f"{st[k]['best_gbps']:.2f} / {st[k]['median_gbps']:.2f}"
                 for k in ("raw", "a", "b")]
        ratios = [f"{out[f'ratio_{f}_{label}_best']:.2f} / {out[f'ratio_{f}_{label}_median']:.2f}"
                  for f in ("a", "b")]
        print(f"{label:<8}" + "".join(f"{c:>16}" for c in cells + ratios))
    print("\n(a) put -> get with the get posted first (bytes land in the receiver's blocks)")
    print("(b) put into the receiver's pool, then get (pool -> blocks copy), end to end")
    for label, _ in rows:
        put_ms, get_ms = (out[f"kvd_b_{label}_{p}_median_s"] * 1e3 for p in ("put", "get"))
        print(f"    {label}: median put {put_ms:.1f} ms + get {get_ms:.1f} ms")
    print()
    for label, _ in rows:
        met = "MET" if out[f"target_met_{label}"] else "NOT MET"
        print(f"target {label}: {TARGET}: {out[f'ratio_a_{label}_median']:.0%} -> {met}")
    return out


def main() -> int:
    from kvd.config import parse_size
    from kvd.errors import ConfigError

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="also print one JSON line at the end")
    ap.add_argument("--quick", action="store_true", help="2 runs of 64MiB only")
    ap.add_argument("--sizes", help=f"comma-separated transfer sizes (default {DEFAULT_SIZES}; "
                                    "--quick: 64MiB)")
    ap.add_argument("--repeat", type=int, help="timed runs per size and flow (default 5; "
                                               "--quick: 2)")
    ap.add_argument("--encrypt", action="store_true",
                    help="TLS 1.3 on the raw sockets; CurveZMQ on kvd's peer plane and "
                         "encrypt_data (TLS 1.3 data connections)")
    args = ap.parse_args()
    args.repeat = args.repeat or (2 if args.quick else 5)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    try:
        sizes = [parse_size(s.strip()) for s in
                 (args.sizes or ("64MiB" if args.quick else DEFAULT_SIZES)).split(",")]
    except ConfigError as exc:
        ap.error(f"--sizes: {exc}")
    for n in sizes:
        if n < 8 or n % min(BLOCK_BYTES, n) or n % 8:
            ap.error(f"--sizes: {n} bytes is not a multiple of {fmt_size(BLOCK_BYTES)} "
                     "(or a multiple of 8 below it)")

    tmp = tempfile.mkdtemp(prefix="kvd-b-", dir="/tmp")  # short: Unix socket paths ~100 bytes
    try:
        keys = os.path.join(tmp, "keys")
        raw = raw_bench(sizes, args.repeat, RawTls.make(keys) if args.encrypt else None)
        kvd = kvd_bench(tmp, sizes, args.repeat,
                        curve_flags(keys, ("a", "b")) if args.encrypt else None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    out = report(raw, kvd, sizes, args)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
