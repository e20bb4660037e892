"""A link to another daemon (``PeerLink``), and what the peer plane tells the daemon about
its links (``LinkEvents``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvd.daemon.peer_sockets import Dial
from kvd.errors import KvdError
from kvd.protocol import PeerMessage
from kvd.transport.tcp import RecvChannel, SendChannel

CPU_DEVICE = "cpu"


@dataclass(eq=False)
class PeerLink:
    address: str  # how the peer is reached: host:port of its peer socket
    node_id: str
    epoch: int
    data_port: int
    token_for_them: bytes  # they present it on our data port
    token_for_us: bytes  # we present it on theirs
    dial: Dial | None = None  # an outgoing link: our DEALER
    routing_id: bytes = b""  # an incoming link: their connection on our ROUTER
    fd: int = -1  # an incoming link: that connection's descriptor (its monitor events)
    data_fingerprint: bytes = b""  # their data port's certificate (b"": plain TCP)
    last_seen: float = 0.0  # when its last message came, heartbeats included
    last_active: float = 0.0  # its last message either way (which link is closed first)
    busy_since: float = 0.0  # since when work is on it (0: none; PeerPlane's heartbeats)
    devices: list[str] = field(default_factory=list)  # "cpu", and "cuda:N" with NCCL
    nccl_blocking_calls: bool = False  # the peer splits its channels for blocking calls
    pool_capacity_bytes: int = 0  # the peer's host pool (0: not told)
    alive: bool = True
    send_channel: SendChannel | None = None
    recv_channel: RecvChannel | None = None
    connecting: asyncio.Future[SendChannel] | None = None
    on_lost: list[Callable[[PeerLink, KvdError], None]] = field(default_factory=list)
    reported_up: bool = False  # LinkEvents.on_link_up was called (see PeerPlane._link_up)

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
                "pool_capacity_bytes": self.pool_capacity_bytes,
                "channels": {"send": self.send_channel is not None,
                             "recv": self.recv_channel is not None}}


class LinkEvents(Protocol):
    """What the plane tells about its links, on the loop (``PeerPlane.handle_with``)."""

    def on_message(self, link: PeerLink, msg: PeerMessage) -> None:
        """A message on a live link (not a handshake, heartbeat or PeerError)."""

    def busy_links(self) -> set[PeerLink]:
        """The links with work in flight on them (their heartbeats watch them)."""

    def on_link_up(self, link: PeerLink) -> None:
        """A link is up, once per link: an outgoing one as soon as it is made, an incoming
        one when its first message after the handshake arrives."""

    def on_link_lost(self, link: PeerLink, error: KvdError) -> None:
        """A link ended (its connection closed, it fell silent, or the daemon stops): what
        depends on it fails with ``error``; its data channels are aborted already."""
