"""Data connections, which carry a link's bytes over TCP (``DataPort``).

Each side of a link opens its own connection to the other's ``data_port`` for the bytes
it sends, when it first sends some, and presents there the *data token* it was given in
the handshake: the port only ever attaches connections of peers that passed the
handshake. A connection that carried nothing for ``peer_data_idle_s`` is closed by its
sender (``close_idle``): an idle link holds its ZeroMQ connection and nothing else. The
bytes of all connections are moved by one set of threads (``transport.tcp.DataThreads``).

With ``encrypt_data`` the connections are TLS (``daemon/auth.py``), pinned by the
certificate fingerprint the peers exchanged over the CURVE-secured handshake.

What a peer can make the daemon hold here: connections that have not presented a token
yet are bounded (``MAX_UNLINKED_CONNECTIONS``), each for ``peer_connect_timeout_s`` at
most, and the accept loop outlives a shortage of descriptors (``daemon/accepting.py``).
TLS steps run on the loop, never in a thread: a slow or silent peer holds no thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvd.config import Config
from kvd.daemon.accepting import Acceptor, Throttled
from kvd.daemon.auth import DataTls, fingerprint_of
from kvd.daemon.futures import keep_task
from kvd.daemon.peer_link import CPU_DEVICE, PeerLink
from kvd.daemon.peer_sockets import BadInput
from kvd.errors import ConfigError, KvdError, PeerUnreachable, ProtocolError
from kvd.transport.tcp import (
    DATA_HELLO,
    DataThreads,
    RecvChannel,
    SendChannel,
    data_hello,
    parse_data_hello,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Connections accepted on the data port that have not presented their token yet: past
# this a new one is closed at once. A flood of silent connections cannot take every
# descriptor the daemon has (each one lasts peer_connect_timeout_s at most).
MAX_UNLINKED_CONNECTIONS = 64


class DataPort:
    """Our data port, where peers attach the connections for the bytes they send us, and
    our connections to theirs.

    ``link_for_token`` finds the link a presented token belongs to (it may wait for a
    handshake in flight); ``on_broken`` is called, on the loop, when a link's data
    connection breaks. Refusals are counted in ``bad``.
    """

    def __init__(self, config: Config, tls: DataTls | None, bad: BadInput,
                 link_for_token: Callable[[bytes], Awaitable[PeerLink | None]],
                 on_broken: Callable[[PeerLink, KvdError], None]) -> None:
        self.config = config
        self.tls = tls
        self._bad = bad
        self._link_for_token = link_for_token
        self._on_broken = on_broken
        self._loop = asyncio.get_running_loop()
        self._listener: socket.socket | None = None
        self._acceptor: Acceptor | None = None
        self._unlinked: set[socket.socket] = set()  # connections before their token
        self._admitting: set[asyncio.Task[None]] = set()
        self._threads = DataThreads(self._loop)
        self._refusing = Throttled(log)
        self.port = 0

    def listen(self, host: str, port: int) -> None:
        """Claim the port; connections wait in its backlog until ``start``."""
        self._listener = _listen(host, port, "data_port")
        self.port = self._listener.getsockname()[1]

    def start(self) -> None:
        assert self._listener is not None
        self._acceptor = Acceptor(self._listener, "data_port", self._take)

    async def close(self) -> None:
        """Stop accepting, end the connections being admitted."""
        if self._acceptor is not None:
            self._acceptor.close()
        elif self._listener is not None:
            self._listener.close()
        tasks = list(self._admitting)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *([self._acceptor.wait_closed()] if self._acceptor else []),
                             return_exceptions=True)
        for sock in list(self._unlinked):
            sock.close()

    # ------------------------------------------------------------ a link's channels

    def recv_channel(self, link: PeerLink) -> RecvChannel:
        """The channel for the bytes ``link`` sends us: its connection attaches when the
        peer presents the link's token."""
        return RecvChannel(f"kvd-recv-{link.node_id}-{CPU_DEVICE}",
                           self.config.tcp_chunk_bytes, self._io_timeout(), self._threads,
                           self._broken(link),
                           attach_timeout_s=self.config.peer_connect_timeout_s)

    def close_idle(self, link: PeerLink) -> None:
        """Close our data connection to ``link`` if it carried nothing for
        ``peer_data_idle_s`` (the caller knows no transfer of the link's holds it)."""
        channel = link.send_channel
        if channel is not None and channel.close_idle(self.config.peer_data_idle_s):
            link.send_channel = link.connecting = None
            log.debug("data connection to %s closed: idle", link.address)

    async def send_channel(self, link: PeerLink) -> SendChannel:
        """The channel for bytes we send to ``link``, connected on first use."""
        if link.send_channel is not None:
            return link.send_channel
        if link.connecting is None:
            link.connecting = self._loop.create_future()
            self._loop.create_task(self._connect(link))
        return await asyncio.shield(link.connecting)

    def end_threads(self) -> None:
        """Once every link's channels are released: the data threads end when their work
        is done."""
        self._threads.shutdown()

    @staticmethod
    def abort(link: PeerLink, error: KvdError) -> None:
        """The link ended: what its channels move fails now."""
        for channel in (link.send_channel, link.recv_channel):
            if channel is not None:
                channel.abort(error)

    def release(self, link: PeerLink, error: KvdError) -> None:
        """The link ended: a connection being made fails, and its channels close (joining
        their workers can take a moment: not on the loop)."""
        if link.connecting is not None and not link.connecting.done():
            link.connecting.set_exception(error)
        if link.recv_channel is not None:
            link.recv_channel.leave_loop()
        channels = [c for c in (link.send_channel, link.recv_channel) if c is not None]
        if channels:
            self._loop.run_in_executor(None, _close_channels, channels)

    def _broken(self, link: PeerLink) -> Callable[[KvdError], None]:
        """A data connection that breaks takes its link down: the next transfer starts
        over with a fresh handshake."""
        def broken(err: KvdError) -> None:
            with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
                self._loop.call_soon_threadsafe(self._on_broken, link, err)
        return broken

    def _io_timeout(self) -> float:
        return max(self.config.peer_grace_s * 2, 10.0)

    async def _connect(self, link: PeerLink) -> None:
        connecting = link.connecting
        assert connecting is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        tls = self.tls if link.data_fingerprint else None
        try:
            async with asyncio.timeout(self.config.peer_connect_timeout_s):
                await self._loop.sock_connect(sock, (link.host, link.data_port))
                hello = data_hello(link.token_for_us)
                if tls is None:
                    await self._loop.sock_sendall(sock, hello)
                else:
                    sock = tls.client.wrap_socket(sock, do_handshake_on_connect=False)
                    await self._tls_step(sock, sock.do_handshake)
                    # The certificate the peer told us of over the CURVE-secured link: the
                    # token goes to nobody else.
                    if fingerprint_of(sock) != link.data_fingerprint:
                        raise ssl.SSLError(f"data port of {link.address} presented a "
                                           "certificate other than the one its hello named")
                    await self._tls_step(sock, lambda: sock.sendall(hello))
            sock.setblocking(True)
        except (OSError, TimeoutError) as exc:
            sock.close()
            link.connecting = None
            if not connecting.done():
                connecting.set_exception(
                    PeerUnreachable(f"data connection to {link.address} failed: {exc!r}"))
            return
        if not link.alive or connecting.done():
            sock.close()
            if not connecting.done():
                connecting.set_exception(PeerUnreachable(f"peer {link.address} is gone"))
            return
        link.send_channel = channel = SendChannel(
            f"kvd-send-{link.node_id}-{CPU_DEVICE}", sock, self.config.tcp_chunk_bytes,
            self._io_timeout(), self._threads.send, self._broken(link))
        connecting.set_result(channel)

    # ------------------------------------------------------------ admitting connections

    def _take(self, sock: socket.socket, addr: object) -> None:
        if len(self._unlinked) >= MAX_UNLINKED_CONNECTIONS:
            sock.close()
            self._bad.count("unlinked_limit")
            self._refusing.warning(
                "data_port: connection from=%s closed: %d connections are waiting to link "
                "already (the most); a flood of connections that do not link, or peers that "
                "do not finish their handshake", _host_port(addr), len(self._unlinked))
            return
        self._unlinked.add(sock)
        task = keep_task(self._admitting, self._admit(sock, addr))
        task.add_done_callback(lambda _t: self._unlinked.discard(sock))

    async def _admit(self, conn: socket.socket, addr: object) -> None:
        conn.setblocking(False)
        tls = self.tls
        try:
            if tls is not None:
                conn = tls.server.wrap_socket(conn, server_side=True,
                                              do_handshake_on_connect=False)
            async with asyncio.timeout(self.config.peer_connect_timeout_s):
                if isinstance(conn, ssl.SSLSocket):
                    await self._tls_step(conn, conn.do_handshake)
                buf = b""
                while len(buf) < DATA_HELLO.size:
                    chunk = await self._recv_some(conn, DATA_HELLO.size - len(buf))
                    if not chunk:
                        raise ProtocolError("data connection closed during hello")
                    buf += chunk
            token = parse_data_hello(buf)
            # (It may wait: the peer welcomed us and dialled in before our handshake made
            # the link.)
            async with asyncio.timeout(self.config.peer_connect_timeout_s):
                link = await self._link_for_token(token)
            if link is None or not link.alive or link.recv_channel is None:
                raise ProtocolError("data connection with an unknown token")
            conn.setblocking(True)
            link.recv_channel.attach(conn)
            log.info("data connection up from=%s node=%s", addr, link.node_id)
        except (ProtocolError, OSError, TimeoutError) as exc:
            if isinstance(exc, ssl.SSLError):
                reason = "data_handshake"  # not TLS, or TLS gone wrong
            else:
                reason = "data_token" if isinstance(exc, ProtocolError) else "data_connect"
            self._bad.count(reason)
            log.warning("data connection refused from=%s: %r", addr, exc)
            conn.close()
        except asyncio.CancelledError:  # the daemon is stopping
            conn.close()
            raise

    # ------------------------------------------------------------ TLS on the loop

    async def _tls_step(self, sock: ssl.SSLSocket, op: Callable[[], _T]) -> _T:
        """Run a TLS operation on a non-blocking socket on the loop, waiting for the socket
        whenever TLS asks to (a handshake, a hello): no thread is held by a peer that is
        slow or silent, so connections to the data port cannot starve the default executor
        (region registration and channel teardown use it). Callers bound it in time."""
        while True:
            try:
                return op()
            except ssl.SSLWantReadError:
                await self._fd_ready(sock, write=False)
            except ssl.SSLWantWriteError:
                await self._fd_ready(sock, write=True)

    async def _recv_some(self, sock: socket.socket, n: int) -> bytes:
        """Up to ``n`` bytes from a non-blocking socket, through TLS if it is wrapped."""
        if isinstance(sock, ssl.SSLSocket):
            return await self._tls_step(sock, functools.partial(sock.recv, n))
        return await self._loop.sock_recv(sock, n)

    async def _fd_ready(self, sock: socket.socket, write: bool) -> None:
        ready = self._loop.create_future()
        fd = sock.fileno()
        if write:
            self._loop.add_writer(fd, _settle_none, ready)
        else:
            self._loop.add_reader(fd, _settle_none, ready)
        try:
            await ready
        finally:
            (self._loop.remove_writer if write else self._loop.remove_reader)(fd)


def _listen(host: str, port: int, setting: str) -> socket.socket:
    """A non-blocking TCP listener; a clear ConfigError when the port is taken."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise ConfigError(f"{setting}: cannot listen on {host}:{port}: "
                          f"{exc.strerror or exc}") from None
    listener.listen(128)
    listener.setblocking(False)
    return listener


def _settle_none(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _host_port(addr: object) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)


def _close_channels(channels: list[SendChannel | RecvChannel]) -> None:
    for channel in channels:
        channel.close(5.0)
