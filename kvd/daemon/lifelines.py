"""The segment socket: each client's lifeline, and the way its CPU segments come over.

A client connects to ``<socket_path>.seg`` (a Unix ``SOCK_SEQPACKET`` socket next to the
local socket, same directory, same mode) before it says hello, and the daemon answers with
a ``Lifeline`` token; the client's ``Hello`` on the local socket presents it, and the
session it opens lives as long as this connection does. Both ends keep it open:

- A client that dies, however it dies, closes it: the daemon closes its session at once
  (its requests cancelled, its regions, keys and descriptors released).
- A daemon that dies closes it too: the client fails its calls at once instead of
  waiting out their timeouts.

Why a socket beside ZeroMQ: a ZeroMQ DEALER reconnects silently and tells nobody that its
peer went away, and the ROUTER's socket monitor names a closed connection only by its
file descriptor, read from a queue of its own apart from the messages: a descriptor
number reused by a new client can be taken for the old one. And ZeroMQ cannot carry file
descriptors, which this socket does: the memfd segments of a client's CPU tensors travel
as ``SCM_RIGHTS`` with a ``SegmentHandoff`` (one descriptor per segment id), answered by
one ``SegmentsTaken``.

Everything runs on the event loop: an ``Acceptor`` takes connections, ``add_reader``
watches each. Connections not claimed by a hello are bounded (``MAX_UNCLAIMED``) and
closed after ``CLAIM_TIMEOUT_S``. Nothing from the socket is trusted: a handoff is
decoded with msgspec against its type, a descriptor must be a regular file sealed against
shrinking (so no mapping of it can ever end in SIGBUS), and every refusal is answered,
counted in ``bad_messages["segments"]``, and closes the descriptors it came with.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable

import msgspec

from kvd.daemon.accepting import Acceptor, Throttled
from kvd.daemon.socket_files import BoundFile, bind_unix, remove_bound
from kvd.errors import BadRequest
from kvd.memory.segments import check_segment
from kvd.protocol import (
    MAX_SEGMENTS_PER_HANDOFF,
    SEGMENT_TOKEN_BYTES,
    Lifeline,
    SegmentHandoff,
    SegmentsTaken,
)

log = logging.getLogger(__name__)

# Connections whose token no hello has presented yet, and how long one may wait for it:
# a client says hello right after it connects; a flood of connections that never do
# cannot take every descriptor the daemon has.
MAX_UNCLAIMED = 64
CLAIM_TIMEOUT_S = 10.0
_MAX_MESSAGE_BYTES = 4096
_decoder = msgspec.msgpack.Decoder(SegmentHandoff)


class Connection:
    """One client's connection to the segment socket."""

    def __init__(self, sock: socket.socket, token: bytes) -> None:
        self.sock = sock
        self.token = token
        self.claimed = False
        self.closed = False
        self.expiry: asyncio.TimerHandle | None = None


class LifelineServer:
    """Serves ``path`` on the running loop.

    ``on_handoff(conn, ids, fds)`` gives a claimed connection's session the descriptors
    and returns '' (they are the session's now) or why not (they are closed here).
    ``on_lost(conn)``: a claimed connection closed (the client is gone)."""

    def __init__(self, path: str,
                 on_handoff: Callable[[Connection, list[int], list[int]], str],
                 on_lost: Callable[[Connection], None],
                 count_bad: Callable[[str], None]) -> None:
        self.path = path
        self._on_handoff = on_handoff
        self._on_lost = on_lost
        self._count_bad = count_bad
        self._loop = asyncio.get_running_loop()
        self._acceptor: Acceptor | None = None
        self._unclaimed: dict[bytes, Connection] = {}
        self._conns: set[Connection] = set()
        self._bound: BoundFile | None = None  # the socket file bound here: removed at close
        self._refusing = Throttled(log)

    def bind(self) -> None:
        """Listen (mode 0660, like the local socket, whose directory it shares)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old_umask = os.umask(0o117)
        try:
            # (a file there was left by a daemon that died: the path is this daemon's)
            self._bound = bind_unix(sock, self.path)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old_umask)
        sock.setblocking(False)
        self._acceptor = Acceptor(sock, "segment socket", self._take)
        log.info("segment socket listening path=%s", self.path)

    def stop_accepting(self) -> None:
        if self._acceptor is not None:
            self._acceptor.close()

    def close(self) -> None:
        """Stop accepting; close every connection (the sessions are closed by then)."""
        self.stop_accepting()
        for conn in list(self._conns):
            self._close(conn)
        remove_bound(self._bound)  # ours only: a daemon refused at start bound none
        self._bound = None

    def claim(self, token: bytes) -> Connection | None:
        """The unclaimed connection ``token`` was given to, now claimed by a hello."""
        conn = self._unclaimed.pop(token, None)
        if conn is None or conn.closed:
            return None
        conn.claimed = True
        if conn.expiry is not None:
            conn.expiry.cancel()
            conn.expiry = None
        return conn

    def release(self, conn: Connection) -> None:
        """A session on ``conn`` ended (its client said bye): a hello may claim it again
        with its token, within ``CLAIM_TIMEOUT_S``."""
        if conn.closed or not conn.claimed:
            return
        conn.claimed = False
        self._unclaimed[conn.token] = conn
        conn.expiry = self._loop.call_later(CLAIM_TIMEOUT_S, self._expire, conn)

    def cut(self, conn: Connection) -> None:
        """Close a connection: its client sees its daemon gone (it is cut off)."""
        self._close(conn)

    # ------------------------------------------------------------ connections

    def _take(self, sock: socket.socket, _addr: object) -> None:
        if len(self._unclaimed) >= MAX_UNCLAIMED:
            sock.close()
            self._count_bad("unclaimed_limit")
            self._refusing.warning(
                "segment socket: connection closed: %d connections wait for their hello "
                "already (the most)", len(self._unclaimed))
            return
        sock.setblocking(False)
        token = secrets.token_bytes(SEGMENT_TOKEN_BYTES)
        conn = Connection(sock, token)
        try:  # (a few dozen bytes into an empty socket buffer: it does not block)
            sock.send(msgspec.msgpack.encode(Lifeline(token=token)))
        except OSError:
            sock.close()
            return
        self._conns.add(conn)
        self._unclaimed[token] = conn
        conn.expiry = self._loop.call_later(CLAIM_TIMEOUT_S, self._expire, conn)
        self._loop.add_reader(sock.fileno(), self._readable, conn)

    def _expire(self, conn: Connection) -> None:
        conn.expiry = None
        if not conn.claimed and not conn.closed:
            self._count_bad("no_hello")
            log.info("segment socket: connection closed: no hello presented its token "
                     "within %gs", CLAIM_TIMEOUT_S)
            self._close(conn)

    def _close(self, conn: Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.expiry is not None:
            conn.expiry.cancel()
            conn.expiry = None
        self._unclaimed.pop(conn.token, None)
        self._conns.discard(conn)
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(conn.sock.fileno())
        conn.sock.close()

    def _readable(self, conn: Connection) -> None:
        fds: list[int] = []
        try:
            try:
                data, ancdata, flags, _ = conn.sock.recvmsg(
                    _MAX_MESSAGE_BYTES, socket.CMSG_SPACE(MAX_SEGMENTS_PER_HANDOFF * 4))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, ancdata, flags = b"", [], 0
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                    fds.extend(got)
            if not data and not fds:  # the client closed it: it is gone
                claimed = conn.claimed
                self._close(conn)
                if claimed:
                    self._on_lost(conn)
                return
            error = self._handoff(conn, data, flags, fds)
            if not error:
                fds = []  # the session has them now
            else:
                self._count_bad("segments")
                log.info("segment handoff refused: %s", error)
            try:
                conn.sock.send(msgspec.msgpack.encode(SegmentsTaken(error=error)))
            except BlockingIOError:  # it does not read its answers: cut it off
                self._close(conn)
                if conn.claimed:
                    self._on_lost(conn)
            except OSError:
                pass  # closed: the next read sees it
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _handoff(self, conn: Connection, data: bytes, flags: int, fds: list[int]) -> str:
        if not conn.claimed:
            return "say hello on the local socket first (with this connection's token)"
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            return (f"a handoff carries at most {MAX_SEGMENTS_PER_HANDOFF} segments and "
                    f"{_MAX_MESSAGE_BYTES} bytes")
        try:
            msg = _decoder.decode(data)
        except msgspec.DecodeError as exc:
            return f"malformed handoff: {exc}"
        if len(msg.segments) != len(fds) or len(set(msg.segments)) != len(fds):
            return (f"{len(msg.segments)} segment ids for {len(fds)} file descriptors "
                    "(one each, no id twice)")
        try:
            for fd in fds:
                check_segment(fd)
        except BadRequest as exc:
            return exc.message
        return self._on_handoff(conn, list(msg.segments), fds)
