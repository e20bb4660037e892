"""The peer plane: links to other daemons, their handshake, heartbeats and death.

Each daemon binds a ZMQ ROUTER on ``tcp://peer_host:peer_port`` and a plain TCP data
listener on ``data_port``. To talk to a peer it connects a DEALER and says ``PeerHello``
(version, node id, epoch, its address, its data port and a fresh *data token*); the peer
answers ``PeerWelcome`` with the same fields. The link then carries messages both ways:
ours on the DEALER, theirs back through their ROUTER; a peer that connected to us is
answered on our ROUTER with its identity. Each side opens its own data connection to the
other's data port for the bytes it sends, presenting the token it was given, so the data
port only ever accepts peers that passed the handshake.

Heartbeats go both ways every ``heartbeat_interval_s``; any message counts as a sign of
life. A link silent for longer than ``peer_grace_s`` is dead: its transfers fail with
``PeerUnreachable`` (through ``on_link_lost``), its channels are aborted, its sockets closed.
A ``PeerHello`` with a new epoch from a known address means the peer restarted: the old
link dies the same way and the new one replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvd import timeline
from kvd.config import Config
from kvd.daemon.auth import ZapHandler, load_keys
from kvd.errors import KvdError, PeerUnreachable, ProtocolError
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
from kvd.transport.tcp import RecvChannel, SendChannel, data_hello, parse_data_hello

log = logging.getLogger(__name__)

CPU_DEVICE = "cpu"
_BATCH = 256


@dataclass(eq=False)
class PeerLink:
    address: str  # how the peer is reached: host:port of its peer socket
    node_id: str
    epoch: int
    data_port: int
    token_for_them: bytes  # they present it on our data port
    token_for_us: bytes  # we present it on theirs
    dealer: zmq.Socket[Any] | None = None  # outgoing link
    identity: bytes | None = None  # incoming link: their DEALER on our ROUTER
    last_seen: float = 0.0
    devices: list[str] = field(default_factory=list)  # "cpu", and "cuda:N" with NCCL
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
                "direction": "out" if self.dealer is not None else "in",
                "alive": self.alive, "last_heard_s_ago": round(now - self.last_seen, 3),
                "devices": self.devices,
                "channels": {"send": self.send_channel is not None,
                             "recv": self.recv_channel is not None}}


class PeerPlane:
    def __init__(self, config: Config, ctx: zmq.Context[Any], epoch: int,
                 on_message: Callable[[PeerLink, PeerMessage], None],
                 on_link_lost: Callable[[PeerLink, KvdError], None],
                 gpus: Sequence[str] = (),
                 on_link_up: Callable[[PeerLink], None] | None = None) -> None:
        self.config = config
        self.gpus = list(gpus)  # our GPUs that NCCL channels can use, told to peers
        self.ctx = ctx
        self.epoch = epoch
        self.on_message = on_message
        self.on_link_lost = on_link_lost
        self.on_link_up = on_link_up
        self.bad_messages: dict[str, int] = {}
        self.links: dict[str, PeerLink] = {}  # by address
        self._by_identity: dict[bytes, PeerLink] = {}
        self._by_dealer: dict[zmq.Socket[Any], PeerLink] = {}
        self._by_token: dict[bytes, PeerLink] = {}
        self._pending_hello: dict[zmq.Socket[Any], asyncio.Future[PeerWelcome]] = {}
        # Tokens of our handshakes in flight: the peer may dial our data port as soon as
        # it has welcomed us, before our loop has made the link that knows the token.
        self._handshake_done: dict[bytes, asyncio.Future[None]] = {}
        self._linking: dict[str, asyncio.Task[PeerLink]] = {}
        self._warmups: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._reading = True
        self._read_queued = False  # a _read is scheduled with call_soon
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self.keys = load_keys(config)
        self._zap: ZapHandler | None = None
        self._router_monitor: zmq.Socket[Any] | None = None
        self._data_listener: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.address = ""
        self.data_port = 0
        self.configured = [a.strip() for a in config.peers.split(",") if a.strip()]

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        cfg = self.config
        if self.keys is not None:
            self._zap = ZapHandler(self.ctx, self.keys, self.bad_messages)
            self._watch(self._zap.sock)
            self._router.curve_server = True
            self._router.curve_publickey = self.keys.public
            self._router.curve_secretkey = self.keys.secret
            self._router.zap_domain = b"kvd"
        # Handshakes that fail inside ZMQ (wrong mechanism, bad key) are counted too.
        self._router_monitor = self._router.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        self._watch(self._router_monitor)
        try:
            self._router.bind(f"tcp://{cfg.peer_host}:{cfg.peer_port}")
        except zmq.ZMQError as exc:
            from kvd.errors import ConfigError

            raise ConfigError(
                f"peer_port: cannot listen on {cfg.peer_host}:{cfg.peer_port}: {exc}"
            ) from None
        port = int(self._router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self.address = f"{cfg.advertise_host or cfg.peer_host}:{port}"
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((cfg.peer_host, cfg.data_port))
        except OSError as exc:
            listener.close()
            from kvd.errors import ConfigError

            raise ConfigError(
                f"data_port: cannot listen on {cfg.peer_host}:{cfg.data_port}: {exc}"
            ) from None
        listener.listen(64)
        listener.setblocking(False)
        self._data_listener = listener
        self.data_port = listener.getsockname()[1]
        self._watch(self._router)
        self._read_soon()  # anything that came before we watched
        self._tasks = [
            self._loop.create_task(self._heartbeat_loop(), name="kvd-peer-heartbeat"),
            self._loop.create_task(self._accept_loop(), name="kvd-data-accept"),
        ]
        log.info("peer socket listening address=%s data_port=%d", self.address, self.data_port)

    async def close(self) -> None:
        self._reading = False
        tasks = [*self._tasks, *self._warmups, *self._linking.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in list(self.links.values()):
            self._lose(link, PeerUnreachable("daemon stopping"))
        await asyncio.sleep(0)
        if self._zap is not None:
            self._unwatch(self._zap.sock)
            self._zap.close()
        if self._router_monitor is not None:
            self._unwatch(self._router_monitor)
            with contextlib.suppress(zmq.ZMQError):
                self._router.disable_monitor()
            self._router_monitor.close(linger=0)
        for sock in [self._router, *self._pending_hello]:
            self._unwatch(sock)
            sock.close(linger=0)
        if self._data_listener is not None:
            self._data_listener.close()

    def _watch(self, sock: zmq.Socket[Any]) -> None:
        self._loop.add_reader(int(sock.getsockopt(zmq.FD)), self._read)

    def _unwatch(self, sock: zmq.Socket[Any]) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(int(sock.getsockopt(zmq.FD)))

    # ------------------------------------------------------------ links

    def _hello_fields(self, token: bytes) -> dict[str, Any]:
        return {"protocol_version": PROTOCOL_VERSION, "node_id": self.config.node_id,
                "epoch": self.epoch, "address": self.address, "data_port": self.data_port,
                "data_token": token, "devices": [CPU_DEVICE, *self.gpus]}

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
            from kvd.errors import BadRequest

            raise BadRequest(f"peer address must be host:port, got {address!r}")
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        if self.keys is not None:
            server_key = self.keys.by_address.get(address)
            if server_key is None:
                dealer.close(linger=0)
                raise PeerUnreachable(
                    f"no public key for peer {address}: add '<key> {address}' to "
                    f"curve_allowed_keys_file")
            dealer.curve_serverkey = server_key
            dealer.curve_publickey = self.keys.public
            dealer.curve_secretkey = self.keys.secret
        dealer.connect(f"tcp://{address}")
        token = secrets.token_bytes(32)
        welcome_fut: asyncio.Future[PeerWelcome] = self._loop.create_future()
        self._pending_hello[dealer] = welcome_fut
        done = self._handshake_done[token] = self._loop.create_future()
        self._watch(dealer)
        try:
            return await self._complete_handshake(address, dealer, token, welcome_fut,
                                                  timeout_s)
        finally:
            del self._handshake_done[token]
            if not done.done():
                done.set_result(None)

    async def _complete_handshake(self, address: str, dealer: zmq.Socket[Any], token: bytes,
                                  welcome_fut: asyncio.Future[PeerWelcome],
                                  timeout_s: float) -> PeerLink:
        try:
            async with asyncio.timeout(min(timeout_s, self.config.peer_connect_timeout_s)):
                while True:  # IMMEDIATE: sends fail until the TCP connection is up
                    try:
                        dealer.send(encode(PeerHello(**self._hello_fields(token))), zmq.NOBLOCK)
                        self._read_soon()
                        break
                    except zmq.Again:
                        await asyncio.sleep(0.01)
                welcome = await welcome_fut
        except (TimeoutError, KvdError) as exc:
            self._pending_hello.pop(dealer, None)
            self._unwatch(dealer)
            dealer.close(linger=0)
            if isinstance(exc, KvdError):
                raise
            hint = (" (with CurveZMQ: is our public key on its allow-list?)"
                    if self.keys is not None else "")
            raise PeerUnreachable(f"no answer from peer {address}{hint}") from None
        del self._pending_hello[dealer]
        link = PeerLink(address=address, node_id=welcome.node_id, epoch=welcome.epoch,
                        data_port=welcome.data_port, token_for_them=token,
                        token_for_us=welcome.data_token, dealer=dealer,
                        last_seen=self._loop.time(), devices=list(welcome.devices))
        self._add_link(link)
        self._by_dealer[dealer] = link
        log.info("peer up address=%s node=%s epoch=%d (outgoing)", address, link.node_id,
                 link.epoch)
        self._warm_up(link)
        self._link_up(link)
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
        try:
            async with asyncio.timeout(self.config.peer_connect_timeout_s):
                await self._loop.sock_connect(sock, (link.host, link.data_port))
                await self._loop.sock_sendall(sock, data_hello(link.token_for_us))
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

    def send(self, link: PeerLink, msg: Any) -> None:
        """Send a message on the link (dropped silently if the link is gone)."""
        if not link.alive:
            return
        timeline.mark(f"peer.send.{msg.__struct_config__.tag}")
        data = encode(msg)
        try:
            if link.dealer is not None:
                link.dealer.send(data, zmq.NOBLOCK)
            elif link.identity is not None:
                self._router.send_multipart([link.identity, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("peer message dropped address=%s: %s", link.address, exc)
        self._read_soon()  # a send can consume a socket's edge-triggered readiness

    def _lose(self, link: PeerLink, error: KvdError) -> None:
        if not link.alive:
            return
        link.alive = False
        log.warning("peer down address=%s node=%s epoch=%d: %s", link.address, link.node_id,
                    link.epoch, error.message)
        if self.links.get(link.address) is link:
            del self.links[link.address]
        self._by_token.pop(link.token_for_them, None)
        if link.identity is not None and self._by_identity.get(link.identity) is link:
            del self._by_identity[link.identity]
        for channel in (link.send_channel, link.recv_channel):
            if channel is not None:
                channel.abort(error)
        self.on_link_lost(link, error)
        for callback in link.on_lost:
            callback(link, error)
        if link.connecting is not None and not link.connecting.done():
            link.connecting.set_exception(error)
        # Joining the workers can take a moment: not on the loop.
        channels = [c for c in (link.send_channel, link.recv_channel) if c is not None]
        if channels:
            self._loop.run_in_executor(None, _close_channels, channels)
        if link.dealer is not None:
            self._by_dealer.pop(link.dealer, None)
            self._unwatch(link.dealer)
            link.dealer.close(linger=0)
            link.dealer = None

    # ------------------------------------------------------------ reading

    def _drain_side_sockets(self) -> None:
        if self._zap is not None:
            self._zap.handle_pending()
        while self._router_monitor is not None:
            try:
                self._router_monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.bad_messages["handshake"] = self.bad_messages.get("handshake", 0) + 1
            log.warning("peer handshake failed (wrong or missing CurveZMQ keys?)")

    def _read(self) -> None:
        """Read every socket, right in the loop's reader callback (no task to wake: one
        loop turn less per message). ZeroMQ's descriptors are edge-triggered, so read
        until empty; after ``_BATCH`` messages, let other callbacks run and come back."""
        self._read_queued = False
        if not self._reading:
            return
        self._drain_side_sockets()
        handled = 0
        for sock in [self._router, *self._by_dealer, *self._pending_hello]:
            while handled < _BATCH:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    break  # closed under us
                handled += 1
                try:
                    self._on_frames(sock, frames)
                except Exception:
                    log.exception("unhandled error in peer message handler")
        if handled:  # a handler may have made a socket, or more may have come: look again
            self._read_soon()

    def _read_soon(self) -> None:
        if not self._read_queued:
            self._read_queued = True
            self._loop.call_soon(self._read)

    def _bad(self, reason: str, identity: bytes | None, err: KvdError) -> None:
        self.bad_messages[reason] = self.bad_messages.get(reason, 0) + 1
        log.warning("bad peer message reason=%s: %s", reason, err.message)
        if identity is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._router.send_multipart(
                    [identity, encode(PeerError(code=err.code, message=err.message))],
                    zmq.NOBLOCK)

    def _on_frames(self, sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        identity = frames[0] if sock is self._router else None
        payload = frames[1] if sock is self._router and len(frames) == 2 else (
            frames[0] if sock is not self._router and len(frames) == 1 else None)
        if payload is None:
            self._bad("frames", identity, ProtocolError("expected one frame per message"))
            return
        try:
            msg = decode_peer(payload)
        except ProtocolError as err:
            self._bad("malformed", identity, err)
            return
        if sock in self._pending_hello:
            self._on_handshake_reply(sock, msg)
            return
        if isinstance(msg, PeerHello):
            assert identity is not None
            self._on_hello(identity, msg)
            return
        link = (self._by_identity.get(identity) if identity is not None
                else self._by_dealer.get(sock))
        if link is None or not link.alive:
            self._bad("no_link", identity, ProtocolError(
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
            if "peer_hello" in msg.message:  # it restarted and forgot us
                self._lose(link, PeerUnreachable(f"peer {link.address} forgot this link"))
            return
        if isinstance(msg, PeerWelcome):
            self._bad("unexpected", identity, ProtocolError("unexpected peer_welcome"))
            return
        self.on_message(link, msg)

    def _on_handshake_reply(self, dealer: zmq.Socket[Any], msg: PeerMessage) -> None:
        fut = self._pending_hello[dealer]
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

    def _on_hello(self, identity: bytes, hello: PeerHello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            self._bad("version", identity, ProtocolError(
                f"protocol version {hello.protocol_version} is not supported; this daemon "
                f"speaks version {PROTOCOL_VERSION}"))
            return
        if identity in self._by_identity:
            self._bad("duplicate_hello", identity, ProtocolError("already said peer_hello"))
            return
        token = secrets.token_bytes(32)
        link = PeerLink(address=hello.address, node_id=hello.node_id, epoch=hello.epoch,
                        data_port=hello.data_port, token_for_them=token,
                        token_for_us=hello.data_token, identity=identity,
                        last_seen=self._loop.time(), devices=list(hello.devices))
        self._add_link(link)
        self._by_identity[identity] = link
        log.info("peer up address=%s node=%s epoch=%d (incoming)", link.address,
                 link.node_id, link.epoch)
        with contextlib.suppress(zmq.ZMQError):
            self._router.send_multipart(
                [identity, encode(PeerWelcome(**self._hello_fields(token)))], zmq.NOBLOCK)
        self._warm_up(link)

    # ------------------------------------------------------------ data connections

    async def _accept_loop(self) -> None:
        assert self._data_listener is not None
        while True:
            conn, addr = await self._loop.sock_accept(self._data_listener)
            self._loop.create_task(self._admit_data(conn, addr))

    async def _admit_data(self, conn: socket.socket, addr: Any) -> None:
        conn.setblocking(False)
        try:
            async with asyncio.timeout(self.config.peer_connect_timeout_s):
                buf = b""
                while len(buf) < 36:
                    chunk = await self._loop.sock_recv(conn, 36 - len(buf))
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
            reason = "data_token" if isinstance(exc, ProtocolError) else "data_connect"
            self.bad_messages[reason] = self.bad_messages.get(reason, 0) + 1
            log.warning("data connection refused from=%s: %r", addr, exc)
            conn.close()

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


def _close_channels(channels: list[Any]) -> None:
    for channel in channels:
        channel.close(5.0)
