"""The local socket: a Unix stream socket serving the inference processes of a node.

Messages are length-prefixed msgspec messages (``kvd.framing``). Each connection's bytes
are cut into messages right in the loop's read callback, and quick requests are answered
there; long ones (get, put, offload, unregister, cancel) become tasks that reply when they
finish. Every malformed message gets an ``ErrorReply`` and a count in ``bad_messages``;
nothing a client sends can stop the server.

A client is a *session*: one connection, opened by ``Hello``. A client that dies closes its
connection, which the daemon sees at once: its pending requests are cancelled, its regions
and its keys without a TTL are released, its shared-memory files unlinked. A client that
stops reading its replies is cut off once ``_MAX_UNREAD_REPLY_BYTES`` of them wait.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from kvd import __version__, timeline
from kvd.config import Config, socket_dir_problem
from kvd.daemon.accepting import Acceptor, Throttled
from kvd.daemon.engine import Engine
from kvd.daemon.segment_server import SegmentServer, segment_socket_path
from kvd.daemon.socket_files import BoundFile, bind_unix, remove_bound
from kvd.errors import (
    Cancelled,
    ConfigError,
    DaemonUnavailable,
    InternalError,
    KvdError,
    KvdTimeout,
    ProtocolError,
)
from kvd.framing import FrameBudget, FramedProtocol, Oversized
from kvd.protocol import (
    PROTOCOL_VERSION,
    SEGMENT_TOKEN_BYTES,
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

# A request longer than max_message_bytes gets an error reply with its req_id; one longer
# than this is refused as soon as its length arrives, and skipped, never held in memory.
_SKIP_ABOVE_BYTES = 64 * 1024 * 1024
# Replies waiting in the kernel and the transport for a client that does not read them:
# past this the client is cut off (its session closed) rather than buffered without end.
# Replies are ~100 bytes: no client that reads falls this far behind.
_MAX_UNREAD_REPLY_BYTES = 16 * 1024 * 1024
# Segments (file descriptors, kept open) one session may hand over: each region's mapping
# holds one more while it lives. LimitNOFILE in the systemd unit leaves room for many.
MAX_SEGMENTS_PER_SESSION = 4096
# How long a cancel, or a session's close, waits for requests to stop (what they wait for
# once cancelled, a copy or the bytes on the wire, is bounded too: 60 s for a copy).
_CANCEL_WAIT_S = 90.0


class _Replied:
    """A task's result when it sent its own (typed) reply."""


_REPLIED = _Replied()


class _Connection(FramedProtocol):
    """One client connection: requests in, to the server; replies out."""

    def __init__(self, server: LocalServer) -> None:
        super().__init__(server.config.max_message_bytes, _SKIP_ABOVE_BYTES,
                         write_limit=_MAX_UNREAD_REPLY_BYTES, budget=server.frame_budget,
                         bad_messages=server.bad_messages, what="local socket")
        self.server = server
        self.session: Session | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)

    def on_frame(self, item: bytes | Oversized) -> None:
        self.server.on_message(self, item)

    def pause_writing(self) -> None:
        # The client stopped reading its replies: cut it off (see _MAX_UNREAD_REPLY_BYTES).
        self.server.count_bad("unread_replies")
        log.warning("client session=%s stopped reading its replies (%d bytes waiting): "
                    "closing its connection",
                    self.session.sid if self.session else "-", _MAX_UNREAD_REPLY_BYTES)
        self.close(abort=True)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.server.connections.discard(self)
        if self.session is not None:
            self.server.start_close(self.session, "client disconnected")


@dataclass(eq=False)
class Session:
    sid: int
    conn: _Connection
    pid: int
    name: str
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    closing: bool = False
    # The secret its segment handoffs carry (Welcome), and the segments handed over:
    # descriptors by id, closed with the session.
    token: bytes = b""
    segments: dict[int, int] = field(default_factory=dict)


class LocalServer:
    def __init__(self, config: Config, engine: Engine, epoch: int,
                 daemon: Any = None, frame_budget: FrameBudget | None = None) -> None:
        self.daemon = daemon  # for the peer plane's figures in stats
        self.frame_budget = frame_budget  # shared with the peer port (kvd.framing)
        self.config = config
        self.engine = engine
        self.epoch = epoch
        self.bad_messages: dict[str, int] = {}
        # Bad messages are each answered and counted, and logged at most once per reason
        # every few seconds: a client sending nothing else cannot flood the log.
        self._bad_logs: dict[str, Throttled] = {}
        self.sessions: dict[_Connection, Session] = {}
        self.connections: set[_Connection] = set()
        self._next_sid = 1
        self._closers: set[asyncio.Task[None]] = set()
        self._drain_requests: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._server: Acceptor | None = None  # accepts on the local socket
        self._accepting: set[asyncio.Task[None]] = set()
        self._reading_stopped = False  # draining or stopping: no new clients
        self._by_token: dict[bytes, Session] = {}
        self.segment_socket = segment_socket_path(config.socket_path)
        self._bound: BoundFile | None = None  # the socket file bound here: removed at close
        self._segments = SegmentServer(self.segment_socket, self._loop, self.adopt_segments,
                                       self.count_bad)

    # ------------------------------------------------------------ lifecycle

    async def bind(self) -> None:
        path = self.config.socket_path
        # The path is this daemon's (service.py holds its PathClaim); a socket that answers
        # anyway is a daemon that takes no claim (an older kvd): leave it alone too.
        if os.path.exists(path) and _socket_answers(path):
            raise ConfigError(f"socket_path: another daemon is serving {path}")
        prepare_socket_dir(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o117)  # socket mode 0660
        try:
            # (a socket file there was left by a daemon that died: a live one answered above)
            self._bound = bind_unix(sock, path)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"socket_path: cannot listen on {path}: {exc}") from None
        finally:
            os.umask(old_umask)
        try:
            self._segments.bind()
        except OSError as exc:
            sock.close()
            raise ConfigError(f"socket_path: cannot listen on {self.segment_socket}: "
                              f"{exc}") from None
        sock.setblocking(False)
        self._server = Acceptor(sock, "socket_path", self._take)
        log.info("local socket listening path=%s", path)

    def _take(self, sock: socket.socket, _addr: Any) -> None:
        task = self._loop.create_task(self._admit(sock))
        self._accepting.add(task)
        task.add_done_callback(self._accepting.discard)

    async def _admit(self, sock: socket.socket) -> None:
        try:
            transport, _ = await self._loop.connect_accepted_socket(
                lambda: _Connection(self), sock)
        except OSError as exc:
            log.info("client connection lost before it was taken: %s", exc)
            sock.close()
            return
        if self._reading_stopped:  # accepted just before a drain began: not served
            transport.close()

    def stop_reading(self) -> None:
        """No new clients, no new requests (replies still go out)."""
        self._reading_stopped = True
        if self._server is not None:
            self._server.close()
        for conn in self.connections:
            if conn.transport is not None:
                conn.transport.pause_reading()

    async def close(self) -> None:
        if self._drain_requests:  # let the drain reports go out first
            await asyncio.wait(set(self._drain_requests), timeout=5.0)
        self.stop_reading()
        await asyncio.to_thread(self._segments.close)
        for session in list(self.sessions.values()):
            await self._close_session(session, "daemon stopping")
        if self._closers:
            await asyncio.wait(set(self._closers), timeout=5.0)
        # Replies already queued (a drain report, say) get a moment to leave.
        deadline = self._loop.time() + 0.5
        for conn in list(self.connections):
            transport = conn.transport
            while (transport is not None and transport.get_write_buffer_size()
                   and self._loop.time() < deadline):
                await asyncio.sleep(0.01)
            if transport is not None:
                transport.close()
        remove_bound(self._bound)  # ours only: a daemon refused at start bound none
        self._bound = None

    def pending_tasks(self) -> list[asyncio.Task[None]]:
        return [t for s in self.sessions.values() for t in s.tasks.values()]

    # ------------------------------------------------------------ reading

    def count_bad(self, reason: str) -> None:
        self.bad_messages[reason] = self.bad_messages.get(reason, 0) + 1

    def _bad(self, conn: _Connection, reason: str, req_id: int, err: KvdError) -> None:
        self.count_bad(reason)
        self._bad_logs.setdefault(reason, Throttled(log)).warning(
            "bad message reason=%s req_id=%d: %s", reason, req_id, err.message)
        self._send(conn, ErrorReply(req_id=req_id, code=err.code, message=err.message))

    def on_message(self, conn: _Connection, payload: bytes | Oversized) -> None:
        self.engine.busy_poll.touch()
        if isinstance(payload, Oversized):
            self._bad(conn, "too_large", salvage_req_id(payload.payload), ProtocolError(
                f"message of {payload.nbytes} bytes exceeds max_message_bytes "
                f"{self.config.max_message_bytes}"))
            return
        try:
            msg = decode_request(payload)
        except ProtocolError as err:
            self._bad(conn, "malformed", salvage_req_id(payload), err)
            return
        if isinstance(msg, Hello):
            self._hello(conn, msg)
            return
        session = conn.session
        if session is None:
            self._bad(conn, "no_session", msg.req_id, DaemonUnavailable(
                "unknown client: say Hello first (the daemon may have restarted; "
                "registrations do not survive a restart, create a new client)"))
            return
        self._dispatch(session, msg)

    def _hello(self, conn: _Connection, msg: Hello) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            self._bad(conn, "version", msg.req_id, ProtocolError(
                f"protocol version {msg.protocol_version} is not supported; this daemon "
                f"speaks version {PROTOCOL_VERSION}"))
            return
        if conn.session is not None:
            self._bad(conn, "duplicate_hello", msg.req_id,
                      ProtocolError("this client already said hello"))
            return
        if self.engine.draining:
            self._send(conn, ErrorReply(req_id=msg.req_id, code="draining",
                                        message="daemon is draining: no new clients"))
            return
        session = Session(self._next_sid, conn, msg.pid, msg.name,
                          token=secrets.token_bytes(SEGMENT_TOKEN_BYTES))
        self._next_sid += 1
        conn.session = session
        self.sessions[conn] = session
        self._by_token[session.token] = session
        log.info("client connected session=%d pid=%d name=%s", session.sid, msg.pid, msg.name)
        self._send(conn, Welcome(
            req_id=msg.req_id, protocol_version=PROTOCOL_VERSION,
            node_id=self.config.node_id, epoch=self.epoch, daemon_version=__version__,
            segment_socket=self.segment_socket, segment_token=session.token))

    def adopt_segments(self, token: bytes, ids: list[int], fds: list[int]) -> str:
        """A handoff from the segment socket (on the loop): the session ``token`` names
        takes the descriptors (''), or nothing (the reason; the caller closes them)."""
        session = self._by_token.get(token)
        if session is None or session.closing:
            return "unknown session (say hello on the local socket first)"
        new = [i for i in ids if i not in session.segments]
        if len(session.segments) + len(new) > MAX_SEGMENTS_PER_SESSION:
            return (f"a session holds at most {MAX_SEGMENTS_PER_SESSION} segments; "
                    "allocate larger tensors, or fewer")
        for seg_id, fd in zip(ids, fds, strict=True):
            if seg_id in session.segments:  # handed twice (two threads): one is enough
                os.close(fd)
            else:
                session.segments[seg_id] = fd
        return ""

    # ------------------------------------------------------------ dispatch

    def _dispatch(self, s: Session, msg: Any) -> None:
        e = self.engine
        op = msg.__struct_config__.tag
        timeline.mark(f"local.request.{op}")
        if msg.req_id in s.tasks:
            self._bad(s.conn, "duplicate_req_id", msg.req_id, ProtocolError(
                f"request {msg.req_id} is still pending; req_ids must be unique"))
            return
        try:
            match msg:
                case Ping():
                    self._send(s.conn, Pong(req_id=msg.req_id, node_id=self.config.node_id,
                                                epoch=self.epoch, draining=e.draining))
                case Stats():
                    stats = self.daemon.status() if self.daemon is not None else self.stats()
                    self._send(s.conn, StatsReply(req_id=msg.req_id, stats=stats))
                case Register():
                    self._spawn(s, msg.req_id, op, self._register(s, msg))
                case Publish():
                    n = e.publish(s.sid, msg.key, msg.region_id, msg.ids, msg.ttl_s)
                    self._done(s, msg.req_id, n)
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
                    self._spawn(s, msg.req_id, op, e.get(
                        s.sid, msg.req_id, msg.key, msg.region_id, msg.ids, msg.timeout_s))
                case Put():
                    self._spawn(s, msg.req_id, op, e.put(
                        s.sid, msg.key, msg.region_id, msg.ids, msg.to, msg.ttl_s,
                        msg.timeout_s))
                case Pull():
                    self._spawn(s, msg.req_id, op, e.pull(
                        s.sid, msg.key, msg.src, msg.region_id, msg.ids, msg.timeout_s,
                        msg.wait_for_key_s))
                case Offload():
                    self._spawn(s, msg.req_id, op, e.offload(
                        s.sid, msg.key, msg.region_id, msg.ids, msg.ttl_s))
                case Unregister():
                    self._spawn(s, msg.req_id, op, e.unregister(s.sid, msg.region_id))
                case Drain():
                    if self.daemon is None:
                        raise ProtocolError("this daemon cannot be drained over its socket")
                    task = self._loop.create_task(self._drain(s, msg.req_id, msg.grace_s),
                                                  name="kvd-drain-request")
                    self._drain_requests.add(task)
                    task.add_done_callback(self._drain_requests.discard)
                case Cancel():
                    self._spawn(s, msg.req_id, op, self._cancel(s, msg.target))
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
            if result is not _REPLIED:
                self._done(s, req_id, result if isinstance(result, int) else 0)
        finally:
            s.tasks.pop(req_id, None)

    async def _register(self, s: Session, msg: Register) -> _Replied:
        r = await self.engine.register(s.sid, msg.name, msg.tensors, msg.block_dim,
                                       s.segments)
        self._send(s.conn, Registered(req_id=msg.req_id, region_id=r.region_id,
                                          num_blocks=r.num_blocks, layout=list(r.layout)))
        return _REPLIED

    async def _drain(self, s: Session, req_id: int, grace_s: float | None) -> None:
        report = await self.daemon.drain_on_request(grace_s)
        self.engine.counters.request("drain", "ok")
        self._send(s.conn, StatsReply(req_id=req_id, stats=report))

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

    def _send(self, conn: _Connection, msg: Any) -> None:
        timeline.mark(f"local.reply.{msg.__struct_config__.tag}")
        conn.send(encode(msg))  # a client that is gone: its loss, not ours

    def _done(self, s: Session, req_id: int, nbytes: int = 0) -> None:
        self._send(s.conn, Done(req_id=req_id, nbytes=nbytes))

    def _error(self, s: Session, req_id: int, op: str, err: KvdError) -> None:
        self.engine.counters.request(op, err.code)
        log.info("request failed op=%s req_id=%d session=%d code=%s: %s",
                 op, req_id, s.sid, err.code, err.message)
        self._send(s.conn, ErrorReply(req_id=req_id, code=err.code, message=err.message))

    # ------------------------------------------------------------ sessions

    def start_close(self, session: Session, reason: str, reply_to: int | None = None) -> None:
        task = self._loop.create_task(self._close_session(session, reason, reply_to))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def _close_session(self, session: Session, reason: str,
                             reply_to: int | None = None) -> None:
        if session.closing:
            return
        session.closing = True
        self.sessions.pop(session.conn, None)
        if session.conn.session is session:
            session.conn.session = None  # the connection may say hello again (after bye)
        tasks = list(session.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CANCEL_WAIT_S)
        await self.engine.drop_session(session.sid, reason)
        self._by_token.pop(session.token, None)
        for fd in session.segments.values():  # the regions' mappings hold their own
            os.close(fd)
        session.segments.clear()
        log.info("client gone session=%d pid=%d reason=%s", session.sid, session.pid, reason)
        if reply_to is not None:
            if any(not t.done() for t in tasks):  # not confirmed: the client says so
                self._send(session.conn, ErrorReply(
                    req_id=reply_to, code=KvdTimeout.code, message=(
                        f"requests of the session did not stop within {_CANCEL_WAIT_S:g}s; "
                        "they may still move bytes")))
            else:
                self._done(session, reply_to)

    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        stats["clients"] = len(self.sessions)
        stats["bad_messages"] = dict(self.bad_messages)
        if self.frame_budget is not None:
            stats["frame_budget"] = self.frame_budget.stats()
        stats["epoch"] = self.epoch
        stats["in_flight"] = len(self.pending_tasks())
        peers = getattr(self.daemon, "peers", None)
        transfers = getattr(self.daemon, "transfers", None)
        if peers is not None and transfers is not None:
            stats["peer"] = peers.stats()
            stats["transfers"] = transfers.stats()
        return stats


def prepare_socket_dir(path: str) -> None:
    """Create the socket's directory, and refuse one that another user could change
    (``socket_dir_problem``: checked once it exists, so one made meanwhile by someone else
    is caught too). First thing at startup: an unusable path is a config error before
    anything else happens."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o750, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"socket_path: cannot create the directory of {path}: "
                          f"{exc.strerror}") from None
    problem = socket_dir_problem(directory)
    if problem:
        raise ConfigError(f"socket_path: {problem}")


def _socket_answers(path: str) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
