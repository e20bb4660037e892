"""The local socket: a ZMQ ROUTER on ``ipc://`` serving the inference processes of a node.

One reader coroutine takes messages off the socket with non-blocking receives and answers
quick requests inline; long ones (get, put, offload, unregister, cancel) become tasks that
reply when they finish. Every malformed message gets an ``ErrorReply`` and a count in
``bad_messages``; nothing a client sends can stop the reader.

A client is a *session*, opened by ``Hello``. A client that dies is noticed at once: a
socket monitor reports the closed connection's file descriptor, and the session that
said hello on that descriptor is closed: its pending requests are cancelled, its regions
and its keys without a TTL are released, its shared-memory files unlinked. The monitor is
always drained before the next client message is read, so a descriptor number reused by
a new client can never be mistaken for the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvd import __version__, timeline
from kvd.config import Config
from kvd.daemon.engine import Engine
from kvd.errors import (
    Cancelled,
    ConfigError,
    DaemonUnavailable,
    InternalError,
    KvdError,
    ProtocolError,
)
from kvd.protocol import (
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

# A frame larger than this closes the connection inside ZMQ; frames between
# max_message_bytes and this get an error reply. Keeps a runaway client from making the
# daemon buffer gigabytes.
HARD_FRAME_LIMIT = 64 * 1024 * 1024
_BATCH = 256


class _Replied:
    """A task's result when it sent its own (typed) reply."""


_REPLIED = _Replied()


@dataclass(eq=False)
class Session:
    sid: int
    identity: bytes
    pid: int
    name: str
    fd: int
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    closing: bool = False


class LocalServer:
    def __init__(self, config: Config, engine: Engine, ctx: zmq.Context[Any], epoch: int,
                 daemon: Any = None) -> None:
        self.daemon = daemon  # for the peer plane's figures in stats
        self.config = config
        self.engine = engine
        self.epoch = epoch
        self.endpoint = f"ipc://{config.socket_path}"
        self.bad_messages: dict[str, int] = {}
        self.sessions: dict[bytes, Session] = {}
        self._by_fd: dict[int, Session] = {}
        self._owed_disconnects: dict[int, int] = {}  # fd -> events to ignore (see _hello)
        self._next_sid = 1
        self._closers: set[asyncio.Task[None]] = set()
        self._drain_requests: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._reading = False
        self._read_queued = False  # a _read is scheduled with call_soon
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        path = self.config.socket_path
        if os.path.exists(path) and _socket_answers(path):
            raise ConfigError(f"socket_path: another daemon is serving {path}")
        old_umask = os.umask(0o117)  # socket mode 0660
        try:
            prepare_socket_dir(path)
            # A socket file left by a daemon that died (a live one answered above).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self._sock.bind(self.endpoint)
        except (OSError, zmq.ZMQError) as exc:
            raise ConfigError(f"socket_path: cannot listen on {path}: {exc}") from None
        finally:
            os.umask(old_umask)
        self._reading = True
        for sock in (self._sock, self._monitor):
            self._loop.add_reader(sock.getsockopt(zmq.FD), self._read)
        self._read_soon()  # anything that came before we watched
        log.info("local socket listening endpoint=%s", self.endpoint)

    def stop_reading(self) -> None:
        self._reading = False

    async def close(self) -> None:
        if self._drain_requests:  # let the drain reports go out first
            await asyncio.wait(set(self._drain_requests), timeout=5.0)
        self.stop_reading()
        for session in list(self.sessions.values()):
            await self._close_session(session, "daemon stopping", unlink_files=False)
        if self._closers:
            await asyncio.wait(set(self._closers), timeout=5.0)
        for sock in (self._sock, self._monitor):
            with contextlib.suppress(Exception):
                self._loop.remove_reader(sock.getsockopt(zmq.FD))
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        # Replies already queued (a drain report, say) get a moment to leave.
        self._sock.close(linger=500)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.config.socket_path)

    def pending_tasks(self) -> list[asyncio.Task[None]]:
        return [t for s in self.sessions.values() for t in s.tasks.values()]

    # ------------------------------------------------------------ reading

    def _read(self) -> None:
        """Read what is waiting, right in the loop's reader callback (no task to wake: one
        loop turn less per request). ZeroMQ's descriptor is edge-triggered, so read until
        empty; after ``_BATCH`` messages, let other callbacks run and come back."""
        self._read_queued = False
        if not self._reading:
            return
        self._drain_monitor()
        for _ in range(_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed under us
                return
            try:
                self._on_message(frames)
            except Exception:  # a bug must not stop the reader
                log.exception("unhandled error in local message handler")
        self._read_soon()

    def _read_soon(self) -> None:
        if not self._read_queued:
            self._read_queued = True
            self._loop.call_soon(self._read)

    def _drain_monitor(self) -> None:
        while self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                msg = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(msg)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                fd = event["value"]
                if self._owed_disconnects.get(fd):
                    # The connection this event is about was already taken for gone when
                    # a new client said hello on its descriptor (see _hello).
                    self._owed_disconnects[fd] -= 1
                    continue
                session = self._by_fd.pop(fd, None)
                if session is not None:
                    self._start_close(session, "client disconnected", unlink_files=True)

    def _bad(self, identity: bytes, reason: str, req_id: int, err: KvdError) -> None:
        self.bad_messages[reason] = self.bad_messages.get(reason, 0) + 1
        log.warning("bad message reason=%s req_id=%d: %s", reason, req_id, err.message)
        self._send(identity, ErrorReply(req_id=req_id, code=err.code, message=err.message))

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) != 2:
            self._bad(identity, "frames", 0,
                      ProtocolError(f"expected one frame per message, got {len(frames) - 1}"))
            return
        payload = frames[1].buffer
        if len(payload) > self.config.max_message_bytes:
            self._bad(identity, "too_large", salvage_req_id(payload), ProtocolError(
                f"message of {len(payload)} bytes exceeds max_message_bytes "
                f"{self.config.max_message_bytes}"))
            return
        try:
            msg = decode_request(payload)
        except ProtocolError as err:
            self._bad(identity, "malformed", salvage_req_id(payload), err)
            return
        if isinstance(msg, Hello):
            self._hello(identity, msg, frames[1].get(zmq.SRCFD))
            return
        session = self.sessions.get(identity)
        if session is None:
            self._bad(identity, "no_session", msg.req_id, DaemonUnavailable(
                "unknown client: say Hello first (the daemon may have restarted; "
                "registrations do not survive a restart, create a new client)"))
            return
        self._dispatch(session, msg)

    def _hello(self, identity: bytes, msg: Hello, fd: int) -> None:
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
        # A new connection may reuse the descriptor of one that just closed: the old one's
        # DISCONNECTED event must end the old session, not this one. Take the events
        # waiting now; if the descriptor still names another session, that connection is
        # gone (one descriptor, one connection): end it, and ignore its event when it comes.
        self._drain_monitor()
        stale = self._by_fd.pop(fd, None)
        if stale is not None:
            self._owed_disconnects[fd] = self._owed_disconnects.get(fd, 0) + 1
            self._start_close(stale, "client disconnected", unlink_files=True)
        session = Session(self._next_sid, identity, msg.pid, msg.name, fd)
        self._next_sid += 1
        self.sessions[identity] = session
        self._by_fd[fd] = session
        log.info("client connected session=%d pid=%d name=%s", session.sid, msg.pid, msg.name)
        self._send(identity, Welcome(
            req_id=msg.req_id, protocol_version=PROTOCOL_VERSION,
            node_id=self.config.node_id, epoch=self.epoch, daemon_version=__version__))

    # ------------------------------------------------------------ dispatch

    def _dispatch(self, s: Session, msg: Any) -> None:
        e = self.engine
        op = msg.__struct_config__.tag
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
                    stats = self.daemon.status() if self.daemon is not None else self.stats()
                    self._send(s.identity, StatsReply(req_id=msg.req_id, stats=stats))
                case Register():
                    self._spawn(s, msg.req_id, op, self._register(s, msg))
                case Publish():
                    n = e.publish(s.sid, msg.key, msg.region_id, msg.blocks, msg.ttl_s)
                    self._done(s, msg.req_id, n)
                case Lend():
                    self._spawn(s, msg.req_id, op, e.lend(
                        s.sid, msg.key, msg.region_id, msg.blocks, msg.ttl_s))
                case Unpublish():
                    e.unpublish(s.sid, msg.key)
                    self._done(s, msg.req_id)
                case Delete():
                    e.delete(s.sid, msg.key)
                    self._done(s, msg.req_id)
                case Bye():
                    self._done(s, msg.req_id)
                    self._start_close(s, "client said bye", unlink_files=False)
                case Get():
                    self._spawn(s, msg.req_id, op, e.get(
                        s.sid, msg.req_id, msg.key, msg.region_id, msg.blocks, msg.timeout_s))
                case Put():
                    self._spawn(s, msg.req_id, op, e.put(
                        s.sid, msg.key, msg.region_id, msg.blocks, msg.to, msg.ttl_s,
                        msg.timeout_s))
                case Pull():
                    self._spawn(s, msg.req_id, op, e.pull(
                        s.sid, msg.key, msg.src, msg.region_id, msg.blocks, msg.timeout_s))
                case Offload():
                    self._spawn(s, msg.req_id, op, e.offload(
                        s.sid, msg.key, msg.region_id, msg.blocks, msg.ttl_s))
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
        r = await self.engine.register(s.sid, msg.name, msg.tensors, msg.block_dim)
        self._send(s.identity, Registered(req_id=msg.req_id, region_id=r.region_id,
                                          num_blocks=r.num_blocks, layout=list(r.layout)))
        return _REPLIED

    async def _drain(self, s: Session, req_id: int, grace_s: float | None) -> None:
        report = await self.daemon.drain_on_request(grace_s)
        self.engine.counters.request("drain", "ok")
        self._send(s.identity, StatsReply(req_id=req_id, stats=report))

    async def _cancel(self, s: Session, target: int) -> int:
        task = s.tasks.get(target)
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=90.0)
        return 0

    # ------------------------------------------------------------ replies

    def _send(self, identity: bytes, msg: Any) -> None:
        timeline.mark(f"local.reply.{msg.__struct_config__.tag}")
        try:
            self._sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # client gone or its queue full: its loss, not ours
            log.debug("reply dropped: %s", exc)
        # A send can consume the socket's edge-triggered readiness: if input is waiting,
        # make sure the reader looks again.
        if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._read_soon()

    def _done(self, s: Session, req_id: int, nbytes: int = 0) -> None:
        self._send(s.identity, Done(req_id=req_id, nbytes=nbytes))

    def _error(self, s: Session, req_id: int, op: str, err: KvdError) -> None:
        self.engine.counters.request(op, err.code)
        log.info("request failed op=%s req_id=%d session=%d code=%s: %s",
                 op, req_id, s.sid, err.code, err.message)
        self._send(s.identity, ErrorReply(req_id=req_id, code=err.code, message=err.message))

    # ------------------------------------------------------------ sessions

    def _start_close(self, session: Session, reason: str, *, unlink_files: bool) -> None:
        task = self._loop.create_task(self._close_session(session, reason, unlink_files))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def _close_session(self, session: Session, reason: str, unlink_files: bool) -> None:
        if session.closing:
            return
        session.closing = True
        self.sessions.pop(session.identity, None)
        if self._by_fd.get(session.fd) is session:
            del self._by_fd[session.fd]
        tasks = list(session.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=90.0)
        files = await self.engine.drop_session(session.sid, reason)
        if unlink_files:
            for path in files:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as exc:  # e.g. another user's file in sticky /dev/shm
                    log.warning("cannot unlink %s of a dead client: %s", path, exc.strerror)
        log.info("client gone session=%d pid=%d reason=%s", session.sid, session.pid, reason)

    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        stats["clients"] = len(self.sessions)
        stats["bad_messages"] = dict(self.bad_messages)
        stats["epoch"] = self.epoch
        stats["in_flight"] = len(self.pending_tasks())
        peers = getattr(self.daemon, "peers", None)
        transfers = getattr(self.daemon, "transfers", None)
        if peers is not None and transfers is not None:
            stats["peer"] = peers.stats()
            stats["transfers"] = transfers.stats()
        return stats


def prepare_socket_dir(path: str) -> None:
    """Create the socket's directory (first thing at startup: an unusable path is a
    config error before anything else happens)."""
    try:
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"socket_path: cannot create the directory of {path}: "
                          f"{exc.strerror}") from None


def _socket_answers(path: str) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
