"""The local plane: a ZeroMQ ROUTER serving the node's inference processes, each through a
DEALER it connects to behind the door of ``daemon/lifelines.py`` (``_reach``), so every
connection on it is one the daemon made, under an id it chose.

A message is two frames, the client's routing id and one msgspec message, read on the
loop (``kvd.loop_socket``): quick requests are answered right in the read callback; long
ones become tasks that reply when they finish. Every malformed message gets an
``ErrorReply`` and a count in ``bad_messages``; nothing a client sends can stop the server.

A client is a *session*, opened by ``Hello``, closed at once when its lifeline closes (the
client exited or died): its requests are cancelled, its regions and its keys without a TTL
released, its segments' descriptors closed. A client that stops reading its replies is cut
off once ``_MAX_UNREAD_REPLIES`` of them wait (its lifeline is closed: it sees its daemon
gone).

What one client can make the daemon hold: ZeroMQ reads ahead at most
``_MAX_QUEUED_REQUESTS`` of its requests, each at most ``max_message_bytes``
(``ZMQ_MAXMSGSIZE``: a longer one ends its connection inside ZeroMQ, unread; the client
library refuses one before it is sent, told the limit in ``Welcome``); its descriptors
are counted against the daemon's (``daemon/descriptors.py``); at most
``MAX_SEGMENTS_PER_SESSION`` segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvd import __version__, timeline
from kvd.config import Config
from kvd.daemon.accepting import Throttled
from kvd.daemon.descriptors import PER_SEGMENT, DescriptorBudget
from kvd.daemon.engine import Engine
from kvd.daemon.futures import keep_task
from kvd.daemon.lifelines import Connection, LifelineServer
from kvd.errors import (
    Cancelled,
    ConfigError,
    DaemonUnavailable,
    InternalError,
    KvdError,
    KvdTimeout,
    ProtocolError,
)
from kvd.loop_socket import LoopSocket
from kvd.protocol import (
    CLI_CLIENT_NAME,
    PROTOCOL_VERSION,
    Bye,
    Cancel,
    Delete,
    Done,
    Drain,
    ErrorReply,
    Get,
    Hello,
    Lend,
    Offload,
    Ping,
    Pong,
    Publish,
    Pull,
    Put,
    Register,
    Registered,
    Release,
    Reload,
    Renew,
    Reply,
    Request,
    Stats,
    StatsReply,
    Unpublish,
    Unregister,
    Welcome,
    decode_request,
    encode,
    salvage_req_id,
)

log = logging.getLogger(__name__)

# Requests ZeroMQ reads ahead for one client before it stops reading that connection
# (the client's sends wait; nothing is lost): with max_message_bytes, what one client can
# make the daemon hold before the loop takes them.
_MAX_QUEUED_REQUESTS = 16
# Replies queued for a client that does not read them: past this the client is cut off
# (its session closed) rather than buffered without end. Replies are ~100 bytes, and a
# client has a reply coming per request in flight: no client that reads falls this far
# behind.
_MAX_UNREAD_REPLIES = 100_000
# Segments (file descriptors, kept open) one session may hand over: each region's mapping
# holds one more while it lives. All sessions together are bounded by the daemon's
# descriptors (daemon/descriptors.py).
MAX_SEGMENTS_PER_SESSION = 4096
# The ZeroMQ handshake on a connection to a client's endpoint (local: it takes
# microseconds; one that stalls is the client's fault, and its lifeline expires anyway).
_HANDSHAKE_MS = 10_000
_NEVER_MS = 2**31 - 1  # ~25 days
# How long a cancel, or a session's close, waits for requests to stop (what they wait for
# once cancelled, a copy or the bytes on the wire, is bounded too: 60 s for a copy).
_CANCEL_WAIT_S = 90.0


@dataclass(eq=False)
class Session:
    sid: int
    identity: bytes  # the client's routing id on the ROUTER
    lifeline: Connection  # its lifeline: the session's life
    pid: int
    name: str
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    closing: bool = False
    segments: dict[int, int] = field(default_factory=dict)  # descriptors by segment id


def _level(session: Session) -> int:
    """A session's comings and goings are news, but the CLI's (one a `kvd status`)."""
    return logging.DEBUG if session.name == CLI_CLIENT_NAME else logging.INFO


class LocalServer:
    def __init__(self, config: Config, engine: Engine, ctx: zmq.Context[Any], epoch: int,
                 status: Callable[[], dict[str, Any]], budget: DescriptorBudget,
                 drain: Callable[[float | None], Awaitable[dict[str, Any]]] | None = None,
                 reload: Callable[[], dict[str, Any]] | None = None) -> None:
        self._status = status  # the daemon's report, for Stats
        self._drain_daemon = drain  # kvd drain; None: this daemon is not drained from here
        self._reload = reload  # kvd reload; None: nothing here to reload
        self.config = config
        self.engine = engine
        self.epoch = epoch
        self.bad_messages: dict[str, int] = {}
        # Bad messages are each answered and counted, and logged at most once per reason
        # every few seconds: a client sending nothing else cannot flood the log.
        self._bad_logs: dict[str, Throttled] = {}
        # By routing id, which is also the token of the session's lifeline.
        self.sessions: dict[bytes, Session] = {}
        self._next_sid = 1
        self._closers: set[asyncio.Task[None]] = set()
        self._drain_requests: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._reading_stopped = False  # draining or stopping: no new clients
        self._budget = budget
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone client: refused
        router.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        router.setsockopt(zmq.RCVHWM, _MAX_QUEUED_REQUESTS)
        router.setsockopt(zmq.SNDHWM, _MAX_UNREAD_REPLIES)
        router.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
        # A connection's endpoint is named by the number of the descriptor it was reached
        # through, held for the session and reused by a later client once it is closed.
        # With reconnecting off (-1), libzmq ends a lost connection's endpoint by its name,
        # later, from its I/O thread: that would end the next client's connection of the
        # same name (1 connect in 400 failed so, 4 threads connecting at once). So the
        # ROUTER may redial, but not within a session's life, and only the daemon ends an
        # endpoint (``_lifeline_closed``: before its descriptor is closed).
        router.setsockopt(zmq.RECONNECT_IVL, _NEVER_MS)
        self._router = LoopSocket(router, self.on_frames, self._loop, "local socket")
        self._lifelines = LifelineServer(config.socket_path, budget, self._reach,
                                         self.adopt_segments, self._lifeline_closed,
                                         self.count_bad)

    # ------------------------------------------------------------ lifecycle

    async def bind(self) -> None:
        path = self.config.socket_path
        # The path is this daemon's (service.py holds its PathClaim, in a directory it
        # checked); a socket that answers anyway is a daemon that takes no claim (an older
        # kvd): leave it alone too.
        if os.path.exists(path) and _socket_answers(path):
            raise ConfigError(f"socket_path: another daemon is serving {path}")
        try:
            self._lifelines.bind()
        except OSError as exc:
            raise ConfigError(f"socket_path: cannot listen on {path}: {exc}") from None
        self._router.start()

    async def close(self) -> None:
        if self._drain_requests:  # let the drain reports go out first
            await asyncio.wait(set(self._drain_requests), timeout=5.0)
        # No new clients, no new requests (replies still go out).
        self._reading_stopped = True
        self._lifelines.stop_accepting()
        self._router.pause()
        for session in list(self.sessions.values()):
            await self._close_session(session, "daemon stopping")
        if self._closers:
            await asyncio.wait(set(self._closers), timeout=5.0)
        # Replies already queued (a drain report, say) get a moment to leave: ZeroMQ's
        # I/O thread writes them while the context is destroyed. The lifelines close after
        # them (a client gives the replies of a daemon gone a moment to come: see
        # client/lifeline.py's LAST_WORDS_S).
        self._router.close(linger_s=0.5)
        self._lifelines.close()

    def pending_tasks(self) -> list[asyncio.Task[None]]:
        return [t for s in self.sessions.values() for t in s.tasks.values()]

    # ------------------------------------------------------------ reading

    def count_bad(self, reason: str) -> None:
        self.bad_messages[reason] = self.bad_messages.get(reason, 0) + 1

    def _bad(self, identity: bytes, reason: str, req_id: int, err: KvdError) -> None:
        self.count_bad(reason)
        self._bad_logs.setdefault(reason, Throttled(log)).warning(
            "bad message reason=%s req_id=%d: %s", reason, req_id, err.message)
        self._send(identity, ErrorReply(req_id=req_id, code=err.code, message=err.message))

    def on_frames(self, frames: list[bytes]) -> None:
        self.engine.busy_poll.touch()
        if self._reading_stopped:
            return
        identity = frames[0]
        if len(frames) != 2:
            self._bad(identity, "frames", 0, ProtocolError(
                f"a message is one frame, got {len(frames) - 1}"))
            return
        payload = frames[1]
        try:
            msg = decode_request(payload)
        except ProtocolError as err:
            self._bad(identity, "malformed", salvage_req_id(payload), err)
            return
        if isinstance(msg, Hello):
            self._hello(identity, msg)
            return
        session = self.sessions.get(identity)
        if session is None:
            self._bad(identity, "no_session", msg.req_id, DaemonUnavailable(
                "unknown client: say Hello first (the daemon may have restarted; "
                "registrations do not survive a restart, create a new client)"))
            return
        self._dispatch(session, msg)

    def _hello(self, identity: bytes, msg: Hello) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            self._bad(identity, "version", msg.req_id, ProtocolError(
                f"protocol version {msg.protocol_version} is not supported; this daemon "
                f"speaks version {PROTOCOL_VERSION}"))
            return
        if identity in self.sessions:
            self._bad(identity, "duplicate_hello", msg.req_id,
                      ProtocolError("this client already said hello"))
            return
        if self.engine.draining:
            self._send(identity, ErrorReply(req_id=msg.req_id, code="draining",
                                            message="daemon is draining: no new clients"))
            return
        lifeline = self._lifelines.claim(identity)
        if lifeline is None:  # (a bye's lifeline expired before a new hello)
            self._bad(identity, "no_lifeline", msg.req_id, ProtocolError(
                "this connection's lifeline is claimed or gone: connect again"))
            return
        session = Session(self._next_sid, identity, lifeline, msg.pid, msg.name)
        self._next_sid += 1
        self.sessions[identity] = session
        log.log(_level(session), "client connected session=%d pid=%d name=%s", session.sid,
                msg.pid, msg.name)
        self._send(identity, Welcome(
            req_id=msg.req_id, protocol_version=PROTOCOL_VERSION,
            node_id=self.config.node_id, epoch=self.epoch, daemon_version=__version__,
            max_message_bytes=self.config.max_message_bytes))

    def _reach(self, lifeline: Connection, fd: int) -> str:
        """Connect the ROUTER to a client's endpoint, through the descriptor ``fd`` of its
        socket file: '' once the connection is on its way (ZeroMQ queues the replies
        until it is up), or why not."""
        if self._reading_stopped or self.engine.draining:
            return "daemon is draining: no new clients"
        sock = self._router.sock
        try:
            sock.setsockopt(zmq.CONNECT_ROUTING_ID, lifeline.token)
            sock.connect(_endpoint(fd))
        except zmq.ZMQError as exc:
            return f"cannot connect to the endpoint: {exc}"
        return ""

    def _lifeline_closed(self, lifeline: Connection) -> None:
        """A lifeline closed: its connection goes, and its session closes."""
        if lifeline.endpoint_fd >= 0 and not self._router.closed:
            with contextlib.suppress(zmq.ZMQError):  # (ended already)
                self._router.sock.disconnect(_endpoint(lifeline.endpoint_fd))
        session = self.sessions.get(lifeline.token)
        if session is not None:
            self.start_close(session, "client disconnected")

    def adopt_segments(self, lifeline: Connection, ids: list[int], fds: list[int]) -> str:
        """A handoff on a session's lifeline: the session takes the descriptors (''), or
        nothing (the reason; the caller closes them)."""
        session = self.sessions.get(lifeline.token)
        if session is None or session.closing:
            return "the session of this connection is closed"
        new = {i for i in ids if i not in session.segments}
        if len(session.segments) + len(new) > MAX_SEGMENTS_PER_SESSION:
            return (f"a session holds at most {MAX_SEGMENTS_PER_SESSION} segments; "
                    "allocate larger tensors, or fewer")
        if not self._budget.take(PER_SEGMENT * len(new)):
            self.count_bad("descriptor_limit")
            return self._budget.refusal()
        for seg_id, fd in zip(ids, fds, strict=True):
            if seg_id in session.segments:  # handed twice: one is enough
                os.close(fd)
            else:
                session.segments[seg_id] = fd
        return ""

    # ------------------------------------------------------------ dispatch

    def _dispatch(self, s: Session, msg: Request) -> None:
        e = self.engine
        op = str(msg.__struct_config__.tag)
        timeline.mark(f"local.request.{op}")
        if msg.req_id in s.tasks:
            self._bad(s.identity, "duplicate_req_id", msg.req_id, ProtocolError(
                f"request {msg.req_id} is still pending; req_ids must be unique"))
            return
        try:
            match msg:
                case Ping():
                    self._send(s.identity, Pong(req_id=msg.req_id, node_id=self.config.node_id,
                                                epoch=self.epoch, draining=e.draining))
                case Stats():
                    self._send(s.identity, StatsReply(req_id=msg.req_id, stats=self._status()))
                case Register():
                    self._spawn(s, msg.req_id, op, self._register(s, msg))
                case Publish():
                    item = e.publish(s.sid, msg.key, msg.region_id, msg.ids, msg.ttl_s)
                    self._done(s, msg.req_id, item.nbytes)
                case Lend():
                    self._spawn(s, msg.req_id, op, e.lend(
                        s.sid, msg.key, msg.region_id, msg.ids, msg.ttl_s))
                case Unpublish():
                    e.unpublish(s.sid, msg.key)
                    self._done(s, msg.req_id)
                case Delete():
                    e.delete(s.sid, msg.key)
                    self._done(s, msg.req_id)
                case Bye():
                    # Answered once the session is closed: its requests have ended and no
                    # more bytes move in its blocks, which the client may then reuse.
                    self.start_close(s, "client said bye", reply_to=msg.req_id)
                case Get():
                    got = e.get(s.sid, msg.req_id, msg.key, msg.region_id, msg.ids,
                                msg.timeout_s, share=msg.share, into=msg.into)
                    self._spawn(s, msg.req_id, op, got if not msg.sender else
                                e.leases.get_watching(got, s.sid, msg.req_id, msg.key,
                                                      msg.sender, msg.timeout_s))
                case Put():
                    self._spawn(s, msg.req_id, op, e.put(
                        s.sid, msg.key, msg.region_id, msg.ids, msg.to, msg.ttl_s,
                        msg.timeout_s))
                case Pull():
                    self._spawn(s, msg.req_id, op, e.pull(
                        s.sid, msg.key, msg.src, msg.region_id, msg.ids, msg.timeout_s,
                        msg.wait_for_key_s, msg.share, msg.into))
                case Renew():
                    self._spawn(s, msg.req_id, op, e.leases.renew_at(
                        msg.key, msg.src, msg.ttl_s, msg.timeout_s))
                case Release():
                    self._spawn(s, msg.req_id, op, e.leases.release_at(
                        msg.key, msg.src, msg.timeout_s, msg.skip))
                case Offload():
                    self._spawn(s, msg.req_id, op, e.offload(
                        s.sid, msg.key, msg.region_id, msg.ids, msg.ttl_s))
                case Unregister():
                    self._spawn(s, msg.req_id, op, e.unregister(s.sid, msg.region_id))
                case Drain():
                    if self._drain_daemon is None:
                        raise ProtocolError("this daemon cannot be drained over its socket")
                    keep_task(self._drain_requests, self._drain(s, msg.req_id, msg.grace_s),
                              name="kvd-drain-request")
                case Cancel():
                    self._spawn(s, msg.req_id, op, self._cancel(s, msg.target))
                case Reload():
                    if self._reload is None:
                        raise ProtocolError("this daemon cannot be reloaded over its socket")
                    self._send(s.identity, StatsReply(req_id=msg.req_id, stats=self._reload()))
                case _:  # pragma: no cover - the decoder admits only the types above
                    raise ProtocolError(f"unsupported operation {op!r}")
            if msg.req_id not in s.tasks:  # answered inline (a task counts when it ends)
                e.counters.request(op, "ok")
        except KvdError as err:
            self._error(s, msg.req_id, op, err)
        except Exception as exc:
            log.exception("internal error op=%s req_id=%d", op, msg.req_id)
            self._error(s, msg.req_id, op, InternalError(f"{op} failed: {exc!r}"))

    def _spawn(self, s: Session, req_id: int, op: str, coro: Awaitable[Any]) -> None:
        task = self._loop.create_task(self._run(s, req_id, op, coro), name=f"kvd-{op}-{req_id}")
        s.tasks[req_id] = task

    async def _run(self, s: Session, req_id: int, op: str, coro: Awaitable[Any]) -> None:
        try:
            result = await coro
        except KvdError as err:
            self._error(s, req_id, op, err)
        except asyncio.CancelledError:
            if not s.closing:
                self._error(s, req_id, op, Cancelled(f"{op} request {req_id} was cancelled"))
        except Exception as exc:
            log.exception("internal error op=%s req_id=%d", op, req_id)
            self._error(s, req_id, op, InternalError(f"{op} failed: {exc!r}"))
        else:
            self.engine.counters.request(op, "ok")
            self._send(s.identity, result if isinstance(result, Registered) else
                       Done(req_id=req_id, nbytes=result if isinstance(result, int) else 0))
        finally:
            s.tasks.pop(req_id, None)

    async def _register(self, s: Session, msg: Register) -> Registered:
        r = await self.engine.register(s.sid, msg.name, msg.tensors, msg.block_dim,
                                       s.segments)
        return Registered(req_id=msg.req_id, region_id=r.region_id, num_blocks=r.num_blocks,
                          layout=list(r.layout))

    async def _drain(self, s: Session, req_id: int, grace_s: float | None) -> None:
        assert self._drain_daemon is not None
        report = await self._drain_daemon(grace_s)
        self.engine.counters.request("drain", "ok")
        self._send(s.identity, StatsReply(req_id=req_id, stats=report))

    async def _cancel(self, s: Session, target: int) -> int:
        """Done once ``target`` has ended: its reply went out first, and no more bytes
        land in (or are read from) its blocks. An error if it did not end in time."""
        task = s.tasks.get(target)
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=_CANCEL_WAIT_S)
            if not task.done():
                raise KvdTimeout(f"request {target} did not stop within "
                                 f"{_CANCEL_WAIT_S:g}s of its cancel; it may still move "
                                 "bytes")
        return 0

    # ------------------------------------------------------------ replies

    def _send(self, identity: bytes, msg: Reply) -> None:
        timeline.mark(f"local.reply.{msg.__struct_config__.tag}")
        if self._router.send((identity, encode(msg))):
            return
        # Refused: the client's queue of unread replies is full, or its connection is
        # gone (it closed it, or ZeroMQ ended it for a message over the hard limit).
        session = self.sessions.get(identity)
        if session is None or session.closing:
            return  # a client that is gone: its loss, not ours
        full = self._router.refused_errno == zmq.EAGAIN
        self.count_bad("unread_replies" if full else "connection_lost")
        log.warning("client session=%d %s: closing its session", session.sid,
                    f"stopped reading its replies ({_MAX_UNREAD_REPLIES} waiting)" if full
                    else "lost its connection to the local socket")
        self.start_close(session, "cut off")
        self._lifelines.cut(session.lifeline)  # (its client sees its daemon gone)

    def _done(self, s: Session, req_id: int, nbytes: int = 0) -> None:
        self._send(s.identity, Done(req_id=req_id, nbytes=nbytes))

    def _error(self, s: Session, req_id: int, op: str, err: KvdError) -> None:
        self.engine.counters.request(op, err.code)
        log.info("request failed op=%s req_id=%d session=%d code=%s: %s",
                 op, req_id, s.sid, err.code, err.message)
        self._send(s.identity, ErrorReply(req_id=req_id, code=err.code, message=err.message))

    # ------------------------------------------------------------ sessions

    def start_close(self, session: Session, reason: str, reply_to: int | None = None) -> None:
        keep_task(self._closers, self._close_session(session, reason, reply_to))

    async def _close_session(self, session: Session, reason: str,
                             reply_to: int | None = None) -> None:
        if session.closing:
            return
        session.closing = True
        self.sessions.pop(session.identity, None)
        if reply_to is not None:  # (after bye the client may say hello again on it)
            self._lifelines.release(session.lifeline)
        tasks = list(session.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CANCEL_WAIT_S)
        await self.engine.drop_session(session.sid, reason)
        for fd in session.segments.values():  # the regions' mappings hold their own
            os.close(fd)
        self._budget.give(PER_SEGMENT * len(session.segments))
        session.segments.clear()
        log.log(_level(session), "client gone session=%d pid=%d reason=%s", session.sid,
                session.pid, reason)
        if reply_to is not None:
            if any(not t.done() for t in tasks):  # not confirmed: the client says so
                self._send(session.identity, ErrorReply(
                    req_id=reply_to, code=KvdTimeout.code, message=(
                        f"requests of the session did not stop within {_CANCEL_WAIT_S:g}s; "
                        "they may still move bytes")))
            else:
                self._done(session, reply_to)

    def stats(self) -> dict[str, Any]:
        """This socket's part of the daemon's status."""
        return {"clients": len(self.sessions), "bad_messages": dict(self.bad_messages),
                "in_flight": len(self.pending_tasks())}

def _endpoint(fd: int) -> str:
    """A client's endpoint, reached through the descriptor of its socket file (it lives in
    a directory only the client may enter, and may be unlinked already)."""
    return f"ipc:///proc/self/fd/{fd}"


def _socket_answers(path: str) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
