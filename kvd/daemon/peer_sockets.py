"""The peer plane's ZeroMQ plumbing: the limits of its sockets, their monitors, the
ROUTER peers dial (``PeerRouter``), our DEALER to each peer (``Dial``), and the count of
bad input from peers (``BadInput``).

What a peer can make the daemon hold on these sockets: per connection, ``RECV_HWM``
messages of at most ``MAX_PEER_MESSAGE_BYTES`` (256 KiB, from the largest offer) read
ahead by ZeroMQ, 16 MiB (a larger message ends the connection at its header); a
connection to the ROUTER that does not finish ZeroMQ's handshake within ``HANDSHAKE_S``
is closed by ZeroMQ; and at most ``MAX_PENDING_HANDSHAKES`` connections to the ROUTER
whose handshake is not done (ZeroMQ's, then a hello that makes a link) are kept: past it
the oldest is shut down. With ``curve_secret_key_file`` the ROUTER is a CurveZMQ server
whose ZAP handler (``daemon/auth.py``) admits only the public keys on
``curve_allowed_keys_file``, and each ``Dial`` dials with its peer's key from that list.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvd.daemon.accepting import Throttled
from kvd.daemon.auth import ZAP_DOMAIN, ZAP_ENDPOINT, CurveKeys, zap_answer
from kvd.errors import ConfigError, KvdError, PeerUnreachable, ProtocolError, error_from_code
from kvd.loop_socket import LoopSocket, monitor_event
from kvd.protocol import (
    MAX_PEER_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    PeerError,
    PeerMessage,
    PeerWelcome,
    decode_peer,
    encode,
)

log = logging.getLogger(__name__)

# Control messages queued for one peer (its ZeroMQ pipe) that it has not taken: past this
# the peer counts as not reading and its link ends (they are ~100 bytes each: a few MiB).
SEND_HWM = 32768
# Messages ZeroMQ reads ahead from one connection before it stops reading it (TCP pushes
# back to the sender; nothing is lost). With MAX_PEER_MESSAGE_BYTES, what one connection
# can make the daemon hold: a flood of garbage is bounded by it.
RECV_HWM = 64
# ZeroMQ's handshake on our ROUTER (HANDSHAKE_IVL): a connection that has not finished it
# by then is closed. A peer's takes milliseconds (the greeting, CurveZMQ's four commands,
# ZAP answered on our loop): 2 s leaves room for a few lost packets (TCP's retransmission
# timeout is 200 ms at least, doubling) and a busy loop, and is what one silent connection
# holds a descriptor for. Not peer_connect_timeout_s: that bounds a dial of ours (the
# connection and both handshakes), which an operator may make long.
HANDSHAKE_S = 2.0
# Connections to our ROUTER whose handshake is not done (ZeroMQ's, then a hello that made a
# link): past this the oldest is shut down, so that a flood of connections that never
# speak, or speak and never link, cannot take the daemon's descriptors (a silent one
# also ends after HANDSHAKE_S). A real peer says its hello at once: one is shut down only
# if this many connections came after it before its hello was read.
MAX_PENDING_HANDSHAKES = 256

_monitor_ids = itertools.count()

# A way to answer whoever sent a message: True if ZeroMQ took the answer.
Reply = Callable[[bytes], object]


class BadInput:
    """Bad input from peers (messages, connections, handshakes), counted by reason: the
    counts are the plane's ``bad_messages``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._logs: dict[str, Throttled] = {}  # per reason

    def count(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def note(self, reason: str, what: str) -> None:
        """Count a bad message and log ``what`` of it, at most once per reason every few
        seconds: a peer sending nothing else cannot flood the log."""
        self.count(reason)
        self._logs.setdefault(reason, Throttled(log)).warning(
            "bad peer message reason=%s %s", reason, what)

    def report(self, reason: str, reply: Reply | None, err: KvdError, source: str) -> None:
        """Count a bad message (or connection), log it (``note``), and answer it with a
        PeerError where there is a way back."""
        self.note(reason, f"from={source}: {err.message}")
        if reply is not None:
            reply(encode(PeerError(code=err.code, message=err.message)))


class Monitor:
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
        event = monitor_event(frames)
        if event is not None:
            self._on_event(*event)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._watched.disable_monitor()
        self.reader.close()


def set_limits(sock: zmq.Socket[Any], handshake_ms: int, heartbeat_ms: int, grace_ms: int
               ) -> None:
    """The options every peer socket has: no lingering, the bounds above, ZeroMQ's
    handshake bounded in time, and TCP keepalives: the kernel probes a quiet connection
    after ``grace_ms``, every ``heartbeat_ms``, and closes it after two unanswered (a peer
    whose host vanished; its link ends: the monitors say so). An idle link costs no CPU
    of ours then. (ZeroMQ's own heartbeats cost more than kvd's: libzmq cancels a timer
    by scanning every timer of its I/O thread, on each message of each connection; at
    200 links its I/O thread took 3.5 % of a core.)"""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, max(1, grace_ms // 1000))
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, max(1, heartbeat_ms // 1000))
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 2)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, handshake_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PEER_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)


class PeerRouter:
    """Our ROUTER on ``tcp://host:port``, which peers' DEALERs dial: each message read off
    it is checked (one non-empty frame that decodes) and goes to ``on_message(routing id,
    frame, message, reply)``; a connection that closes goes to ``on_disconnected(its
    descriptor)``; the owner says which connection made a link (``linked``). Connections
    whose handshake is not done are bounded (``MAX_PENDING_HANDSHAKES``). Bad input is
    counted in ``bad``."""

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys | None, bad: BadInput,
                 on_message: Callable[[bytes, bytes | zmq.Frame, PeerMessage, Reply], None],
                 on_disconnected: Callable[[int], None],
                 host: str, port: int, heartbeat_ms: int, grace_ms: int) -> None:
        self._keys = keys
        self._bad = bad
        self._on_message = on_message
        self._on_disconnected = on_disconnected
        self._monitor: Monitor | None = None
        self._zap: LoopSocket | None = None
        # Descriptors of the connections whose handshake is not done, oldest first (told
        # by the monitor: EVENT_ACCEPTED, EVENT_DISCONNECTED; by the owner: ``linked``).
        self._pending: dict[int, None] = {}
        self.port = 0
        router = ctx.socket(zmq.ROUTER)
        try:
            set_limits(router, int(HANDSHAKE_S * 1000), heartbeat_ms, grace_ms)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown routing id: an error
            if keys is not None:
                zap = ctx.socket(zmq.REP)
                zap.bind(ZAP_ENDPOINT)
                self._zap = LoopSocket(zap, self._on_zap_request, what="ZAP handler")
                self._zap.start()
                router.curve_server = True
                router.curve_publickey = keys.public
                router.curve_secretkey = keys.secret
                router.zap_domain = ZAP_DOMAIN
            # Handshakes that fail inside ZeroMQ (no CURVE, a wrong key, garbage, silence
            # past HANDSHAKE_IVL) are counted; ZAP's refusals are counted by the handler.
            # (EVENT_HANDSHAKE_SUCCEEDED does not name its connection: its value is 0.)
            self._monitor = Monitor(
                ctx, router, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                self._on_event, "peer monitor")
            try:
                router.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as exc:
                raise ConfigError(f"peer_port: cannot listen on {host}:{port}: "
                                  f"{zmq.strerror(exc.errno or 0)}") from None
        except BaseException:
            self._close_helpers()
            router.close(linger=0)
            raise
        endpoint = router.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        self.port = int(endpoint.decode().rsplit(":", 1)[1])
        # (what comes before ``start`` waits in ZeroMQ's queue)
        self._sock = LoopSocket(router, self._on_frames, what="peer socket", copy=False)

    def start(self) -> None:
        self._sock.start()

    def send(self, routing_id: bytes, data: bytes) -> bool:
        return self._sock.send([routing_id, data])

    def linked(self, fd: int) -> None:
        """The connection on descriptor ``fd`` said a hello that made a link: its handshake
        is done."""
        self._pending.pop(fd, None)

    def hang_up(self, fd: int) -> None:
        """Shut down the linked connection on descriptor ``fd``: the peer sees it end."""
        _shut_down_connection(fd, self.port)

    def drain_events(self) -> None:
        """Handle the connection events that have come: before a hello is taken, since
        the connection that had its descriptor before may have closed, and that event
        must not end the new link."""
        if self._monitor is not None:
            self._monitor.reader.read_now()

    def _close_helpers(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if self._zap is not None:
            self._zap.close()
            self._zap = None

    def close(self, linger_s: float) -> None:
        self._close_helpers()
        self._sock.close(linger_s)

    def _on_frames(self, frames: Sequence[bytes | zmq.Frame]) -> None:
        """A message on our ROUTER: [routing id, payload] from a peer's DEALER."""
        first = frames[0]
        routing_id = first.bytes if isinstance(first, zmq.Frame) else first

        def reply(data: bytes) -> object:
            return self.send(routing_id, data)

        if len(frames) != 2:
            self._bad.report("frames", reply, ProtocolError(
                f"expected one frame per message, got {len(frames) - 1}"),
                _source(routing_id))
            return
        frame = frames[1]
        payload = frame.buffer if isinstance(frame, zmq.Frame) else frame
        if not len(payload):
            self._bad.report("empty", reply, ProtocolError("empty message"),
                             _source(routing_id))
            return
        try:
            msg = decode_peer(payload)
        except ProtocolError as err:
            self._bad.report("malformed", reply, err, _source(routing_id))
            return
        self._on_message(routing_id, frame, msg, reply)

    def _on_event(self, event: int, value: int) -> None:
        if event == zmq.EVENT_ACCEPTED:
            self._pending.pop(value, None)  # (a number seen before: its end went unsaid)
            self._pending[value] = None
            if len(self._pending) > MAX_PENDING_HANDSHAKES:
                self._shut_down_oldest()
            return
        if event == zmq.EVENT_DISCONNECTED:
            self._pending.pop(value, None)
            self._on_disconnected(value)
            return
        # A connection that did not finish ZeroMQ's handshake: no CURVE, a wrong key,
        # garbage, silence past HANDSHAKE_IVL (ZAP's refusals are counted by the handler).
        self._bad.report("handshake", None, ProtocolError(
            f"ZeroMQ handshake failed ({_event_name(event)}, {value})"), "peer port")

    def _shut_down_oldest(self) -> None:
        """Past MAX_PENDING_HANDSHAKES: the oldest connection whose handshake is not done is
        shut down (ZeroMQ sees it end, closes it and says so), counted and logged."""
        fd = next(iter(self._pending))
        del self._pending[fd]
        if _shut_down_connection(fd, self.port):
            self._bad.report("handshake_limit", None, ProtocolError(
                f"{MAX_PENDING_HANDSHAKES} connections to the peer port have not finished "
                f"their handshake: the oldest is shut down"), "peer port")

    def _on_zap_request(self, frames: list[bytes]) -> None:
        assert self._keys is not None and self._zap is not None

        def refused(peer: str, why: str) -> None:
            self._bad.report("auth", None, ProtocolError(f"refused at the handshake: {why}"),
                             peer)

        self._zap.send(zap_answer(frames, self._keys, refused))


def _shut_down_connection(fd: int, port: int) -> bool:
    """Shut down (both ways) the TCP connection on descriptor ``fd``, if it is one that
    was accepted on ``port``: True if it was. The descriptor is ZeroMQ's, which closes it
    once it sees the end: a duplicate is shut down and closed, never ``fd`` itself. The
    monitor tells late, so ZeroMQ may have closed ``fd`` already and the number been given
    to something else: what it is now is checked first."""
    try:
        dup = os.dup(fd)
    except OSError:  # closed
        return False
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # not a socket
        os.close(dup)
        return False
    with sock:
        try:
            if (sock.family not in (socket.AF_INET, socket.AF_INET6)
                    or sock.type != socket.SOCK_STREAM
                    or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    or sock.getsockname()[1] != port):
                return False
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


def _source(routing_id: bytes) -> str:
    """Who sent a bad message, for its log line (made only for one: not per message)."""
    return f"routing id {routing_id.hex()}"


def frame_property(frame: bytes | zmq.Frame, name: str) -> int | str | None:
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


_DIAL_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class Dial:
    """Our DEALER to ``address``, from its handshake to its link's end: one per link, never
    reconnecting (a new handshake gets a new one); its monitor says when its connection
    fails or ends, and the handshake then fails, or the link ends.

    ``handshake`` says hello and waits for the welcome; ``attach`` then hands the link's
    messages (those that came right behind the welcome first) to ``on_payload`` and the
    end of its connection to ``on_closed``. Construction raises PeerUnreachable when
    CurveZMQ is on and the peer has no key, zmq.ZMQError when no socket can be opened.
    """

    def __init__(self, ctx: zmq.Context[Any], address: str, keys: CurveKeys | None,
                 handshake_ms: int, heartbeat_ms: int, grace_ms: int, bad: BadInput) -> None:
        self.address = address
        self._bad = bad
        sock = ctx.socket(zmq.DEALER)
        try:
            set_limits(sock, handshake_ms, heartbeat_ms, grace_ms)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection: a new link, a new DEALER
            if keys is not None:
                server_key = keys.by_address.get(address)
                if server_key is None:
                    raise PeerUnreachable(
                        f"no public key for peer {address}: add '<its key> {address}' to "
                        f"curve_allowed_keys_file")
                sock.curve_serverkey = server_key
                sock.curve_publickey = keys.public
                sock.curve_secretkey = keys.secret
            self._monitor = Monitor(ctx, sock, _DIAL_EVENTS, self._on_event,
                                    f"peer {address} monitor")
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock = LoopSocket(sock, self._on_message, what=f"peer {address}")
        self._welcome: asyncio.Future[PeerWelcome] = (
            asyncio.get_running_loop().create_future())
        self._on_payload: Callable[[bytes], None] | None = None
        self._on_closed: Callable[[KvdError], None] | None = None
        self._early: list[bytes] = []  # messages behind the welcome, until attach
        self._sock.start()
        sock.connect(f"tcp://{address}")

    async def handshake(self, hello: bytes) -> PeerWelcome:
        """Say ``hello`` and wait for the welcome (the caller bounds the wait): a
        PeerUnreachable if the connection fails, the peer's error if it refuses."""
        if not self._sock.send([hello]):
            raise PeerUnreachable(f"peer {self.address} took no hello")
        return await self._welcome

    def attach(self, on_payload: Callable[[bytes], None],
               on_closed: Callable[[KvdError], None]) -> None:
        """The link is made: its messages go to ``on_payload`` from now on, the end of
        its connection to ``on_closed``."""
        self._on_payload = on_payload
        self._on_closed = on_closed
        early, self._early = self._early, []
        for payload in early:  # what came right behind the welcome, before the link was made
            on_payload(payload)

    def send(self, data: bytes) -> bool:
        return self._sock.send([data])

    def close(self, linger_s: float = 0.0) -> None:
        self._monitor.close()
        self._sock.close(linger_s)

    def _on_message(self, frames: list[bytes]) -> None:
        """A message on our DEALER: the peer's answer to our hello, then the link's
        messages."""
        if len(frames) != 1 or not frames[0]:
            self._bad.report("frames", None, ProtocolError(
                f"expected one non-empty frame per message, got {len(frames)}"),
                self.address)
            return
        if self._on_payload is not None:
            self._on_payload(frames[0])
        elif self._welcome.done():  # the link is being made: keep the message for it
            self._early.append(frames[0])
        else:
            try:
                msg = decode_peer(frames[0])
            except ProtocolError as err:
                self._bad.report("malformed", None, err, self.address)
                return
            if isinstance(msg, PeerWelcome):
                if msg.protocol_version != PROTOCOL_VERSION:
                    self._welcome.set_exception(ProtocolError(
                        f"peer speaks protocol {msg.protocol_version}, we speak "
                        f"{PROTOCOL_VERSION}"))
                else:
                    self._welcome.set_result(msg)
            elif isinstance(msg, PeerError):
                self._welcome.set_exception(
                    error_from_code(msg.code, f"peer refused: {msg.message}"))

    def _on_event(self, event: int, value: int) -> None:
        """Our connection failed or ended: the handshake fails, or the link ends."""
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
            why = "connection closed (by the peer, or its host stopped answering)"
        if not self._welcome.done():
            self._welcome.set_exception(PeerUnreachable(f"peer {self.address}: {why}"))
        elif self._on_closed is not None:
            self._on_closed(PeerUnreachable(f"connection to peer {self.address}: {why}"))
