"""Our DEALER to one peer (``Dial``): its hello and the peer's welcome, then the messages
of the link made from them.

One DEALER per link: it never reconnects, and a new handshake gets a new one. With
CurveZMQ it dials with the peer's public key from ``curve_allowed_keys_file``. Its monitor
tells when its connection fails or ends: the handshake then fails, or the link ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq

from kvd.daemon.auth import CurveKeys
from kvd.daemon.peer_sockets import BadInput, Monitor, set_limits
from kvd.errors import KvdError, PeerUnreachable, ProtocolError, error_from_code
from kvd.loop_socket import LoopSocket
from kvd.protocol import PROTOCOL_VERSION, PeerError, PeerWelcome, decode_peer

_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class Dial:
    """Our DEALER to ``address``, from its handshake to its link's end.

    ``handshake`` says hello and waits for the welcome; ``attach`` then hands the link's
    messages (those that came right behind the welcome first) to ``on_payload`` and the
    end of its connection to ``on_closed``. Construction raises PeerUnreachable when
    CurveZMQ is on and the peer has no key, zmq.ZMQError when no socket can be opened.
    """

    def __init__(self, ctx: zmq.Context[Any], address: str, keys: CurveKeys | None,
                 handshake_ms: int, bad: BadInput) -> None:
        self.address = address
        self._bad = bad
        sock = ctx.socket(zmq.DEALER)
        try:
            set_limits(sock, handshake_ms)
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
            self._monitor = Monitor(ctx, sock, _EVENTS, self._on_event,
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
            why = "connection closed"
        if not self._welcome.done():
            self._welcome.set_exception(PeerUnreachable(f"peer {self.address}: {why}"))
        elif self._on_closed is not None:
            self._on_closed(PeerUnreachable(f"connection to peer {self.address}: {why}"))
