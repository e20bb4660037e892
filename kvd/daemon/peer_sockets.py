"""The peer plane's ZeroMQ plumbing: the limits of its sockets, their monitors, the
ROUTER peers dial (``PeerRouter``), and the count of bad input from peers (``BadInput``).

What a peer can make the daemon hold on these sockets: per connection, ``RECV_HWM``
messages of at most ``MAX_PEER_MESSAGE_BYTES`` read ahead by ZeroMQ (a larger message
ends the connection); a connection that does not finish ZeroMQ's handshake within
``peer_connect_timeout_s`` is closed by ZeroMQ. With ``curve_secret_key_file`` the ROUTER
is a CurveZMQ server whose ZAP handler (``daemon/auth.py``) admits only the public keys
on ``curve_allowed_keys_file``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvd.daemon.accepting import Throttled
from kvd.daemon.auth import ZAP_DOMAIN, ZAP_ENDPOINT, CurveKeys, zap_answer
from kvd.errors import ConfigError, KvdError, ProtocolError
from kvd.loop_socket import LoopSocket, monitor_event
from kvd.protocol import PeerError, PeerMessage, decode_peer, encode

log = logging.getLogger(__name__)

MAX_PEER_MESSAGE_BYTES = 1 << 20  # ZMQ_MAXMSGSIZE: a larger message ends its connection
# Control messages queued for one peer (its ZeroMQ pipe) that it has not taken: past this
# the peer counts as not reading and its link ends (they are ~100 bytes each: a few MiB).
SEND_HWM = 32768
# Messages ZeroMQ reads ahead from one connection before it stops reading it (TCP pushes
# back to the sender; nothing is lost). With MAX_PEER_MESSAGE_BYTES, what one connection
# can make the daemon hold: a flood of garbage is bounded by it.
RECV_HWM = 64

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

    def report(self, reason: str, reply: Reply | None, err: KvdError, source: str) -> None:
        """Count a bad message (or connection), log it (at most once per reason every few
        seconds: a peer sending nothing else cannot flood the log), and answer it with a
        PeerError where there is a way back."""
        self.count(reason)
        self._logs.setdefault(reason, Throttled(log)).warning(
            "bad peer message reason=%s from=%s: %s", reason, source, err.message)
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

    def drain(self) -> None:
        """Handle every event that has come (before a hello: see PeerRouter.drain_events)."""
        self.reader.read_now()

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._watched.disable_monitor()
        self.reader.close()


def set_limits(sock: zmq.Socket[Any], handshake_ms: int) -> None:
    """The options every peer socket has: no lingering, the bounds above, and ZeroMQ's
    handshake bounded in time."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, handshake_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PEER_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)


class PeerRouter:
    """Our ROUTER on ``tcp://host:port``, which peers' DEALERs dial: each message read off
    it is checked (one non-empty frame that decodes) and goes to ``on_message(routing id,
    frame, message, reply)``; a connection that closes goes to ``on_disconnected(its
    descriptor)``. Bad input is counted in ``bad``."""

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys | None, handshake_ms: int,
                 bad: BadInput,
                 on_message: Callable[[bytes, bytes | zmq.Frame, PeerMessage, Reply], None],
                 on_disconnected: Callable[[int], None],
                 host: str, port: int) -> None:
        self._keys = keys
        self._bad = bad
        self._on_message = on_message
        self._on_disconnected = on_disconnected
        self._monitor: Monitor | None = None
        self._zap: LoopSocket | None = None
        router = ctx.socket(zmq.ROUTER)
        try:
            set_limits(router, handshake_ms)
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
            self._monitor = Monitor(
                ctx, router, zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, self._on_event, "peer monitor")
            try:
                router.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as exc:
                raise ConfigError(f"peer_port: cannot listen on {host}:{port}: {exc}"
                                  ) from None
        except BaseException:
            self._close_helpers()
            router.close(linger=0)
            raise
        endpoint = router.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        self.port = int(endpoint.decode().rsplit(":", 1)[1])
        self._sock = LoopSocket(router, self._on_frames, what="peer socket", copy=False)
        self._sock.start()

    def send(self, routing_id: bytes, data: bytes) -> bool:
        return self._sock.send([routing_id, data])

    def reply_to(self, routing_id: bytes) -> Reply:
        def reply(data: bytes) -> object:
            return self._sock.send([routing_id, data])
        return reply

    def drain_events(self) -> None:
        """Handle the connection events that have come: before a hello is taken, since
        the connection that had its descriptor before may have closed, and that event
        must not end the new link."""
        if self._monitor is not None:
            self._monitor.drain()

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
        routing_id = frame_bytes(frames[0])
        reply = self.reply_to(routing_id)
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
        if event == zmq.EVENT_DISCONNECTED:
            self._on_disconnected(value)
            return
        # A connection that did not finish ZeroMQ's handshake: no CURVE, a wrong key,
        # garbage, silence past HANDSHAKE_IVL (ZAP's refusals are counted by the handler).
        self._bad.report("handshake", None, ProtocolError(
            f"ZeroMQ handshake failed ({_event_name(event)}, {value})"), "peer port")

    def _on_zap_request(self, frames: list[bytes]) -> None:
        assert self._keys is not None and self._zap is not None

        def refused(peer: str, why: str) -> None:
            self._bad.report("auth", None, ProtocolError(f"refused at the handshake: {why}"),
                             peer)

        self._zap.send(zap_answer(frames, self._keys, refused))


def _source(routing_id: bytes) -> str:
    """Who sent a bad message, for its log line (made only for one: not per message)."""
    return f"routing id {routing_id.hex()}"


def frame_bytes(frame: bytes | zmq.Frame) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else frame


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
