"""A hostile local tenant, run as its own process by tests/test_local_door.py (as an
unprivileged user where the test runs as root).

    python -m tests.local_attacker MODE SOCKET_PATH N

It sets its attack up, prints ``READY`` (or ``READY <what it saw>``), and holds it until
its standard input closes. Modes:

- ``flood``: N bare connections to the socket, reopened as the daemon closes them.
- ``segments``: sessions through the door, each handing over one memfd under new segment
  ids until the daemon refuses; N sessions.
- ``ids``: N sessions whose DEALERs choose the routing ids libzmq would generate next
  (``0x00`` and the big-endian counter from 0x6b8b4567), and N bare DEALERs with the same
  ids dialling the socket as ZeroMQ.
- ``bigmsg``: N sessions whose endpoint speaks ZMTP by hand and starts a 63 MiB message
  it never finishes.
"""

from __future__ import annotations

import os
import resource
import select
import socket
import struct
import sys
import tempfile
import threading
from typing import Any

import msgspec
import zmq

from kvd.client.lifeline import ClientLifeline
from kvd.protocol import PROTOCOL_VERSION, Reach, SegmentHandoff, Taken


def _raise_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _connect(path: str) -> socket.socket | None:
    for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM):
        s = socket.socket(socket.AF_UNIX, kind)
        s.setblocking(False)
        try:
            s.connect(path)
            return s
        except BlockingIOError:
            return s
        except OSError:
            s.close()
    return None


def flood(path: str, n: int, stop: threading.Event) -> str:
    """Hold ``n`` connections; reopen those the daemon closes until told to stop."""
    held: list[socket.socket] = []
    for _ in range(n):
        if (s := _connect(path)) is not None:
            held.append(s)
    print(f"READY {len(held)}", flush=True)
    reopened = 0
    while not stop.is_set():
        poller = select.poll()
        for s in held:
            poller.register(s, select.POLLIN)
        closed = {fd for fd, ev in poller.poll(100) if ev & (select.POLLHUP | select.POLLERR)}
        closed |= {fd for fd, ev in poller.poll(0)
                   if ev & select.POLLIN and _eof(fd, held)}
        for s in [s for s in held if s.fileno() in closed]:
            held.remove(s)
            s.close()
            if (again := _connect(path)) is not None:
                held.append(again)
                reopened += 1
    return f"reopened {reopened}"


def _eof(fd: int, held: list[socket.socket]) -> bool:
    s = next(s for s in held if s.fileno() == fd)
    try:
        return s.recv(4096, socket.MSG_PEEK) == b""
    except OSError:
        return True


def session(path: str, routing_id: bytes = b"") -> tuple[ClientLifeline, zmq.Socket[Any]]:
    lifeline = ClientLifeline.connect(path, 10.0)
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    lifeline.reach(sock, 10.0)
    sock.send(msgspec.msgpack.encode({"op": "hello", "req_id": 1,
                                      "protocol_version": PROTOCOL_VERSION}))
    if not sock.poll(10_000):
        raise SystemExit("no welcome")
    sock.recv()
    return lifeline, sock


def segments(path: str, n: int) -> str:
    fd = os.memfd_create("kvd-attack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    import fcntl

    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    handed, refusal = 0, ""
    kept = []
    for _ in range(n):
        try:
            kept.append(session(path))
        except Exception:  # (refused: the daemon holds all it may)
            break
        lifeline = kept[-1][0]
        while not refusal:
            ids = list(range(handed + 1, handed + 65))
            lifeline.sock.sendmsg([msgspec.msgpack.encode(SegmentHandoff(segments=ids))],
                                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                    struct.pack(f"{len(ids)}i", *([fd] * len(ids))))])
            taken = msgspec.msgpack.decode(lifeline.sock.recv(4096), type=Taken)
            if taken.error:
                refusal = taken.error
            else:
                handed += len(ids)
        refusal = ""
    return f"handed {handed} sessions {len(kept)}"


def ids(path: str, n: int) -> str:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    chosen = [b"\x00" + struct.pack(">I", 0x6B8B4567 + i) for i in range(n)]
    bare = []
    for rid in chosen:  # (ZeroMQ dialling the door: it is not a ZeroMQ socket)
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, rid)
        s.connect(f"ipc://{path}")
        bare.append(s)
    kept = [session(path, rid) for rid in chosen]
    return f"sessions {len(kept)}"


def bigmsg(path: str, n: int) -> str:
    kept, cut = [], 0
    for _ in range(n):
        lifeline = ClientLifeline.connect(path, 10.0)
        private = tempfile.mkdtemp(prefix="kvd-a-")
        where = os.path.join(private, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(where)
        listener.listen(1)
        os.chmod(where, 0o666)
        handle = os.open(where, os.O_PATH)
        lifeline.sock.sendmsg([msgspec.msgpack.encode(Reach())],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", handle))])
        os.close(handle)
        taken = msgspec.msgpack.decode(lifeline.sock.recv(4096), type=Taken)
        if taken.error:
            raise SystemExit(taken.error)
        listener.settimeout(10)
        conn, _ = listener.accept()
        # ZMTP 3.0 by hand: greeting (NULL), READY as a DEALER, then a 63 MiB frame begun.
        conn.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
                     + b"\0" + b"\0" * 31)
        name, value = b"Socket-Type", b"DEALER"
        body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
        conn.sendall(b"\x04" + bytes([len(body)]) + body)
        try:
            conn.sendall(b"\x02" + struct.pack(">Q", 63 * 2**20) + b"x" * 2**20)
        except OSError:
            cut += 1  # (the daemon ended the connection at the frame's header)
        kept.append((lifeline, listener, conn, private))
    return f"begun {len(kept)} cut {cut}"


def main() -> None:
    mode, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    _raise_limit()
    stop = threading.Event()
    if mode == "flood":
        done: list[str] = []
        worker = threading.Thread(target=lambda: done.append(flood(path, n, stop)))
        worker.start()
        sys.stdin.read()
        stop.set()
        worker.join()
        print(done[0], flush=True)
        return
    said = {"segments": segments, "ids": ids, "bigmsg": bigmsg}[mode](path, n)
    print(f"READY {said}", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
