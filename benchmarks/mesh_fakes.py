"""Fake peers for benchmarks/mesh.py's many-links case: one process holding many links to
one ``kvd serve``, each speaking the peer protocol as a daemon does, at far less cost.

Run by mesh.py: ``python benchmarks/mesh_fakes.py KEYS_FILE HOST:PORT DAEMON_PUBLIC_KEY``
(``KEYS_FILE``: one line per fake, ``<public z85> <secret z85> <address>``; the daemon's
``curve_allowed_keys_file`` lists each public key with that address).

What each fake link does, as a daemon that dials would (kvd/daemon/peers.py):

* a ZeroMQ DEALER with CurveZMQ (its own key pair) to the daemon's peer port, a
  ``PeerHello`` (the listed address, a data token, the fingerprint of this process's TLS
  certificate), then the ``PeerWelcome``;
* no data connection: a daemon opens one when it first sends bytes on a link (this
  process's data port, one listener for all fakes, takes the daemon's if it ever opens
  one);
* TCP keepalives on its DEALER, as a daemon sets them (kvd/daemon/peer_sockets.py
  ``set_limits``), and no ``Heartbeat`` of kvd's after the first (a daemon sends those on
  links in use only); it reads (and drops) what the daemon sends.

It moves no bytes: the case measures what idle links cost the daemon. Links are made a
few at a time (the daemon shuts down handshakes past 256 pending). A refusal (a
``PeerError``: the daemon's ``max_peer_links`` with every link busy) is counted with its
reason.

On stdout, once every link is made or refused, one JSON line:
``{"linked", "refused", "failed", "reasons"}``; it then keeps the links until stdin closes
or it gets SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kvd.daemon.auth import DataTls, make_data_tls
from kvd.protocol import (
    PROTOCOL_VERSION,
    Heartbeat,
    PeerError,
    PeerHello,
    PeerWelcome,
    decode_peer,
    encode,
)
from kvd.transport.tcp import DATA_HELLO, parse_data_hello

LINKS_AT_ONCE = 16  # handshakes in flight (well under the daemon's 256 pending)
HANDSHAKE_S = 10.0
HEARTBEAT_MS, GRACE_MS = 1000, 3000  # a daemon's defaults (heartbeat_interval_s, peer_grace_s)


@dataclass
class FakeLink:
    public: bytes
    secret: bytes
    address: str
    token_for_daemon: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    sock: zmq.asyncio.Socket | None = None
    writers: list[asyncio.StreamWriter] = field(default_factory=list)


@dataclass
class Tally:
    linked: int = 0
    refused: int = 0
    failed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def note(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


class Fakes:
    def __init__(self, links: list[FakeLink], daemon_address: str, daemon_key: bytes) -> None:
        self.links = links
        self.daemon_address = daemon_address
        self.daemon_key = daemon_key
        self.ctx = zmq.asyncio.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.ctx.set(zmq.MAX_SOCKETS, len(links) + 64)
        self.tls: DataTls = make_data_tls()
        self.by_token = {link.token_for_daemon: link for link in links}
        self.epoch = int.from_bytes(secrets.token_bytes(6), "big")
        self.tally = Tally()
        self.data_port = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def serve_data_port(self) -> asyncio.Server:
        """Where the daemon's data connections (one per link) come in."""
        server = await asyncio.start_server(self._take_data, "127.0.0.1", 0,
                                            ssl=self.tls.server, backlog=1024)
        self.data_port = server.sockets[0].getsockname()[1]
        return server

    async def _take_data(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        try:
            token = parse_data_hello(await reader.readexactly(DATA_HELLO.size))
            link = self.by_token.get(token)
            if link is None:
                writer.close()
                return
            link.writers.append(writer)
            while await reader.read(65536):  # (nothing comes: no transfer uses the link)
                pass
        except Exception:  # (a broken connection: the link's loss is the daemon's to see)
            writer.close()
        except asyncio.CancelledError:  # (we are stopping: the connection goes with us)
            writer.close()

    async def make_all(self) -> None:
        gate = asyncio.Semaphore(LINKS_AT_ONCE)

        async def one(link: FakeLink) -> None:
            async with gate:
                await self.make(link)

        await asyncio.gather(*(one(link) for link in self.links))

    async def make(self, link: FakeLink) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.curve_serverkey = self.daemon_key
        sock.curve_publickey = link.public
        sock.curve_secretkey = link.secret
        sock.setsockopt(zmq.RECONNECT_IVL, -1)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, GRACE_MS // 1000)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, HEARTBEAT_MS // 1000)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 2)
        sock.connect(f"tcp://{self.daemon_address}")
        hello = PeerHello(protocol_version=PROTOCOL_VERSION, node_id=f"fake-{link.address}",
                          epoch=self.epoch, address=link.address, data_port=self.data_port,
                          data_token=link.token_for_daemon, devices=["cpu"],
                          data_fingerprint=self.tls.fingerprint, pool_capacity_bytes=0)
        try:
            await sock.send(encode(hello))
            async with asyncio.timeout(HANDSHAKE_S):
                answer = decode_peer(await sock.recv())
        except (TimeoutError, zmq.ZMQError) as exc:
            self.tally.failed += 1
            self.tally.note(f"no welcome: {type(exc).__name__}")
            sock.close(0)
            return
        if isinstance(answer, PeerError):
            self.tally.refused += 1
            self.tally.note(f"{answer.code}: {_gist(answer.message)}")
            sock.close(0)
            return
        if not isinstance(answer, PeerWelcome):
            self.tally.failed += 1
            self.tally.note(f"unexpected {type(answer).__name__}")
            sock.close(0)
            return
        link.sock = sock
        # The daemon reports an incoming link up at its first message after the welcome.
        await sock.send(encode(Heartbeat(epoch=self.epoch)))
        self.tally.linked += 1
        task = asyncio.create_task(self._drain(sock))
        self.tasks.add(task)

    async def _drain(self, sock: zmq.asyncio.Socket) -> None:
        """Read what the daemon sends on a link (its heartbeats), so nothing queues."""
        with contextlib.suppress(zmq.ZMQError, asyncio.CancelledError):
            while True:
                await sock.recv()

    def close(self) -> None:
        for link in self.links:
            for writer in link.writers:
                writer.close()
            if link.sock is not None:
                link.sock.close(0)
        self.ctx.term()


def _gist(message: str) -> str:
    """A refusal's reason without the numbers and names that differ per link."""
    return "link limit" if "max_peer_links" in message else message[:80]


def read_keys(path: str) -> list[FakeLink]:
    links = []
    with open(path, encoding="ascii") as f:
        for line in f:
            public, secret, address = line.split()
            links.append(FakeLink(public.encode(), secret.encode(), address))
    return links


async def run(keys_file: str, daemon_address: str, daemon_key: str) -> None:
    fakes = Fakes(read_keys(keys_file), daemon_address, daemon_key.encode())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not os.read(0, 4096) else None)
    server = await fakes.serve_data_port()
    try:
        await fakes.make_all()
        report: dict[str, Any] = {"linked": fakes.tally.linked, "refused": fakes.tally.refused,
                                  "failed": fakes.tally.failed, "reasons": fakes.tally.reasons}
        print(json.dumps(report), flush=True)
        await stop.wait()
    finally:
        for task in fakes.tasks:
            task.cancel()
        server.close()
        fakes.close()


if __name__ == "__main__":
    asyncio.run(run(*sys.argv[1:4]))
