"""The peer plane: links to other daemons, their handshake, heartbeats and death.

Each daemon binds a ZeroMQ ROUTER on ``tcp://peer_host:peer_port`` for control messages
and listens on ``data_port`` (TCP) for bytes. To talk to a peer it connects a DEALER of
its own (one per link: a new handshake gets a new DEALER, which never reconnects) and
says ``PeerHello`` (version, node id, epoch, its address, its data port, a fresh *data
token*, and the fingerprint of its data port's certificate when data is encrypted); the
peer answers ``PeerWelcome`` with the same fields through its ROUTER, to the routing id
the hello came from. The link then carries one msgspec message per ZeroMQ message both
ways, in order (the NCCL channels rely on that order): ours on the DEALER, theirs on
their ROUTER. Each side opens its own data connection to the other's data port for the
bytes it sends, presenting the token it was given, so the data port only ever accepts
peers that passed the handshake. Every ZeroMQ socket is read on the loop through
``kvd.loop_socket.LoopSocket``.

Security (``daemon/auth.py``): with ``curve_secret_key_file`` the ROUTER is a CurveZMQ
server whose ZAP handler admits only the public keys on ``curve_allowed_keys_file``, and a
peer's hello is taken only for the address the list gives its key; our DEALERs dial with
the peer's key from the same list. With ``encrypt_data`` the data connections are TLS,
pinned by the fingerprint exchanged over the CURVE-secured handshake. Without keys the
plane is open.

A link ends at once when its connection does: the socket monitors say so (a DEALER's
``EVENT_DISCONNECTED`` is its link's; on the ROUTER the event names the connection's
descriptor, which the hello's frame carried). A link silent for longer than
``peer_grace_s`` ends too (a hung peer; heartbeats go both ways every
``heartbeat_interval_s``, and any message counts as a sign of life), and so does a link to
which ZeroMQ refuses a message (the peer stopped reading: ``_SEND_HWM`` messages wait for
it). Its transfers then fail with ``PeerUnreachable`` (through ``on_link_lost``) and its
channels are aborted. A ``PeerHello`` claiming the address of a link that answers (heard
within the grace) is refused: without CurveZMQ anyone could claim it. A peer that
restarted closed its old connection when it died (or falls silent past the grace); its
hello is taken then, and the old link dies the same way.

What a peer can make the daemon hold: ``MAX_LINKS`` links (a hello past it is refused);
per connection, ``_RECV_HWM`` messages of at most ``MAX_PEER_MESSAGE_BYTES`` read ahead by
ZeroMQ (a larger message ends the connection); a connection that does not finish ZeroMQ's
handshake within ``peer_connect_timeout_s`` is closed by ZeroMQ. On the data port,
connections that have not presented a token are bounded (``MAX_UNLINKED_CONNECTIONS``),
and its accept loop outlives a shortage of descriptors (``daemon/accepting.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq

from kvd import timeline
from kvd.config import Config
from kvd.daemon.accepting import Acceptor, Throttled
from kvd.daemon.auth import (
    ZAP_DOMAIN,
    ZAP_ENDPOINT,
    CurveKeys,
    DataTls,
    fingerprint_of,
    load_keys,
    make_data_tls,
    zap_answer,
)
from kvd.errors import (
    BadRequest,
    ConfigError,
    KvdError,
    PeerUnreachable,
    ProtocolError,
    error_from_code,
)
from kvd.loop_socket import LoopSocket
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
MAX_PEER_MESSAGE_BYTES = 1 << 20  # ZMQ_MAXMSGSIZE: a larger message ends its connection
# Control messages queued for one peer (its ZeroMQ pipe) that it has not taken: past this
# the peer counts as not reading and its link ends (they are ~100 bytes each: a few MiB).
_SEND_HWM = 32768
# Messages ZeroMQ reads ahead from one connection before it stops reading it (TCP pushes
# back to the sender; nothing is lost). With MAX_PEER_MESSAGE_BYTES, what one connection
# can make the daemon hold: a flood of garbage is bounded by it.
_RECV_HWM = 64
# Connections accepted on the data port that have not presented their token yet: past
# this a new one is closed at once. A flood of silent connections cannot take every
# descriptor the daemon has (each one lasts peer_connect_timeout_s at most).
MAX_UNLINKED_CONNECTIONS = 64
# Links at once, those we made and those peers made together: past it a peer's hello is
# refused (ours to a peer are not: a client asked for them). A link holds a thread (its
# data connection's receiver) and its state while it lives, and without CurveZMQ anyone
# who reaches the peer port can make one and keep it. A node links to the daemons it
# exchanges KV with: a few, or tens in a large disaggregated deployment, far below this.
MAX_LINKS = 256

_MONITOR_EVENT = struct.Struct("=HI")  # a monitor message's first frame: event, value
_monitor_ids = itertools.count()


class _Monitor:
    """The connection events of one ZeroMQ socket (its monitor), read on the loop:
    ``on_event(event, value)`` for each."""

    def __init__(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any], events: int,
                 on_event: Callable[[int, int], None], what: str) -> None:
        self._watched = sock
        self._on_event = on_event
        # A name of our own: pyzmq's default (the socket's descriptor) is reused by the
        # next socket while the old monitor's endpoint may still be bound.
        address = f"inproc://kvd-monitor-{next(_monitor_ids)}"
        sock.monitor(address, events)
        pair = ctx.socket(zmq.PAIR)
        pair.connect(address)  # (before the watched socket connects: no event is missed)
        self.reader = LoopSocket(pair, self._on_message, what=what)
        self.reader.start()

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) == 2 and len(frames[0]) == _MONITOR_EVENT.size:
            event, value = _MONITOR_EVENT.unpack(frames[0])
            self._on_event(event, value)

    def drain(self) -> None:
        """Handle every event that has come (before a hello: see PeerPlane._on_hello)."""
        sock = self.reader.sock
        while not self.reader.closed:
            try:
                if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return
                self._on_message(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError:
                return

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._watched.disable_monitor()
        self.reader.close()


class _Dial:
    """Our DEALER to one peer, from its handshake to its link's end."""

    def __init__(self, plane: PeerPlane, address: str) -> None:
        self.plane = plane
        self.address = address
        sock = plane.ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection: a new link, a new DEALER
            sock.setsockopt(zmq.HANDSHAKE_IVL, plane.handshake_ms)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_PEER_MESSAGE_BYTES)
            sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
            sock.setsockopt(zmq.RCVHWM, _RECV_HWM)
            keys = plane.keys
            if keys is not None:
                server_key = keys.by_address.get(address)
                if server_key is None:
                    raise PeerUnreachable(
                        f"no public key for peer {address}: add '<its key> {address}' to "
                        f"curve_allowed_keys_file")
                sock.curve_serverkey = server_key
                sock.curve_publickey = keys.public
                sock.curve_secretkey = keys.secret
            self.monitor = _Monitor(
                plane.ctx, sock, zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, self._on_event,
                f"peer {address} monitor")
        except BaseException:
            sock.close(linger=0)
            raise
        self.sock = LoopSocket(sock, self._on_message, what=f"peer {address}")
        self.welcome: asyncio.Future[PeerWelcome] = plane._loop.create_future()
        self.link: PeerLink | None = None
        self.early: list[bytes] = []  # messages behind the welcome, until the link is made
        self.sock.start()
        sock.connect(f"tcp://{address}")

    def _on_message(self, frames: list[bytes]) -> None:
        self.plane._on_dial_message(self, frames)

    def _on_event(self, event: int, value: int) -> None:
        self.plane._on_dial_event(self, event, value)

    def close(self, linger_s: float = 0.0) -> None:
        self.monitor.close()
        self.sock.close(linger_s)


@dataclass(eq=False)
class PeerLink:
    address: str  # how the peer is reached: host:port of its peer socket
    node_id: str
    epoch: int
    data_port: int
    token_for_them: bytes  # they present it on our data port
    token_for_us: bytes  # we present it on theirs
    dial: _Dial | None = None  # an outgoing link: our DEALER
    routing_id: bytes = b""  # an incoming link: their connection on our ROUTER
    fd: int = -1  # an incoming link: that connection's descriptor (its monitor events)
    data_fingerprint: bytes = b""  # their data port's certificate (b"": plain TCP)
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
    def outgoing(self) -> bool:
        return self.dial is not None

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    def describe(self, now: float) -> dict[str, Any]:
        return {"address": self.address, "node_id": self.node_id, "epoch": self.epoch,
                "direction": "out" if self.outgoing else "in",
                "alive": self.alive, "last_heard_s_ago": round(now - self.last_seen, 3),
                "devices": self.devices, "nccl_blocking_calls": self.nccl_blocking_calls,
                "data_encrypted": bool(self.data_fingerprint),
                "channels": {"send": self.send_channel is not None,
                             "recv": self.recv_channel is not None}}


class PeerPlane:
    def __init__(self, config: Config, ctx: zmq.Context[Any], epoch: int,
                 on_message: Callable[[PeerLink, PeerMessage], None],
                 on_link_lost: Callable[[PeerLink, KvdError], None],
                 gpus: Sequence[str] = (),
                 on_link_up: Callable[[PeerLink], None] | None = None,
                 nccl_blocking_calls: bool = False) -> None:
        self.config = config
        self.ctx = ctx
        self.gpus = list(gpus)  # our GPUs that NCCL channels can use, told to peers
        # Told to peers too: our channels can split for blocking calls (config and NCCL).
        self.nccl_blocking_calls = nccl_blocking_calls
        self.epoch = epoch
        self.on_message = on_message
        self.on_link_lost = on_link_lost
        self.on_link_up = on_link_up
        self.bad_messages: dict[str, int] = {}
        self._bad_logs: dict[str, Throttled] = {}  # per reason (see _bad)
        self.links: dict[str, PeerLink] = {}  # by address
        self._by_routing_id: dict[bytes, PeerLink] = {}  # incoming links
        self._by_fd: dict[int, PeerLink] = {}  # incoming links, by their connection
        self._by_token: dict[bytes, PeerLink] = {}
        self._dials: set[_Dial] = set()  # DEALERs open (handshaking or linked)
        # Tokens of our handshakes in flight: the peer may dial our data port as soon as
        # it has welcomed us, before our loop has made the link that knows the token.
        self._handshake_done: dict[bytes, asyncio.Future[None]] = {}
        self._linking: dict[str, asyncio.Task[PeerLink]] = {}
        self._warmups: set[asyncio.Task[None]] = set()
        self._admitting: set[asyncio.Task[None]] = set()
        self._unlinked: set[socket.socket] = set()  # data connections before their token
        self._refusing = Throttled(log)
        self._loop = asyncio.get_running_loop()
        self.keys: CurveKeys | None = load_keys(config)
        self._data_tls: DataTls | None = (
            make_data_tls() if self.keys is not None and config.encrypt_data else None)
        self.handshake_ms = max(1, int(config.peer_connect_timeout_s * 1000))
        self._router: LoopSocket | None = None
        self._router_monitor: _Monitor | None = None
        self._zap: LoopSocket | None = None
        self._data_listener: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._acceptor: Acceptor | None = None
        self.address = ""
        self.data_port = 0
        self.configured = [a.strip() for a in config.peers.split(",") if a.strip()]

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        cfg = self.config
        router = self.ctx.socket(zmq.ROUTER)
        try:
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown routing id: an error
            router.setsockopt(zmq.MAXMSGSIZE, MAX_PEER_MESSAGE_BYTES)
            router.setsockopt(zmq.HANDSHAKE_IVL, self.handshake_ms)
            router.setsockopt(zmq.SNDHWM, _SEND_HWM)
            router.setsockopt(zmq.RCVHWM, _RECV_HWM)
            if self.keys is not None:
                zap = self.ctx.socket(zmq.REP)
                zap.bind(ZAP_ENDPOINT)
                self._zap = LoopSocket(zap, self._on_zap_request, what="ZAP handler")
                self._zap.start()
                router.curve_server = True
                router.curve_publickey = self.keys.public
                router.curve_secretkey = self.keys.secret
                router.zap_domain = ZAP_DOMAIN
            # Handshakes that fail inside ZeroMQ (no CURVE, a wrong key, garbage, silence
            # past HANDSHAKE_IVL) are counted; ZAP's refusals are counted by the handler.
            self._router_monitor = _Monitor(
                self.ctx, router, zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, self._on_router_event, "peer monitor")
            try:
                router.bind(f"tcp://{cfg.peer_host}:{cfg.peer_port}")
            except zmq.ZMQError as exc:
                raise ConfigError(f"peer_port: cannot listen on {cfg.peer_host}:"
                                  f"{cfg.peer_port}: {exc}") from None
        except BaseException:
            self._close_router_side()
            router.close(linger=0)
            raise
        endpoint = router.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        port = int(endpoint.decode().rsplit(":", 1)[1])
        self.address = f"{cfg.advertise_host or cfg.peer_host}:{port}"
        self._router = LoopSocket(router, self._on_router_message, what="peer socket",
                                  copy=False)
        self._router.start()
        self._data_listener = _listen(cfg.peer_host, cfg.data_port, "data_port")
        self.data_port = self._data_listener.getsockname()[1]
        self._acceptor = Acceptor(self._data_listener, "data_port", self._take_data)
        self._tasks = [
            self._loop.create_task(self._heartbeat_loop(), name="kvd-peer-heartbeat")]
        log.info("peer socket listening address=%s data_port=%d curve=%s encrypt_data=%s",
                 self.address, self.data_port, "on" if self.keys else "off",
                 "on" if self._data_tls else "off")

    def _close_router_side(self) -> None:
        if self._router_monitor is not None:
            self._router_monitor.close()
            self._router_monitor = None
        if self._zap is not None:
            self._zap.close()
            self._zap = None

    async def close(self) -> None:
        if self._acceptor is not None:
            self._acceptor.close()
        tasks = [*self._tasks, *self._warmups, *self._linking.values(), *self._admitting]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *([self._acceptor.wait_closed()] if self._acceptor else []),
                             return_exceptions=True)
        for link in list(self.links.values()):
            self._lose(link, PeerUnreachable("daemon stopping"))
        await asyncio.sleep(0)
        # What is queued (a CHANNEL_DOWN, a last PeerError) may still go out for a moment,
        # in ZeroMQ's I/O thread, while the context ends.
        for dial in list(self._dials):
            dial.close(linger_s=1.0)
        self._dials.clear()
        self._close_router_side()
        if self._router is not None:
            self._router.close(linger_s=1.0)
        for sock in list(self._unlinked):
            sock.close()

    # ------------------------------------------------------------ links

    def _hello_fields(self, token: bytes) -> dict[str, Any]:
        return {"protocol_version": PROTOCOL_VERSION, "node_id": self.config.node_id,
                "epoch": self.epoch, "address": self.address, "data_port": self.data_port,
                "data_token": token, "devices": [CPU_DEVICE, *self.gpus],
                "nccl_blocking_calls": self.nccl_blocking_calls,
                "data_fingerprint": self._data_tls.fingerprint if self._data_tls else b""}

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
        dial: _Dial | None = None
        try:
            try:
                dial = _Dial(self, address)
            except zmq.ZMQError as exc:  # (out of sockets or descriptors)
                raise PeerUnreachable(f"cannot open a socket to peer {address}: {exc}") from None
            self._dials.add(dial)
            async with asyncio.timeout(min(timeout_s, self.config.peer_connect_timeout_s)):
                if not dial.sock.send([encode(PeerHello(**self._hello_fields(token)))]):
                    raise PeerUnreachable(f"peer {address} took no hello")
                welcome = await dial.welcome
            self._check_data_encryption(welcome.data_fingerprint, address)
        except (TimeoutError, KvdError) as exc:
            if dial is not None:
                self._dials.discard(dial)
                dial.close()
            if isinstance(exc, KvdError) and not isinstance(exc, PeerUnreachable):
                raise
            hint = (" (with CurveZMQ: is our public key in its curve_allowed_keys_file?)"
                    if self.keys is not None and isinstance(exc, TimeoutError) else "")
            detail = "" if isinstance(exc, TimeoutError) else f": {exc.message}"
            raise PeerUnreachable(f"no answer from peer {address}{hint}{detail}") from None
        except BaseException:
            if dial is not None:
                self._dials.discard(dial)
                dial.close()
            raise
        finally:
            del self._handshake_done[token]
            if not done.done():
                done.set_result(None)
        link = PeerLink(address=address, node_id=welcome.node_id, epoch=welcome.epoch,
                        data_port=welcome.data_port, token_for_them=token,
                        token_for_us=welcome.data_token, dial=dial,
                        data_fingerprint=welcome.data_fingerprint,
                        last_seen=self._loop.time(), devices=list(welcome.devices),
                        nccl_blocking_calls=welcome.nccl_blocking_calls)
        dial.link = link
        self._add_link(link)
        log.info("peer up address=%s node=%s epoch=%d (outgoing)", address, link.node_id,
                 link.epoch)
        self._warm_up(link)
        self._link_up(link)
        early, dial.early = dial.early, []
        for payload in early:  # what came right behind the welcome, before the link was made
            self._on_link_payload(link, payload, None)
        return link

    def _check_data_encryption(self, their_fingerprint: bytes, address: str) -> None:
        """Both ends encrypt data connections, or neither: otherwise our bytes would go
        in the clear to a peer that does not, against this operator's choice."""
        ours = self._data_tls is not None
        if ours != bool(their_fingerprint):
            raise PeerUnreachable(
                f"peer {address} {'does not encrypt' if ours else 'encrypts'} its data "
                f"connections and this daemon {'does' if ours else 'does not'}: set "
                f"encrypt_data (and CurveZMQ) the same on both")

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
        tls = self._data_tls if link.data_fingerprint else None
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
        channel = SendChannel(f"kvd-send-{link.node_id}-{CPU_DEVICE}",
                              self.config.tcp_chunk_bytes, self._io_timeout(),
                              self._on_broken(link))
        channel.attach(sock)
        link.send_channel = channel
        connecting.set_result(channel)

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
        """Send a message on the link (dropped if the link is gone). A message ZeroMQ
        will not take ends the link: the peer stopped reading, or its connection is gone."""
        if not link.alive:
            return
        timeline.mark(f"peer.send.{msg.__struct_config__.tag}")
        if not self._send_on(link, encode(msg)):
            self._lose(link, PeerUnreachable(
                f"peer {link.address} stopped reading ({_SEND_HWM} messages unsent) or its "
                f"connection is gone"))

    def _send_on(self, link: PeerLink, data: bytes) -> bool:
        if link.dial is not None:
            return link.dial.sock.send([data])
        return self._router is not None and self._router.send([link.routing_id, data])

    def _lose(self, link: PeerLink, error: KvdError) -> None:
        if not link.alive:
            return
        link.alive = False
        log.warning("peer down address=%s node=%s epoch=%d: %s", link.address, link.node_id,
                    link.epoch, error.message)
        if self.links.get(link.address) is link:
            del self.links[link.address]
        self._by_token.pop(link.token_for_them, None)
        if link.routing_id and self._by_routing_id.get(link.routing_id) is link:
            del self._by_routing_id[link.routing_id]
        if self._by_fd.get(link.fd) is link:
            del self._by_fd[link.fd]
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
        if link.dial is not None:
            self._dials.discard(link.dial)
            link.dial.close()

    # ------------------------------------------------------------ reading

    def _bad(self, reason: str, reply: Callable[[bytes], object] | None, err: KvdError,
             source: str) -> None:
        """Count a bad message (or connection), log it (at most once per reason every few
        seconds: a peer sending nothing else cannot flood the log), and answer it with a
        PeerError where there is a way back."""
        self.bad_messages[reason] = self.bad_messages.get(reason, 0) + 1
        self._bad_logs.setdefault(reason, Throttled(log)).warning(
            "bad peer message reason=%s from=%s: %s", reason, source, err.message)
        if reply is not None:
            reply(encode(PeerError(code=err.code, message=err.message)))

    def _reply_to(self, routing_id: bytes) -> Callable[[bytes], object]:
        router = self._router

        def reply(data: bytes) -> object:
            return router is not None and router.send([routing_id, data])
        return reply

    def _on_router_message(self, frames: Sequence[bytes | zmq.Frame]) -> None:
        """A message on our ROUTER: [routing id, payload] from a peer's DEALER."""
        routing_id = _bytes(frames[0])
        reply = self._reply_to(routing_id)
        source = f"routing id {routing_id.hex()}"
        if len(frames) != 2:
            self._bad("frames", reply, ProtocolError(
                f"expected one frame per message, got {len(frames) - 1}"), source)
            return
        frame = frames[1]
        payload = frame.buffer if isinstance(frame, zmq.Frame) else frame
        if not len(payload):
            self._bad("empty", reply, ProtocolError("empty message"), source)
            return
        try:
            msg = decode_peer(payload)
        except ProtocolError as err:
            self._bad("malformed", reply, err, source)
            return
        if isinstance(msg, PeerHello):
            self._on_hello(routing_id, frame, msg)
            return
        link = self._by_routing_id.get(routing_id)
        if link is None or not link.alive:
            self._bad("no_link", reply, ProtocolError(
                "unknown peer: send peer_hello first (this daemon may have restarted)"),
                source)
            return
        self._on_link_message(link, msg, reply)

    def _on_dial_message(self, dial: _Dial, frames: list[bytes]) -> None:
        """A message on one of our DEALERs: the peer's answer to our hello, then the
        link's messages."""
        if len(frames) != 1 or not frames[0]:
            self._bad("frames", None, ProtocolError(
                f"expected one non-empty frame per message, got {len(frames)}"),
                dial.address)
            return
        if dial.link is not None:
            self._on_link_payload(dial.link, frames[0], None)
        elif dial.welcome.done():  # the link is being made: keep the message for it
            dial.early.append(frames[0])
        else:
            try:
                msg = decode_peer(frames[0])
            except ProtocolError as err:
                self._bad("malformed", None, err, dial.address)
                return
            self._on_handshake_reply(dial, msg)

    def _on_link_payload(self, link: PeerLink, payload: bytes,
                         reply: Callable[[bytes], object] | None) -> None:
        try:
            msg = decode_peer(payload)
        except ProtocolError as err:
            self._bad("malformed", reply, err, link.address)
            return
        if isinstance(msg, PeerHello):
            self._bad("unexpected", reply, ProtocolError("peer_hello on a link we opened"),
                      link.address)
            return
        self._on_link_message(link, msg, reply)

    def _on_link_message(self, link: PeerLink, msg: PeerMessage,
                         reply: Callable[[bytes], object] | None) -> None:
        if not link.alive:
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
            self._bad("unexpected", reply or self._link_reply(link),
                      ProtocolError("unexpected peer_welcome"), link.address)
            return
        self.on_message(link, msg)

    def _link_reply(self, link: PeerLink) -> Callable[[bytes], object]:
        return functools.partial(self._send_on, link)

    def _on_handshake_reply(self, dial: _Dial, msg: PeerMessage) -> None:
        fut = dial.welcome
        if fut.done():
            return
        if isinstance(msg, PeerWelcome):
            if msg.protocol_version != PROTOCOL_VERSION:
                fut.set_exception(ProtocolError(
                    f"peer speaks protocol {msg.protocol_version}, we speak {PROTOCOL_VERSION}"))
            else:
                fut.set_result(msg)
        elif isinstance(msg, PeerError):
            fut.set_exception(error_from_code(msg.code, f"peer refused: {msg.message}"))

    def _on_dial_event(self, dial: _Dial, event: int, value: int) -> None:
        """Our DEALER's connection failed or ended: its handshake fails, or its link ends."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (f"it refused our public key (status {value}): is it in the peer's "
                   f"curve_allowed_keys_file?")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = ("the ZeroMQ handshake failed (a CurveZMQ key that does not match, or one "
                   "side without CurveZMQ)")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            why = "the ZeroMQ handshake failed"
        elif event == zmq.EVENT_CLOSED:
            why = "connection refused or closed"
        else:
            why = "connection closed"
        if not dial.welcome.done():
            dial.welcome.set_exception(PeerUnreachable(f"peer {dial.address}: {why}"))
        elif dial.link is not None and dial.link.alive:
            self._lose(dial.link, PeerUnreachable(f"connection to peer {dial.address}: {why}"))

    def _on_router_event(self, event: int, value: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            link = self._by_fd.get(value)
            if link is not None:
                self._lose(link, PeerUnreachable(f"connection from peer {link.address} closed"))
            return
        # A connection that did not finish ZeroMQ's handshake: no CURVE, a wrong key,
        # garbage, silence past HANDSHAKE_IVL (ZAP's refusals are counted by the handler).
        self._bad("handshake", None, ProtocolError(
            f"ZeroMQ handshake failed ({_event_name(event)}, {value})"), "peer port")

    def _on_zap_request(self, frames: list[bytes]) -> None:
        assert self.keys is not None and self._zap is not None

        def refused(peer: str, why: str) -> None:
            self._bad("auth", None, ProtocolError(f"refused at the handshake: {why}"), peer)

        self._zap.send(zap_answer(frames, self.keys, refused))

    def _answers(self, link: PeerLink) -> bool:
        """The link is up (its connection not known closed) and was heard within its
        grace."""
        return link.alive and self._loop.time() - link.last_seen <= self.config.peer_grace_s

    def _on_hello(self, routing_id: bytes, frame: bytes | zmq.Frame, hello: PeerHello) -> None:
        reply = self._reply_to(routing_id)
        source = f"{hello.address} (node {hello.node_id})"
        if hello.protocol_version != PROTOCOL_VERSION:
            self._bad("version", reply, ProtocolError(
                f"protocol version {hello.protocol_version} is not supported; this daemon "
                f"speaks version {PROTOCOL_VERSION}"), source)
            return
        if routing_id in self._by_routing_id:
            self._bad("duplicate_hello", reply, ProtocolError("already said peer_hello"),
                      source)
            return
        fd = _property(frame, "__fd")
        if self.keys is not None:
            key = _property(frame, "User-Id")
            allowed = self.keys.address_of.get(key.encode()) if isinstance(key, str) else None
            if allowed != hello.address:
                self._bad("auth", reply, PeerUnreachable(
                    f"the key this peer connected with is listed for {allowed or 'no address'}"
                    f" in curve_allowed_keys_file, not {hello.address}"), source)
                return
        try:
            self._check_data_encryption(hello.data_fingerprint, hello.address)
        except PeerUnreachable as err:
            self._bad("data_encryption", reply, err, source)
            return
        # Events that came before this hello first: the connection that had this
        # descriptor before may have closed, and its event must not end the new link.
        if self._router_monitor is not None:
            self._router_monitor.drain()
        old = self.links.get(hello.address)
        if old is not None and self._answers(old):
            # Without CurveZMQ anyone can claim an address: the link that holds it keeps
            # it while it answers. A peer that restarted closed its old connection when it
            # died (or falls silent past the grace), and its new hello is taken then.
            self._bad("takeover", reply, PeerUnreachable(
                f"{hello.address} is linked already (node {old.node_id}, epoch {old.epoch}) "
                f"and that link answers: refused until its connection closes or it is silent "
                f"for {self.config.peer_grace_s:g}s"), source)
            return
        if old is None and len(self.links) >= MAX_LINKS:  # (one in old's place adds none)
            self._bad("link_limit", reply, PeerUnreachable(
                f"{self.config.node_id} has {len(self.links)} links already (the most): "
                f"hello from {hello.address} (node {hello.node_id}) refused"), source)
            return
        token = secrets.token_bytes(32)
        link = PeerLink(address=hello.address, node_id=hello.node_id, epoch=hello.epoch,
                        data_port=hello.data_port, token_for_them=token,
                        token_for_us=hello.data_token, routing_id=routing_id,
                        fd=fd if isinstance(fd, int) else -1,
                        data_fingerprint=hello.data_fingerprint,
                        last_seen=self._loop.time(), devices=list(hello.devices),
                        nccl_blocking_calls=hello.nccl_blocking_calls)
        self._add_link(link)
        self._by_routing_id[routing_id] = link
        if link.fd >= 0:
            self._by_fd[link.fd] = link
        log.info("peer up address=%s node=%s epoch=%d (incoming)", link.address,
                 link.node_id, link.epoch)
        if not reply(encode(PeerWelcome(**self._hello_fields(token)))):
            self._lose(link, PeerUnreachable(f"peer {link.address} took no welcome"))
            return
        self._warm_up(link)

    # ------------------------------------------------------------ data connections

    def _room_for(self, sock: socket.socket, addr: Any, port: str) -> bool:
        """Whether one more connection may wait for its token (MAX_UNLINKED_CONNECTIONS);
        if not, it is closed now, counted and logged."""
        if len(self._unlinked) < MAX_UNLINKED_CONNECTIONS:
            return True
        sock.close()
        self.bad_messages["unlinked_limit"] = self.bad_messages.get("unlinked_limit", 0) + 1
        self._refusing.warning(
            "%s: connection from=%s closed: %d connections are waiting to link already "
            "(the most); a flood of connections that do not link, or peers that do not "
            "finish their handshake", port, _host_port(addr), len(self._unlinked))
        return False

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
        tls = self._data_tls
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
            if isinstance(exc, ssl.SSLError):
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


def _bytes(frame: bytes | zmq.Frame) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else frame


def _property(frame: bytes | zmq.Frame, name: str) -> int | str | None:
    """A property of the connection a message came on (None if ZeroMQ has none)."""
    if not isinstance(frame, zmq.Frame):
        return None
    try:
        value = frame.get(name)
    except zmq.ZMQError:
        return None
    return int(value) if name == "__fd" else value


def _event_name(event: int) -> str:
    try:
        return zmq.Event(event).name or str(event)
    except ValueError:
        return str(event)


def _close_channels(channels: list[Any]) -> None:
    for channel in channels:
        channel.close(5.0)
