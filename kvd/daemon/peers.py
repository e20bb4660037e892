"""The peer plane: links to other daemons, their handshake, heartbeats and death.

Each daemon listens on ``peer_host:peer_port`` (TCP, TLS when configured: see
``daemon/auth.py``) for control messages, and on ``data_port`` (plain TCP) for bytes. To
talk to a peer it opens a connection and says ``PeerHello`` (version, node id, epoch, its
address, its data port and a fresh *data token*); the peer answers ``PeerWelcome`` with
the same fields. The link then carries messages both ways over that one connection,
length-prefixed msgspec messages (``kvd.framing``) in order: the NCCL channels rely on
that order. Each side opens its own data connection to the other's data port for the
bytes it sends, presenting the token it was given, so the data port only ever accepts
peers that passed the handshake.

A link ends when its connection closes (a peer that exits or dies: at once), or when it
is silent for longer than ``peer_grace_s`` (a hung peer; heartbeats go both ways every
``heartbeat_interval_s``, and any message counts as a sign of life). Its transfers then
fail with ``PeerUnreachable`` (through ``on_link_lost``) and its channels are aborted. A
``PeerHello`` claiming the address of a link whose connection lives (open, and heard within
the grace) is refused: without TLS anyone could claim it. A peer that restarted closed its
old connection when it died (or falls silent past the grace); its hello is taken then, and
the old link dies the same way.

Connections on either port that have not linked yet (no hello, no data token) are
bounded together (``MAX_UNLINKED_CONNECTIONS``), so are links (``MAX_LINKS``: a hello past
it is refused), and the accept loops outlive a shortage of descriptors
(``daemon/accepting.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvd import timeline
from kvd.config import Config
from kvd.daemon.accepting import Acceptor, Throttled
from kvd.daemon.auth import TlsContexts, load_tls
from kvd.errors import BadRequest, ConfigError, KvdError, PeerUnreachable, ProtocolError
from kvd.framing import FrameBudget, FramedProtocol, Oversized
from kvd.protocol import (
    PROTOCOL_VERSION,
    Heartbeat,
    PeerError,
    PeerHello,
    PeerMessage,
    PeerWelcome,
    decode_peer,
    encode,
)
from kvd.transport.tcp import (
    DATA_HELLO,
    RecvChannel,
    SendChannel,
    data_hello,
    parse_data_hello,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

CPU_DEVICE = "cpu"
MAX_PEER_MESSAGE_BYTES = 1 << 20  # larger ones end the connection
# Control messages queued for a peer that does not read them: past this the link is
# declared dead rather than buffered without end (they are ~100 bytes each).
_MAX_UNSENT_BYTES = 16 * 1024 * 1024
# Accepted connections not linked yet (before their PeerHello, or their data token), on
# both ports together: past this a new one is closed at once. Linking takes a round trip,
# so a cluster starting at once stays far below it; a flood of silent connections cannot
# take every descriptor the daemon has (each one lasts peer_connect_timeout_s at most).
MAX_UNLINKED_CONNECTIONS = 64
# Links at once, those we made and those peers made together: past it a peer's hello is
# refused (ours to a peer are not: a client asked for them). A link holds a thread (its
# data connection's receiver) and its state while it lives, and without TLS anyone who
# reaches the peer port can make one and keep it. A node links to the daemons it
# exchanges KV with: a few, or tens in a large disaggregated deployment, far below this.
MAX_LINKS = 256


class _PeerConnection(FramedProtocol):
    """One control connection to a peer: messages in (to the plane), messages out."""

    def __init__(self, plane: PeerPlane, outgoing: bool) -> None:
        super().__init__(MAX_PEER_MESSAGE_BYTES, write_limit=_MAX_UNSENT_BYTES,
                         budget=plane.frame_budget, bad_messages=plane.bad_messages,
                         what="peer")
        self.plane = plane
        self.link: PeerLink | None = None
        self.peer = "?"
        # An outgoing connection waits for the PeerWelcome that completes its handshake.
        self.welcome: asyncio.Future[PeerWelcome] | None = (
            plane._loop.create_future() if outgoing else None)
        self.early: list[bytes] = []  # messages behind the welcome, until the link is made
        self.silence_timer: asyncio.TimerHandle | None = None  # no hello yet: see _expire_silent

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = f"{peer[0]}:{peer[1]}"
        self.plane._connections.add(self)

    def on_frame(self, item: bytes | Oversized) -> None:
        self.plane._on_message(self, item)

    def pause_writing(self) -> None:
        self.plane._on_stalled(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.plane._connections.discard(self)
        self.plane._on_closed(self)

    def stop_timer(self) -> None:
        if self.silence_timer is not None:
            self.silence_timer.cancel()
            self.silence_timer = None


@dataclass(eq=False)
class PeerLink:
    address: str  # how the peer is reached: host:port of its peer socket
    node_id: str
    epoch: int
    data_port: int
    token_for_them: bytes  # they present it on our data port
    token_for_us: bytes  # we present it on theirs
    conn: _PeerConnection | None = None  # the control connection
    outgoing: bool = False  # we opened it
    last_seen: float = 0.0
    devices: list[str] = field(default_factory=list)  # "cpu", and "cuda:N" with NCCL
    nccl_blocking_calls: bool = False  # the peer splits its channels for blocking calls
    alive: bool = True
    send_channel: SendChannel | None = None
    recv_channel: RecvChannel | None = None
    connecting: asyncio.Future[SendChannel] | None = None
    on_lost: list[Callable[[PeerLink, KvdError], None]] = field(default_factory=list)
    reported_up: bool = False  # on_link_up was called (see PeerPlane._link_up)

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    def describe(self, now: float) -> dict[str, Any]:
        return {"address": self.address, "node_id": self.node_id, "epoch": self.epoch,
                "direction": "out" if self.outgoing else "in",
                "alive": self.alive, "last_heard_s_ago": round(now - self.last_seen, 3),
                "devices": self.devices, "nccl_blocking_calls": self.nccl_blocking_calls,
                "channels": {"send": self.send_channel is not None,
                             "recv": self.recv_channel is not None}}


class PeerPlane:
    def __init__(self, config: Config, epoch: int,
                 on_message: Callable[[PeerLink, PeerMessage], None],
                 on_link_lost: Callable[[PeerLink, KvdError], None],
                 gpus: Sequence[str] = (),
                 on_link_up: Callable[[PeerLink], None] | None = None,
                 nccl_blocking_calls: bool = False,
                 frame_budget: FrameBudget | None = None) -> None:
        self.config = config
        self.gpus = list(gpus)  # our GPUs that NCCL channels can use, told to peers
        # Told to peers too: our channels can split for blocking calls (config and NCCL).
        self.nccl_blocking_calls = nccl_blocking_calls
        self.epoch = epoch
        self.on_message = on_message
        self.on_link_lost = on_link_lost
        self.on_link_up = on_link_up
        self.frame_budget = frame_budget  # shared with the local socket (kvd.framing)
        self.bad_messages: dict[str, int] = {}
        self._bad_logs: dict[str, Throttled] = {}  # per reason (see _bad)
        self.links: dict[str, PeerLink] = {}  # by address
        self._by_token: dict[bytes, PeerLink] = {}
        self._connections: set[_PeerConnection] = set()
        # Tokens of our handshakes in flight: the peer may dial our data port as soon as
        # it has welcomed us, before our loop has made the link that knows the token.
        self._handshake_done: dict[bytes, asyncio.Future[None]] = {}
        self._linking: dict[str, asyncio.Task[PeerLink]] = {}
        self._warmups: set[asyncio.Task[None]] = set()
        self._admitting: set[asyncio.Task[None]] = set()
        # Accepted connections not linked yet (see MAX_UNLINKED_CONNECTIONS): a peer
        # connection, or a data connection's socket, until it links or closes.
        self._unlinked: set[object] = set()
        self._refusing = Throttled(log)
        self._loop = asyncio.get_running_loop()
        self.tls = load_tls(config)
        self._listener: socket.socket | None = None
        self._data_listener: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._acceptors: list[Acceptor] = []
        self.address = ""
        self.data_port = 0
        self.configured = [a.strip() for a in config.peers.split(",") if a.strip()]

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        cfg = self.config
        self._listener = _listen(cfg.peer_host, cfg.peer_port, "peer_port")
        port = self._listener.getsockname()[1]
        self.address = f"{cfg.advertise_host or cfg.peer_host}:{port}"
        self._data_listener = _listen(cfg.peer_host, cfg.data_port, "data_port")
        self.data_port = self._data_listener.getsockname()[1]
        self._tasks = [
            self._loop.create_task(self._heartbeat_loop(), name="kvd-peer-heartbeat")]
        self._acceptors = [Acceptor(self._listener, "peer_port", self._take_peer),
                           Acceptor(self._data_listener, "data_port", self._take_data)]
        log.info("peer socket listening address=%s data_port=%d tls=%s", self.address,
                 self.data_port, "on" if self.tls else "off")

    async def close(self) -> None:
        for acceptor in self._acceptors:
            acceptor.close()
        tasks = [*self._tasks, *self._warmups, *self._linking.values(), *self._admitting]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *(a.wait_closed() for a in self._acceptors),
                             return_exceptions=True)
        for link in list(self.links.values()):
            self._lose(link, PeerUnreachable("daemon stopping"))
        await asyncio.sleep(0)
        for conn in list(self._connections):
            conn.close()
        for listener in (self._listener, self._data_listener):
            if listener is not None:
                listener.close()

    # ------------------------------------------------------------ links

    def _hello_fields(self, token: bytes) -> dict[str, Any]:
        return {"protocol_version": PROTOCOL_VERSION, "node_id": self.config.node_id,
                "epoch": self.epoch, "address": self.address, "data_port": self.data_port,
                "data_token": token, "devices": [CPU_DEVICE, *self.gpus],
                "nccl_blocking_calls": self.nccl_blocking_calls}

    async def link_to(self, address: str, timeout_s: float) -> PeerLink:
        """The live link to ``address``, after a handshake if there is none. Concurrent
        callers share one handshake."""
        link = self.links.get(address)
        if link is not None and link.alive:
            return link
        pending = self._linking.get(address)
        if pending is None:
            pending = self._loop.create_task(self._handshake(address, timeout_s))
            self._linking[address] = pending
            pending.add_done_callback(lambda _t: self._linking.pop(address, None))
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(pending)
        except TimeoutError:
            raise PeerUnreachable(f"no answer from peer {address} within {timeout_s:g}s") from None

    async def _handshake(self, address: str, timeout_s: float) -> PeerLink:
        if address == self.address:
            raise PeerUnreachable(f"{address} is this daemon")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise BadRequest(f"peer address must be host:port, got {address!r}")
        token = secrets.token_bytes(32)
        done = self._handshake_done[token] = self._loop.create_future()
        conn: _PeerConnection | None = None
        try:
            async with asyncio.timeout(min(timeout_s, self.config.peer_connect_timeout_s)):
                _, conn = await self._loop.create_connection(
                    lambda: _PeerConnection(self, outgoing=True), host, int(port),
                    ssl=self.tls.client if self.tls else None,
                    server_hostname=host if self.tls else None)
                assert conn.welcome is not None
                conn.send(encode(PeerHello(**self._hello_fields(token))))
                welcome = await conn.welcome
        except (TimeoutError, OSError, KvdError) as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, KvdError) and not isinstance(exc, PeerUnreachable):
                raise
            hint = (" (with TLS: is our certificate in its tls_allowed_certs_file, and its "
                    "in ours?)" if self.tls else "")
            detail = "" if isinstance(exc, TimeoutError) else (
                f": {exc.message}" if isinstance(exc, KvdError) else f": {exc}")
            raise PeerUnreachable(f"no answer from peer {address}{hint}{detail}") from None
        finally:
            del self._handshake_done[token]
            if not done.done():
                done.set_result(None)
        link = PeerLink(address=address, node_id=welcome.node_id, epoch=welcome.epoch,
                        data_port=welcome.data_port, token_for_them=token,
                        token_for_us=welcome.data_token, conn=conn, outgoing=True,
                        last_seen=self._loop.time(), devices=list(welcome.devices),
                        nccl_blocking_calls=welcome.nccl_blocking_calls)
        conn.link = link
        self._add_link(link)
        log.info("peer up address=%s node=%s epoch=%d (outgoing)", address, link.node_id,
                 link.epoch)
        self._warm_up(link)
        self._link_up(link)
        early, conn.early = conn.early, []
        for item in early:  # what came right behind the welcome, before the link was made
            self._on_message(conn, item)
        return link

    def _add_link(self, link: PeerLink) -> None:
        old = self.links.get(link.address)
        if old is not None and old.alive:
            reason = ("peer restarted" if old.epoch != link.epoch
                      else "peer reconnected")
            self._lose(old, PeerUnreachable(f"{reason}: {link.address}"))
        self.links[link.address] = link
        self._by_token[link.token_for_them] = link
        link.recv_channel = RecvChannel(f"kvd-recv-{link.node_id}-{CPU_DEVICE}",
                                        self.config.tcp_chunk_bytes, self._io_timeout(),
                                        self._on_broken(link),
                                        attach_timeout_s=self.config.peer_connect_timeout_s)

    def _on_broken(self, link: PeerLink) -> Callable[[KvdError], None]:
        """A data connection that breaks takes its link down: the next transfer starts
        over with a fresh handshake."""
        def broken(err: KvdError) -> None:
            with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
                self._loop.call_soon_threadsafe(self._lose, link, err)
        return broken

    def _io_timeout(self) -> float:
        return max(self.config.peer_grace_s * 2, 10.0)

    def _link_up(self, link: PeerLink) -> None:
        """Tell the daemon a link is up, once: an outgoing one as soon as it is made; an
        incoming one when the first message after the handshake arrives — the dialer may
        drop (or refuse) a message that reaches it before its loop has made the link."""
        link.reported_up = True
        if self.on_link_up is not None:
            try:
                self.on_link_up(link)
            except Exception:
                log.exception("unhandled error in the link-up handler")

    def _warm_up(self, link: PeerLink) -> None:
        """Open our data connection right after the handshake, so the first transfer does
        not wait for it (a failure here is retried by that transfer)."""
        async def connect() -> None:
            with contextlib.suppress(KvdError):
                await self.send_channel(link)

        task = self._loop.create_task(connect())
        self._warmups.add(task)
        task.add_done_callback(self._warmups.discard)

    async def send_channel(self, link: PeerLink) -> SendChannel:
        """The channel for bytes we send to ``link``, connected on first use."""
        if link.send_channel is not None:
            return link.send_channel
        if link.connecting is None:
            link.connecting = self._loop.create_future()
            self._loop.create_task(self._connect_data(link))
        return await asyncio.shield(link.connecting)

    async def _connect_data(self, link: PeerLink) -> None:
        connecting = link.connecting
        assert connecting is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        tls = self._data_tls()
        try:
            async with asyncio.timeout(self.config.peer_connect_timeout_s):
                await self._loop.sock_connect(sock, (link.host, link.data_port))
                hello = data_hello(link.token_for_us)
                if tls is None:
                    await self._loop.sock_sendall(sock, hello)
                else:
                    sock = tls.client.wrap_socket(sock, do_handshake_on_connect=False)
                    await self._tls_step(sock, sock.do_handshake)
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
        channel = SendChannel(f"kvd-send-{link.node_id}-{CPU_DEVICE}",
                              self.config.tcp_chunk_bytes, self._io_timeout(),
                              self._on_broken(link))
        channel.attach(sock)
        link.send_channel = channel
        connecting.set_result(channel)

    def _data_tls(self) -> TlsContexts | None:
        """The TLS contexts for data connections: the peer plane's, unless ``tls_data`` is
        off (plain TCP on a trusted network, for speed)."""
        return self.tls if self.config.tls_data else None

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

    def send(self, link: PeerLink, msg: Any) -> None:
        """Send a message on the link (dropped silently if the link is gone)."""
        if not link.alive or link.conn is None:
            return
        timeline.mark(f"peer.send.{msg.__struct_config__.tag}")
        if not link.conn.send(encode(msg)):
            log.debug("peer message dropped address=%s: connection closing", link.address)

    def _lose(self, link: PeerLink, error: KvdError) -> None:
        if not link.alive:
            return
        link.alive = False
        log.warning("peer down address=%s node=%s epoch=%d: %s", link.address, link.node_id,
                    link.epoch, error.message)
        if self.links.get(link.address) is link:
            del self.links[link.address]
        self._by_token.pop(link.token_for_them, None)
        for channel in (link.send_channel, link.recv_channel):
            if channel is not None:
                channel.abort(error)
        self.on_link_lost(link, error)
        callbacks, link.on_lost = link.on_lost, []  # what they hold goes with the link
        for callback in callbacks:
            callback(link, error)
        if link.connecting is not None and not link.connecting.done():
            link.connecting.set_exception(error)
        # Joining the workers can take a moment: not on the loop.
        channels = [c for c in (link.send_channel, link.recv_channel) if c is not None]
        if channels:
            self._loop.run_in_executor(None, _close_channels, channels)
        if link.conn is not None:
            link.conn.close()

    # ------------------------------------------------------------ reading

    def _room_for(self, sock: socket.socket, addr: Any, port: str) -> bool:
        """Whether one more connection may wait to link (MAX_UNLINKED_CONNECTIONS); if
        not, it is closed now, counted and logged."""
        if len(self._unlinked) < MAX_UNLINKED_CONNECTIONS:
            return True
        sock.close()
        self.bad_messages["unlinked_limit"] = self.bad_messages.get("unlinked_limit", 0) + 1
        self._refusing.warning(
            "%s: connection from=%s closed: %d connections are waiting to link already "
            "(the most); a flood of connections that do not link, or peers that do not "
            "finish their handshake", port, _host_port(addr), len(self._unlinked))
        return False

    def _take_peer(self, sock: socket.socket, addr: Any) -> None:
        """A connection on the peer port: it passes the TLS handshake (when configured)
        before it may say anything, and must say PeerHello in time."""
        if not self._room_for(sock, addr, "peer_port"):
            return
        conn = _PeerConnection(self, outgoing=False)
        self._unlinked.add(conn)
        task = self._loop.create_task(self._admit_peer(conn, sock, addr))
        self._admitting.add(task)
        task.add_done_callback(self._admitting.discard)

    async def _admit_peer(self, conn: _PeerConnection, sock: socket.socket,
                          addr: Any) -> None:
        try:
            # The protocol is made here and handed in: with TLS, what the call returns is
            # the TLS layer's protocol, not ours.
            await self._loop.connect_accepted_socket(
                lambda: conn, sock, ssl=self.tls.server if self.tls else None,
                ssl_handshake_timeout=self.config.peer_connect_timeout_s if self.tls else None)
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            self._unlinked.discard(conn)
            refused = isinstance(exc, ssl.SSLCertVerificationError)
            reason = "auth" if refused else "handshake"
            self.bad_messages[reason] = self.bad_messages.get(reason, 0) + 1
            log.warning("peer connection refused from=%s: %s", _host_port(addr),
                        "certificate not in tls_allowed_certs_file" if refused else repr(exc))
            sock.close()
            return
        except BaseException:
            self._unlinked.discard(conn)
            raise
        if conn.link is None and conn.transport is not None:
            # A connection that never says hello is not kept (a port scan, a stuck peer).
            conn.silence_timer = self._loop.call_later(
                self.config.peer_connect_timeout_s, self._expire_silent, conn)

    def _expire_silent(self, conn: _PeerConnection) -> None:
        conn.silence_timer = None
        if conn.link is None and conn.transport is not None:
            self.bad_messages["no_hello"] = self.bad_messages.get("no_hello", 0) + 1
            log.warning("peer connection from=%s closed: no peer_hello within %gs", conn.peer,
                        self.config.peer_connect_timeout_s)
            conn.close()

    def _on_closed(self, conn: _PeerConnection) -> None:
        self._unlinked.discard(conn)
        conn.stop_timer()
        if conn.welcome is not None and not conn.welcome.done():
            conn.welcome.set_exception(PeerUnreachable(
                f"peer {conn.peer} closed the connection during the handshake"))
        link = conn.link
        if link is not None and link.alive and link.conn is conn:
            self._lose(link, PeerUnreachable(f"connection to peer {link.address} closed"))

    def _on_stalled(self, conn: _PeerConnection) -> None:
        link = conn.link
        if link is not None and link.alive:
            self._lose(link, PeerUnreachable(
                f"peer {link.address} stopped reading ({_MAX_UNSENT_BYTES} bytes unsent)"))
        conn.close(abort=True)  # what is queued would never be read

    def _bad(self, reason: str, conn: _PeerConnection, err: KvdError) -> None:
        self.bad_messages[reason] = self.bad_messages.get(reason, 0) + 1
        # Answered and counted each time, logged at most once per reason every few
        # seconds: a peer sending nothing else cannot flood the log.
        self._bad_logs.setdefault(reason, Throttled(log)).warning(
            "bad peer message reason=%s from=%s: %s", reason, conn.peer, err.message)
        conn.send(encode(PeerError(code=err.code, message=err.message)))

    def _on_message(self, conn: _PeerConnection, payload: bytes | Oversized) -> None:
        if isinstance(payload, Oversized):
            self._bad("too_large", conn, ProtocolError(
                f"message of {payload.nbytes} bytes exceeds {MAX_PEER_MESSAGE_BYTES}"))
            conn.close()  # out of step on purpose: nothing sends such messages
            return
        try:
            msg = decode_peer(payload)
        except ProtocolError as err:
            self._bad("malformed", conn, err)
            return
        if conn.welcome is not None and conn.link is None:
            if conn.welcome.done():  # the link is being made: keep the message for it
                conn.early.append(payload)
            else:
                self._on_handshake_reply(conn, msg)
            return
        if isinstance(msg, PeerHello):
            self._on_hello(conn, msg)
            return
        link = conn.link
        if link is None or not link.alive:
            self._bad("no_link", conn, ProtocolError(
                "unknown peer: send peer_hello first (this daemon may have restarted)"))
            return
        link.last_seen = self._loop.time()
        if not link.reported_up:
            self._link_up(link)
        if isinstance(msg, Heartbeat):
            return
        timeline.mark(f"peer.recv.{msg.__struct_config__.tag}")
        if isinstance(msg, PeerError):
            log.warning("peer %s reported: [%s] %s", link.address, msg.code, msg.message)
            return
        if isinstance(msg, PeerWelcome):
            self._bad("unexpected", conn, ProtocolError("unexpected peer_welcome"))
            return
        self.on_message(link, msg)

    def _on_handshake_reply(self, conn: _PeerConnection, msg: PeerMessage) -> None:
        fut = conn.welcome
        assert fut is not None
        if fut.done():
            return
        if isinstance(msg, PeerWelcome):
            if msg.protocol_version != PROTOCOL_VERSION:
                fut.set_exception(ProtocolError(
                    f"peer speaks protocol {msg.protocol_version}, we speak {PROTOCOL_VERSION}"))
            else:
                fut.set_result(msg)
        elif isinstance(msg, PeerError):
            from kvd.errors import error_from_code

            fut.set_exception(error_from_code(msg.code, f"peer refused: {msg.message}"))

    def _answers(self, link: PeerLink) -> bool:
        """The link's connection is open and the peer was heard within its grace."""
        transport = link.conn.transport if link.conn is not None else None
        return (link.alive and transport is not None and not transport.is_closing()
                and self._loop.time() - link.last_seen <= self.config.peer_grace_s)

    def _on_hello(self, conn: _PeerConnection, hello: PeerHello) -> None:
        if conn.welcome is not None:
            self._bad("unexpected", conn, ProtocolError("peer_hello on a link we opened"))
            return
        if hello.protocol_version != PROTOCOL_VERSION:
            self._bad("version", conn, ProtocolError(
                f"protocol version {hello.protocol_version} is not supported; this daemon "
                f"speaks version {PROTOCOL_VERSION}"))
            return
        if conn.link is not None:
            self._bad("duplicate_hello", conn, ProtocolError("already said peer_hello"))
            return
        old = self.links.get(hello.address)
        if old is not None and self._answers(old):
            # Without TLS anyone can claim an address: the link that holds it keeps it
            # while it answers. A peer that restarted closed its old connection when it
            # died (or falls silent past the grace), and its new hello is taken then.
            self._bad("takeover", conn, PeerUnreachable(
                f"{hello.address} is linked already (node {old.node_id}, epoch {old.epoch}) "
                f"and that connection is alive: refused until it closes or is silent for "
                f"{self.config.peer_grace_s:g}s"))
            conn.close()
            return
        if old is None and len(self.links) >= MAX_LINKS:  # (one in old's place adds none)
            self._bad("link_limit", conn, PeerUnreachable(
                f"{self.config.node_id} has {len(self.links)} links already (the most): "
                f"hello from {hello.address} (node {hello.node_id}) refused"))
            conn.close()
            return
        token = secrets.token_bytes(32)
        link = PeerLink(address=hello.address, node_id=hello.node_id, epoch=hello.epoch,
                        data_port=hello.data_port, token_for_them=token,
                        token_for_us=hello.data_token, conn=conn,
                        last_seen=self._loop.time(), devices=list(hello.devices),
                        nccl_blocking_calls=hello.nccl_blocking_calls)
        conn.link = link
        self._unlinked.discard(conn)
        conn.stop_timer()
        self._add_link(link)
        log.info("peer up address=%s node=%s epoch=%d (incoming)", link.address,
                 link.node_id, link.epoch)
        conn.send(encode(PeerWelcome(**self._hello_fields(token))))
        self._warm_up(link)

    # ------------------------------------------------------------ data connections

    def _take_data(self, sock: socket.socket, addr: Any) -> None:
        if not self._room_for(sock, addr, "data_port"):
            return
        self._unlinked.add(sock)
        task = self._loop.create_task(self._admit_data(sock, addr))
        self._admitting.add(task)
        task.add_done_callback(self._admitting.discard)
        task.add_done_callback(lambda _t: self._unlinked.discard(sock))

    async def _admit_data(self, conn: socket.socket, addr: Any) -> None:
        conn.setblocking(False)
        tls = self._data_tls()
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
            link = self._by_token.get(token)
            if link is None and token in self._handshake_done:
                # It welcomed us and dialled in before our handshake made the link.
                async with asyncio.timeout(self.config.peer_connect_timeout_s):
                    await asyncio.shield(self._handshake_done[token])
                link = self._by_token.get(token)
            if link is None or not link.alive or link.recv_channel is None:
                raise ProtocolError("data connection with an unknown token")
            conn.setblocking(True)
            link.recv_channel.attach(conn)
            log.info("data connection up from=%s node=%s", addr, link.node_id)
        except (ProtocolError, OSError, TimeoutError) as exc:
            if isinstance(exc, ssl.SSLCertVerificationError):
                reason = "data_auth"  # a certificate not in tls_allowed_certs_file
            elif isinstance(exc, ssl.SSLError):
                reason = "data_handshake"  # not TLS, or TLS gone wrong
            else:
                reason = "data_token" if isinstance(exc, ProtocolError) else "data_connect"
            self.bad_messages[reason] = self.bad_messages.get(reason, 0) + 1
            log.warning("data connection refused from=%s: %r", addr, exc)
            conn.close()
        except asyncio.CancelledError:  # the daemon is stopping
            conn.close()
            raise

    # ------------------------------------------------------------ heartbeats

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            self._link_configured()
            await asyncio.sleep(interval)
            now = self._loop.time()
            for link in list(self.links.values()):
                silent = now - link.last_seen
                if silent > self.config.peer_grace_s:
                    self._lose(link, PeerUnreachable(
                        f"peer {link.address} silent for {silent:.1f}s "
                        f"(grace {self.config.peer_grace_s:g}s)"))
                else:
                    self.send(link, Heartbeat(epoch=self.epoch))

    def _link_configured(self) -> None:
        """Keep a link to every configured peer (retried each heartbeat)."""
        for address in self.configured:
            link = self.links.get(address)
            if (link is None or not link.alive) and address not in self._linking:
                async def connect(address: str = address) -> None:
                    with contextlib.suppress(KvdError):
                        await self.link_to(address, self.config.peer_connect_timeout_s)

                task = self._loop.create_task(connect())
                self._warmups.add(task)
                task.add_done_callback(self._warmups.discard)

    def stats(self) -> dict[str, Any]:
        return {"address": self.address, "data_port": self.data_port,
                "links": [link.describe(self._loop.time()) for link in self.links.values()],
                "configured": list(self.configured),
                "bad_messages": dict(self.bad_messages)}


def _listen(host: str, port: int, setting: str) -> socket.socket:
    """A non-blocking TCP listener; a clear ConfigError when the port is taken."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise ConfigError(f"{setting}: cannot listen on {host}:{port}: {exc}") from None
    listener.listen(128)
    listener.setblocking(False)
    return listener


def _settle_none(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _host_port(addr: Any) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)


def _close_channels(channels: list[Any]) -> None:
    for channel in channels:
        channel.close(5.0)
