"""The peer plane: links to other daemons, their handshake, heartbeats and death.

The protocol is docs/architecture.md's "Peer plane" and "Data connections": our ROUTER,
which peers dial, and a DEALER of ours per link (``peer_sockets``: ``PeerRouter``,
``Dial``); ``PeerHello`` and ``PeerWelcome``; then one message per ZeroMQ message both
ways, in order (the NCCL channels rely on that order). Each side sends its bytes on a data
connection of its own (``peer_data.DataPort``), admitted by the token the handshake gave.
What happens on links goes to one ``LinkEvents`` (``handle_with``). With CurveZMQ
(``auth.py``) a hello is taken only for the address the allow-list gives its key.

A link ends at once when its connection does: the socket monitors say so (a DEALER's
``EVENT_DISCONNECTED`` is its link's; on the ROUTER the event names the connection's
descriptor, which the hello's frame carried); TCP keepalives close a connection whose
peer's host stopped answering, idle or not (``peer_sockets.set_limits``). A link with
work in flight ends too when no message of the peer's came within ``peer_grace_s`` (a
frozen or hung peer: kvd's heartbeats, on busy links only, so that an idle link costs no
CPU), and when ZeroMQ refuses it a message (the peer stopped reading: ``SEND_HWM``). Its
transfers then fail with ``PeerUnreachable`` (``on_link_lost``) and its channels are
aborted. A ``PeerHello`` claiming the address of a live link is refused, since without
CurveZMQ anyone could claim it; a restarted peer closed its old connection (or its host
stopped answering), and its hello is taken then.

Two daemons keep one link between them. When both dial at once, the hello of the one
with the greater address is refused (``LinkedAlready``) by the other, whose own dial is
in flight and becomes the pair's link; a hello to a daemon already linked with us is
refused the same way. The refused dialler takes the link the peer made instead of failing
(``link_to``): no link is replaced, and no transfer fails, because two dials crossed.

Links are bounded by ``max_peer_links``, ours and the peers' together. A new link at the
bound (a peer's hello, or a dial of ours) closes the least recently used link with no work
in flight (``_make_room``): the peer sees its connection end, and links again when it needs
to. Only when every link has work in flight is the new one refused, and the refusal says
so. An idle link holds its ZeroMQ connection and its state: data connections close when
unused (``peer_data``), and kvd's heartbeats go on busy links only.

What a peer can make the daemon hold: ``max_peer_links`` links, connections that have not
linked yet (bounded by ``peer_sockets`` on the ROUTER, ``peer_data`` on the data port),
and per connection what those two modules bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Sequence
from typing import Any

import zmq

from kvd import timeline
from kvd.config import Config
from kvd.daemon.auth import CurveKeys, load_keys, make_data_tls, read_allowed
from kvd.daemon.futures import keep_task
from kvd.daemon.peer_data import DataPort
from kvd.daemon.peer_link import CPU_DEVICE, LinkEvents, PeerLink
from kvd.daemon.peer_sockets import (
    SEND_HWM,
    BadInput,
    Dial,
    PeerRouter,
    Reply,
    frame_property,
)
from kvd.errors import (
    BadRequest,
    ConfigError,
    KvdError,
    LinkedAlready,
    PeerUnreachable,
    ProtocolError,
)
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
from kvd.transport.tcp import SendChannel

log = logging.getLogger(__name__)

class PeerPlane:
    """Construct, ``listen`` (the ports are claimed), ``handle_with`` the component that
    takes the links' events, ``start``."""

    def __init__(self, config: Config, ctx: zmq.Context[Any], epoch: int,
                 gpus: Sequence[str] = (), nccl_blocking_calls: bool = False) -> None:
        self.config = config
        self.ctx = ctx
        self.gpus = list(gpus)  # our GPUs that NCCL channels can use, told to peers
        # Told to peers too: our channels can split for blocking calls (config and NCCL).
        self.nccl_blocking_calls = nccl_blocking_calls
        self.epoch = epoch
        self._events: LinkEvents | None = None  # (set before start: no link before it)
        self._bad = self.bad_input = BadInput()
        self.bad_messages = self._bad.counts
        self.links: dict[str, PeerLink] = {}  # by address
        self._by_routing_id: dict[bytes, PeerLink] = {}  # incoming links
        self._by_fd: dict[int, PeerLink] = {}  # incoming links, by their connection
        self._by_token: dict[bytes, PeerLink] = {}
        self._dials: set[Dial] = set()  # DEALERs open (handshaking or linked)
        # Tokens of our handshakes in flight: the peer may dial our data port as soon as
        # it has welcomed us, before our loop has made the link that knows the token.
        self._handshake_done: dict[bytes, asyncio.Future[None]] = {}
        self._linking: dict[str, asyncio.Task[PeerLink]] = {}
        # Callers whose dial the peer refused (LinkedAlready), waiting for its link.
        self._awaited: dict[str, asyncio.Future[None]] = {}
        self.links_lost = 0  # links that ended, for any reason (stats, metrics)
        self.links_evicted = 0  # of those, closed for a newcomer at max_peer_links
        self.keys_changed = {"added": 0, "removed": 0}  # by reloads of the allow-list
        self._configuring: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self.keys: CurveKeys | None = load_keys(config)
        self._data = DataPort(
            config, make_data_tls() if self.keys is not None and config.encrypt_data else None,
            self._bad, self._link_for_token, self._lose)
        # Our dials' ZeroMQ handshake (our ROUTER's is peer_sockets.HANDSHAKE_S).
        self.handshake_ms = max(1, int(config.peer_connect_timeout_s * 1000))
        # ZeroMQ's heartbeats on every peer connection (peer_sockets.set_limits): interval
        # and grace, in ms.
        self._heartbeat_ms = (max(1, int(config.heartbeat_interval_s * 1000)),
                              max(1, int(config.peer_grace_s * 1000)))
        self._router: PeerRouter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.address = ""
        self.configured = [a.strip() for a in config.peers.split(",") if a.strip()]

    # ------------------------------------------------------------ lifecycle

    def handle_with(self, events: LinkEvents) -> None:
        """Where the links' messages and ups and downs go: set once, before ``start``
        (the component that takes them is built with this plane)."""
        if self._events is not None:
            raise RuntimeError("the peer plane's events have a handler already")
        self._events = events

    def listen(self) -> None:
        """Claim the peer and data ports: what peers send waits until ``start``."""
        cfg = self.config
        self._router = PeerRouter(self.ctx, self.keys, self._bad,
                                  self._on_router_message, self._on_disconnected,
                                  cfg.peer_host, cfg.peer_port, *self._heartbeat_ms)
        self.address = f"{cfg.advertise_host or cfg.peer_host}:{self._router.port}"
        self._data.listen(cfg.peer_host, cfg.data_port)

    def start(self) -> None:
        if self._events is None:
            raise RuntimeError("PeerPlane.handle_with must come before start")
        assert self._router is not None
        self._router.start()
        self._data.start()
        self._tasks = [
            self._loop.create_task(self._heartbeat_loop(), name="kvd-peer-heartbeat")]
        log.info("peer socket listening address=%s data_port=%d curve=%s encrypt_data=%s",
                 self.address, self.data_port, "on" if self.keys else "off",
                 "on" if self._data.tls else "off")

    @property
    def data_port(self) -> int:
        return self._data.port

    async def close(self) -> None:
        tasks = [*self._tasks, *self._configuring, *self._linking.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, self._data.close(), return_exceptions=True)
        for link in list(self.links.values()):
            self._lose(link, PeerUnreachable("daemon stopping"))
        self._data.end_threads()
        await asyncio.sleep(0)
        # What is queued (a CHANNEL_DOWN, a last PeerError) may still go out for a moment,
        # in ZeroMQ's I/O thread, while the context ends.
        for dial in list(self._dials):
            dial.close(linger_s=1.0)
        self._dials.clear()
        if self._router is not None:
            self._router.close(linger_s=1.0)

    def stats(self) -> dict[str, Any]:
        return {"address": self.address, "data_port": self.data_port,
                "links": [link.describe(self._loop.time()) for link in self.links.values()],
                "configured": list(self.configured), "links_lost": self.links_lost,
                "links_evicted": self.links_evicted,
                "max_links": self.config.max_peer_links,
                "allowed_keys": len(self.keys.address_of) if self.keys else None,
                "keys_changed": dict(self.keys_changed),
                "bad_messages": dict(self.bad_messages)}

    def reload_keys(self) -> dict[str, Any]:
        """Read the allow-list again (``kvd reload``, SIGHUP). A key added is accepted from
        now on (the ZAP handler and our next dials read the new list); a peer whose key
        was taken off, or changed, loses its links now. What changed; ConfigError, the list
        kept as it was, without keys or when the file is not a valid list."""
        if self.keys is None:
            raise ConfigError("this daemon runs without CurveZMQ keys: there is no "
                              "allow-list to reload")
        by_address, address_of = read_allowed(self.config.curve_allowed_keys_file)
        old = self.keys.by_address
        added = sorted(a for a, key in by_address.items() if old.get(a) != key)
        removed = sorted(a for a, key in old.items() if by_address.get(a) != key)
        self.keys.by_address, self.keys.address_of = by_address, address_of
        self.keys_changed["added"] += len(added)
        self.keys_changed["removed"] += len(removed)
        ended = [link for link in self.links.values() if link.address in removed]
        for link in ended:
            self._lose(link, PeerUnreachable(
                f"the key of peer {link.address} was taken off curve_allowed_keys_file"),
                hang_up=True)
        log.info("allow-list reloaded from %s: %d keys; added %s; removed %s; links ended %s",
                 self.config.curve_allowed_keys_file, len(address_of), added or "none",
                 removed or "none", [link.address for link in ended] or "none")
        return {"allowed_keys": len(address_of), "added": added, "removed": removed,
                "links_ended": [link.address for link in ended]}

    # ------------------------------------------------------------ links we make

    def _hello_fields(self, token: bytes) -> dict[str, Any]:
        tls = self._data.tls
        return {"protocol_version": PROTOCOL_VERSION, "node_id": self.config.node_id,
                "epoch": self.epoch, "address": self.address, "data_port": self.data_port,
                "data_token": token, "devices": [CPU_DEVICE, *self.gpus],
                "nccl_blocking_calls": self.nccl_blocking_calls,
                "data_fingerprint": tls.fingerprint if tls else b"",
                "pool_capacity_bytes": self.config.pool_size_bytes}

    async def link_to(self, address: str, timeout_s: float) -> PeerLink:
        """The live link to ``address``, after a handshake if there is none. Concurrent
        callers share one handshake. When the peer refuses it because its own link to us
        is the pair's (module doc), that link is awaited (it may come behind the refusal),
        and the peer dialled again if it never does (its dial failed)."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    link = self.links.get(address)
                    if link is not None and link.alive:
                        return link
                    try:
                        return await asyncio.shield(self._dial(address, timeout_s))
                    except LinkedAlready:
                        arrived = self._awaited.setdefault(address, self._loop.create_future())
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(self.config.peer_connect_timeout_s):
                                await asyncio.shield(arrived)
        except TimeoutError:
            raise PeerUnreachable(f"no answer from peer {address} within {timeout_s:g}s") from None

    def _dial(self, address: str, timeout_s: float) -> asyncio.Task[PeerLink]:
        """The handshake with ``address`` in flight, begun if there is none."""
        pending = self._linking.get(address)
        if pending is None:
            pending = self._loop.create_task(self._handshake(address, timeout_s))
            self._linking[address] = pending
            pending.add_done_callback(lambda task: self._handshake_ended(address, task))
        return pending

    def _handshake_ended(self, address: str, task: asyncio.Task[PeerLink]) -> None:
        """A shared handshake is over. Its failure is taken here: each caller waits within
        its own timeout, and one that gives up first stops listening (its shield drops its
        callback), so the failure may be nobody's; asyncio would log it as an error."""
        self._linking.pop(address, None)
        if not task.cancelled():
            task.exception()

    async def _handshake(self, address: str, timeout_s: float) -> PeerLink:
        if address == self.address:
            raise PeerUnreachable(f"{address} is this daemon")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise BadRequest(f"peer address must be host:port, got {address!r}")
        if not self._make_room(address):
            raise PeerUnreachable(
                f"cannot link to {address}: {self.config.node_id} has "
                f"{self.config.max_peer_links} links (max_peer_links) and every one has "
                f"work in flight")
        token = secrets.token_bytes(32)
        done = self._handshake_done[token] = self._loop.create_future()
        dial: Dial | None = None
        try:
            try:
                dial = Dial(self.ctx, address, self.keys, self.handshake_ms,
                            *self._heartbeat_ms, self._bad)
            except zmq.ZMQError as exc:  # (out of sockets or descriptors)
                raise PeerUnreachable(f"cannot open a socket to peer {address}: {exc}") from None
            self._dials.add(dial)
            async with asyncio.timeout(min(timeout_s, self.config.peer_connect_timeout_s)):
                welcome = await dial.handshake(encode(PeerHello(**self._hello_fields(token))))
            self._check_data_encryption(welcome.data_fingerprint, address)
        except (TimeoutError, KvdError) as exc:
            if dial is not None:
                self._dials.discard(dial)
                dial.close()
            if isinstance(exc, KvdError) and (isinstance(exc, LinkedAlready)
                                              or not isinstance(exc, PeerUnreachable)):
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
        link = self._add_link(address, welcome, token, dial=dial)
        self._link_up(link)
        dial.attach(lambda payload: self._on_link_payload(link, payload),
                    lambda err: self._lose(link, err))
        return link

    def _check_data_encryption(self, their_fingerprint: bytes, address: str) -> None:
        """Both ends encrypt data connections, or neither: otherwise our bytes would go
        in the clear to a peer that does not, against this operator's choice."""
        ours = self._data.tls is not None
        if ours != bool(their_fingerprint):
            raise PeerUnreachable(
                f"peer {address} {'does not encrypt' if ours else 'encrypts'} its data "
                f"connections and this daemon {'does' if ours else 'does not'}: set "
                f"encrypt_data (and CurveZMQ) the same on both")

    # ------------------------------------------------------------ links peers make

    def _on_hello(self, routing_id: bytes, frame: bytes | zmq.Frame, hello: PeerHello,
                  reply: Reply) -> None:
        source = f"{hello.address} (node {hello.node_id})"
        if hello.protocol_version != PROTOCOL_VERSION:
            self._bad.report("version", reply, ProtocolError(
                f"protocol version {hello.protocol_version} is not supported; this daemon "
                f"speaks version {PROTOCOL_VERSION}"), source)
            return
        if routing_id in self._by_routing_id:
            self._bad.report("duplicate_hello", reply, ProtocolError("already said peer_hello"),
                             source)
            return
        fd = frame_property(frame, "__fd")
        if self.keys is not None:
            key = frame_property(frame, "User-Id")
            allowed = self.keys.address_of.get(key.encode()) if isinstance(key, str) else None
            if allowed != hello.address:
                self._bad.report("auth", reply, PeerUnreachable(
                    f"the key this peer connected with is listed for {allowed or 'no address'}"
                    f" in curve_allowed_keys_file, not {hello.address}"), source)
                return
        try:
            self._check_data_encryption(hello.data_fingerprint, hello.address)
        except PeerUnreachable as err:
            self._bad.report("data_encryption", reply, err, source)
            return
        if self._router is not None:
            self._router.drain_events()
        if hello.address in self._linking and self.address < hello.address:
            # Crossed dials: ours is the pair's link (the lesser address's). Not bad input,
            # so not counted; the peer takes our link when it comes.
            log.debug("hello refused: we are dialling %s too, and ours is kept", source)
            reply(encode(PeerError(code=LinkedAlready.code, message=(
                f"{self.address} is dialling {hello.address} too; its link is the one kept"))))
            return
        old = self.links.get(hello.address)
        if old is not None and old.alive:
            # Without CurveZMQ anyone can claim an address: the link that holds it keeps
            # it while its connection lives. A peer that restarted closed its old
            # connection when it died (or its host stopped answering: TCP keepalives), and
            # its new hello is taken then.
            refusal = LinkedAlready(
                f"{hello.address} is linked already (node {old.node_id}, epoch {old.epoch}) "
                f"and that link answers: refused until its connection closes or its host "
                f"stops answering")
            if (hello.node_id, hello.epoch) == (old.node_id, old.epoch):
                # The same daemon dialled while our dial to it was made: crossed dials,
                # not bad input. It takes this link (link_to).
                reply(encode(PeerError(code=refusal.code, message=refusal.message)))
            else:
                self._bad.report("takeover", reply, refusal, source)
            return
        if old is None and not self._make_room(hello.address):  # (old's place adds none)
            self._bad.report("link_limit", reply, PeerUnreachable(
                f"{self.config.node_id} has {len(self.links)} links (max_peer_links) and "
                f"every one has work in flight: hello from {hello.address} (node "
                f"{hello.node_id}) refused; ask again later"), source)
            return
        token = secrets.token_bytes(32)
        link = self._add_link(hello.address, hello, token, routing_id=routing_id,
                              fd=fd if isinstance(fd, int) else -1)
        self._by_routing_id[routing_id] = link
        if link.fd >= 0:
            self._by_fd[link.fd] = link
            if self._router is not None:
                self._router.linked(link.fd)
        if not reply(encode(PeerWelcome(**self._hello_fields(token)))):
            self._lose(link, PeerUnreachable(f"peer {link.address} took no welcome"))

    def _make_room(self, newcomer: str) -> bool:
        """Whether a link to ``newcomer`` may be made: below ``max_peer_links`` (links and
        our handshakes in flight), or once the least recently used link with no work in
        flight is closed for it."""
        bound = self.config.max_peer_links
        if len(self.links) + len(self._linking) - (newcomer in self._linking) < bound:
            return True
        assert self._events is not None
        busy = self._events.busy_links()
        idle = [link for link in self.links.values() if link not in busy]
        if not idle:
            return False
        oldest = min(idle, key=lambda link: link.last_active)
        self.links_evicted += 1
        self._lose(oldest, PeerUnreachable(
            f"link to {oldest.address} closed: {self.config.node_id} is at max_peer_links "
            f"({bound}) and this link was the least recently used idle one, for a link to "
            f"{newcomer}"), hang_up=True)
        return True

    def _on_disconnected(self, fd: int) -> None:
        link = self._by_fd.get(fd)
        if link is not None:
            self._lose(link, PeerUnreachable(
                f"connection from peer {link.address} closed (by the peer, or its host "
                f"stopped answering)"))

    async def _link_for_token(self, token: bytes) -> PeerLink | None:
        """The link whose data token this is; if its handshake is in flight (the peer
        welcomed us and dialled in before our loop made the link), once that is done."""
        link = self._by_token.get(token)
        if link is None and token in self._handshake_done:
            await asyncio.shield(self._handshake_done[token])
            link = self._by_token.get(token)
        return link

    # ------------------------------------------------------------ a link's life

    def _add_link(self, address: str, said: PeerHello | PeerWelcome, token: bytes,
                  dial: Dial | None = None, routing_id: bytes = b"", fd: int = -1
                  ) -> PeerLink:
        """The link a handshake made (``said``: the peer's hello or welcome; ``token``:
        the one we gave it), in place of an old one to ``address``."""
        link = PeerLink(address=address, node_id=said.node_id, epoch=said.epoch,
                        data_port=said.data_port, token_for_them=token,
                        token_for_us=said.data_token, dial=dial, routing_id=routing_id, fd=fd,
                        data_fingerprint=said.data_fingerprint, last_seen=self._loop.time(),
                        last_active=self._loop.time(),
                        devices=list(said.devices),
                        nccl_blocking_calls=said.nccl_blocking_calls,
                        pool_capacity_bytes=said.pool_capacity_bytes)
        old = self.links.get(address)
        if old is not None and old.alive:
            reason = ("peer restarted" if old.epoch != link.epoch
                      else "peer reconnected")
            self._lose(old, PeerUnreachable(f"{reason}: {link.address}"))
        self.links[address] = link
        self._by_token[token] = link
        if (awaited := self._awaited.pop(address, None)) is not None and not awaited.done():
            awaited.set_result(None)
        link.recv_channel = self._data.recv_channel(link)
        log.info("peer up address=%s node=%s epoch=%d (%s)", address, link.node_id,
                 link.epoch, "outgoing" if dial else "incoming")
        return link

    def _link_up(self, link: PeerLink) -> None:
        """Tell the daemon a link is up, once: an outgoing one as soon as it is made; an
        incoming one when the first message after the handshake arrives — the dialer may
        drop (or refuse) a message that reaches it before its loop has made the link."""
        link.reported_up = True
        try:
            assert self._events is not None
            self._events.on_link_up(link)
        except Exception:
            log.exception("unhandled error in the link-up handler")

    async def send_channel(self, link: PeerLink) -> SendChannel:
        """The channel for bytes we send to ``link``, connected on first use."""
        return await self._data.send_channel(link)

    def send(self, link: PeerLink, msg: PeerMessage) -> None:
        """Send a message on the link (dropped if the link is gone). A message ZeroMQ
        will not take ends the link: the peer stopped reading, or its connection is gone."""
        if not link.alive:
            return
        timeline.mark(f"peer.send.{msg.__struct_config__.tag}")
        link.last_active = self._loop.time()
        if not self._send_on(link, encode(msg)):
            self._lose(link, PeerUnreachable(
                f"peer {link.address} stopped reading ({SEND_HWM} messages unsent) or its "
                f"connection is gone"))

    def _send_on(self, link: PeerLink, data: bytes) -> bool:
        if link.dial is not None:
            return link.dial.send(data)
        return self._router is not None and self._router.send(link.routing_id, data)

    def _lose(self, link: PeerLink, error: KvdError, hang_up: bool = False) -> None:
        """The link ends. ``hang_up``: it is this daemon's choice, and a link the peer
        made has its connection shut down, so that the peer sees it end (ours are closed
        with our DEALER, below)."""
        if not link.alive:
            return
        link.alive = False
        self.links_lost += 1
        log.warning("peer down address=%s node=%s epoch=%d: %s", link.address, link.node_id,
                    link.epoch, error.message)
        if hang_up and link.fd >= 0 and self._router is not None:
            self._router.hang_up(link.fd)
        if self.links.get(link.address) is link:
            del self.links[link.address]
        self._by_token.pop(link.token_for_them, None)
        if link.routing_id and self._by_routing_id.get(link.routing_id) is link:
            del self._by_routing_id[link.routing_id]
        if self._by_fd.get(link.fd) is link:
            del self._by_fd[link.fd]
        self._data.abort(link, error)
        assert self._events is not None
        self._events.on_link_lost(link, error)
        callbacks, link.on_lost = link.on_lost, []  # what they hold goes with the link
        for callback in callbacks:
            callback(link, error)
        self._data.release(link, error)
        if link.dial is not None:
            self._dials.discard(link.dial)
            link.dial.close()

    # ------------------------------------------------------------ reading

    def _on_router_message(self, routing_id: bytes, frame: bytes | zmq.Frame,
                           msg: PeerMessage, reply: Reply) -> None:
        if isinstance(msg, PeerHello):
            self._on_hello(routing_id, frame, msg, reply)
            return
        link = self._by_routing_id.get(routing_id)
        if link is None or not link.alive:
            self._bad.report("no_link", reply, ProtocolError(
                "unknown peer: send peer_hello first (this daemon may have restarted)"),
                f"routing id {routing_id.hex()}")
            return
        self._on_link_message(link, msg, reply)

    def _on_link_payload(self, link: PeerLink, payload: bytes) -> None:
        """A message on a link we opened (on our DEALER)."""
        try:
            msg = decode_peer(payload)
        except ProtocolError as err:
            self._bad.report("malformed", None, err, link.address)
            return
        if isinstance(msg, PeerHello):
            self._bad.report("unexpected", None,
                             ProtocolError("peer_hello on a link we opened"), link.address)
            return
        self._on_link_message(link, msg, None)

    def _on_link_message(self, link: PeerLink, msg: PeerMessage, reply: Reply | None) -> None:
        if not link.alive:
            return
        link.last_seen = link.last_active = self._loop.time()
        if not link.reported_up:
            self._link_up(link)
        if isinstance(msg, Heartbeat):
            if msg.ask and not link.busy_since:  # (a busy link's own heartbeats answer)
                self.send(link, Heartbeat(epoch=self.epoch))
            return
        timeline.mark(f"peer.recv.{msg.__struct_config__.tag}")
        if isinstance(msg, PeerError):
            log.warning("peer %s reported: [%s] %s", link.address, msg.code, msg.message)
            return
        if isinstance(msg, PeerWelcome):
            self._bad.report("unexpected",
                             reply or (lambda data: self._send_on(link, data)),
                             ProtocolError("unexpected peer_welcome"), link.address)
            return
        assert self._events is not None
        self._events.on_message(link, msg)

    # ------------------------------------------------------------ heartbeats

    async def _heartbeat_loop(self) -> None:
        """Heartbeats on the links with work in flight (``LinkEvents.busy_links``), asking
        for an answer: a frozen peer, or one whose loop has stopped, is found within the
        grace, counted from its last message or from when the work began (a peer says
        nothing on an idle link). Idle links cost nothing here: TCP keepalives watch them,
        in the kernel (``peer_sockets.set_limits``); a frozen peer behind one is found
        once it is used."""
        interval, grace = self.config.heartbeat_interval_s, self.config.peer_grace_s
        while True:
            self._link_configured()
            await asyncio.sleep(interval)
            now = self._loop.time()
            assert self._events is not None
            busy = self._events.busy_links()
            for link in list(self.links.values()):
                if link not in busy:
                    link.busy_since = 0.0
                    self._data.close_idle(link)
                    continue
                link.busy_since = link.busy_since or now
                silent = now - max(link.last_seen, link.busy_since)
                if silent > grace:  # (hung up: a peer only slow sees the end, links anew)
                    self._lose(link, PeerUnreachable(
                        f"peer {link.address} silent for {silent:.1f}s (grace {grace:g}s)"),
                        hang_up=True)
                else:
                    self.send(link, Heartbeat(epoch=self.epoch, ask=True))

    def _link_configured(self) -> None:
        """Keep a link to every configured peer (retried each heartbeat)."""
        for address in self.configured:
            link = self.links.get(address)
            if (link is None or not link.alive) and address not in self._linking:
                async def connect(address: str = address) -> None:
                    with contextlib.suppress(KvdError):
                        await self.link_to(address, self.config.peer_connect_timeout_s)

                keep_task(self._configuring, connect())
