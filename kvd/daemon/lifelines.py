"""The door: each client's lifeline, the way to its ZeroMQ endpoint, and its CPU segments.

``socket_path`` is a ``SOCK_SEQPACKET`` socket of kvd's own (mode 0660). A client that
connects is answered a ``Lifeline`` token, and hands over an ``O_PATH`` descriptor of its
DEALER's socket file (``Reach``), which the daemon's ROUTER connects through with the token
as routing id. Its ``Hello`` then opens a session that lives as long as the lifeline: a
client that dies, however it dies, closes it, and its session is closed at once; a daemon
that dies closes it too, and the client fails its calls at once. The segments of its CPU
tensors come here too (ZeroMQ cannot carry descriptors): ``SCM_RIGHTS`` with a
``SegmentHandoff``, answered by one ``Taken``. docs/architecture.md says why there is no
ZeroMQ listener for clients ("A lifeline beside ZeroMQ, and the only door").

Everything runs on the event loop: an ``Acceptor`` takes connections, ``add_reader``
watches each. Nothing from the socket is trusted:

- Connections are counted against the daemon's descriptors (``DescriptorBudget``).
- Those that have not said hello are bounded per user (``SO_PEERCRED``) and in all.
  At a bound, the oldest unclaimed one of the process holding the most is closed, so a
  new client always gets in.
- Unclaimed connections are closed after ``CLAIM_TIMEOUT_S``.
- Messages are decoded with msgspec against their types.
- An endpoint must be a socket file owned by the connection's user.
- A segment must be a regular file sealed against shrinking, so no mapping of it can ever
  end in SIGBUS.
- Every refusal is answered, counted in ``bad_messages``, and closes the descriptors it
  came with.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import secrets
import socket
import stat
import struct
from collections import Counter
from collections.abc import Callable

import msgspec

from kvd.daemon.accepting import Acceptor, Throttled
from kvd.daemon.descriptors import PER_LIFELINE, DescriptorBudget
from kvd.daemon.socket_files import BoundFile, bind_unix, remove_bound
from kvd.errors import BadRequest
from kvd.memory.segments import check_segment
from kvd.protocol import (
    MAX_SEGMENTS_PER_HANDOFF,
    SEGMENT_TOKEN_BYTES,
    Lifeline,
    LifelineRequest,
    Reach,
    SegmentHandoff,
    Taken,
)

log = logging.getLogger(__name__)

# Connections that have not said hello yet, per user and in all, and how long one may
# wait: a client says hello right after it connects.
MAX_UNCLAIMED_PER_USER = 16
MAX_UNCLAIMED = 64
CLAIM_TIMEOUT_S = 10.0
_MAX_MESSAGE_BYTES = 4096
_decoder = msgspec.msgpack.Decoder(LifelineRequest)
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class Connection:
    """One client's lifeline."""

    def __init__(self, sock: socket.socket, token: bytes, pid: int, uid: int) -> None:
        self.sock = sock
        self.token = token  # also the routing id of the client's DEALER on our ROUTER
        self.pid = pid
        self.uid = uid
        self.claimed = False
        self.closed = False
        self.expiry: asyncio.TimerHandle | None = None
        self.endpoint_fd = -1  # the O_PATH descriptor the ROUTER connected through


class LifelineServer:
    """Serves ``path`` on the running loop.

    ``on_reach(conn, fd)`` connects the daemon's ROUTER to the client's endpoint and
    returns '' (the descriptor is the connection's now) or why not (it is closed here).
    ``on_handoff(conn, ids, fds)`` gives a claimed connection's session the descriptors
    and returns '' (they are the session's now) or why not (they are closed here).
    ``on_closed(conn)``: a connection closed (the client is gone, or was cut off)."""

    def __init__(self, path: str, budget: DescriptorBudget,
                 on_reach: Callable[[Connection, int], str],
                 on_handoff: Callable[[Connection, list[int], list[int]], str],
                 on_closed: Callable[[Connection], None],
                 count_bad: Callable[[str], None]) -> None:
        self.path = path
        self._budget = budget
        self._on_reach = on_reach
        self._on_handoff = on_handoff
        self._on_closed = on_closed
        self._count_bad = count_bad
        self._loop = asyncio.get_running_loop()
        self._acceptor: Acceptor | None = None
        self._unclaimed: dict[bytes, Connection] = {}  # by token, oldest first
        self._conns: set[Connection] = set()
        self._bound: BoundFile | None = None  # the socket file bound here: removed at close
        self._refusing = Throttled(log)

    def bind(self) -> None:
        """Listen (mode 0660, in the socket directory)."""
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
        self._acceptor = Acceptor(sock, "local socket", self._take)
        log.info("local socket listening path=%s", self.path)

    def stop_accepting(self) -> None:
        if self._acceptor is not None:
            self._acceptor.close()

    def close(self) -> None:
        """Stop accepting; close every connection (the sessions are closed by then)."""
        self.stop_accepting()
        for conn in list(self._conns):
            self.cut(conn)
        remove_bound(self._bound)  # ours only: a daemon refused at start bound none
        self._bound = None

    def claim(self, token: bytes) -> Connection | None:
        """The unclaimed connection whose token (routing id) is ``token``, now claimed by a
        hello; None if there is none, or it has no endpoint yet."""
        conn = self._unclaimed.get(token)
        if conn is None or conn.closed or conn.endpoint_fd < 0:
            return None
        del self._unclaimed[token]
        conn.claimed = True
        if conn.expiry is not None:
            conn.expiry.cancel()
            conn.expiry = None
        return conn

    def release(self, conn: Connection) -> None:
        """A session on ``conn`` ended (its client said bye): a hello may claim it again,
        within ``CLAIM_TIMEOUT_S``."""
        if conn.closed or not conn.claimed:
            return
        conn.claimed = False
        self._unclaimed[conn.token] = conn
        conn.expiry = self._loop.call_later(CLAIM_TIMEOUT_S, self._expire, conn)

    # ------------------------------------------------------------ connections

    def _take(self, sock: socket.socket, _addr: object) -> None:
        try:
            pid, uid, _gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            sock.close()
            return
        self._make_room(uid)
        if not self._budget.take(PER_LIFELINE):
            sock.close()
            self._count_bad("descriptor_limit")
            self._refusing.warning("local socket: connection of pid %d closed: %s", pid,
                                   self._budget.refusal())
            return
        sock.setblocking(False)
        conn = Connection(sock, secrets.token_bytes(SEGMENT_TOKEN_BYTES), pid, uid)
        self._conns.add(conn)
        self._unclaimed[conn.token] = conn
        conn.expiry = self._loop.call_later(CLAIM_TIMEOUT_S, self._expire, conn)
        self._loop.add_reader(sock.fileno(), self._readable, conn)
        # (a few dozen bytes into an empty socket buffer: it does not block)
        self._answer(conn, msgspec.msgpack.encode(Lifeline(token=conn.token)))

    def _make_room(self, uid: int) -> None:
        """Before a new connection of ``uid``: past a bound of connections without a hello
        (that user's, or all), close the oldest of the process holding the most of them.
        A new client's process holds one at most: a flood, of another user or of its own,
        is what gives way."""
        mine = [c for c in self._unclaimed.values() if c.uid == uid]
        if len(mine) >= MAX_UNCLAIMED_PER_USER:
            crowd = mine
        elif len(self._unclaimed) >= MAX_UNCLAIMED:
            crowd = list(self._unclaimed.values())
        else:
            return
        most, _ = Counter((c.uid, c.pid) for c in crowd).most_common(1)[0]
        oldest = next(c for c in crowd if (c.uid, c.pid) == most)
        self._count_bad("unclaimed_limit")
        self._refusing.warning(
            "local socket: closed the oldest connection without a hello (pid %d, uid %d): "
            "%d wait for their hello already (at most %d per user, %d in all)",
            oldest.pid, oldest.uid, len(self._unclaimed), MAX_UNCLAIMED_PER_USER,
            MAX_UNCLAIMED)
        self.cut(oldest)

    def _expire(self, conn: Connection) -> None:
        conn.expiry = None
        if not conn.claimed and not conn.closed:
            self._count_bad("no_hello")
            log.info("local socket: connection of pid %d closed: no hello within %gs",
                     conn.pid, CLAIM_TIMEOUT_S)
            self.cut(conn)

    def cut(self, conn: Connection) -> None:
        """Close a connection (its client sees its daemon gone)."""
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
        try:
            self._on_closed(conn)
        finally:
            if conn.endpoint_fd >= 0:
                os.close(conn.endpoint_fd)
                conn.endpoint_fd = -1
            self._budget.give(PER_LIFELINE)

    def _answer(self, conn: Connection, payload: bytes) -> None:
        try:
            conn.sock.send(payload)
        except BlockingIOError:  # it does not read its answers: cut it off
            self.cut(conn)
        except OSError:
            pass  # closed: the next read sees it

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
                self.cut(conn)
                return
            error = self._request(conn, data, flags, fds)
            if not error:
                fds = []  # they are the connection's or the session's now
            else:
                self._count_bad("lifeline")
                log.info("lifeline request of pid %d refused: %s", conn.pid, error)
            self._answer(conn, msgspec.msgpack.encode(Taken(error=error)))
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _request(self, conn: Connection, data: bytes, flags: int, fds: list[int]) -> str:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            return (f"a message carries at most {MAX_SEGMENTS_PER_HANDOFF} descriptors and "
                    f"{_MAX_MESSAGE_BYTES} bytes")
        try:
            msg = _decoder.decode(data)
        except msgspec.DecodeError as exc:
            return f"malformed message: {exc}"
        if isinstance(msg, Reach):
            return self._reach(conn, fds)
        return self._handoff(conn, msg, fds)

    def _reach(self, conn: Connection, fds: list[int]) -> str:
        if conn.endpoint_fd >= 0:
            return "this connection has its endpoint already"
        if len(fds) != 1:
            return f"reach carries one descriptor, got {len(fds)}"
        try:
            st = os.fstat(fds[0])
        except OSError as exc:
            return f"unusable descriptor: {exc.strerror}"
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != conn.uid:
            # (the daemon connects with its own rights: only to a socket of the client's)
            return "reach needs a descriptor of a socket file owned by the client's user"
        error = self._on_reach(conn, fds[0])
        if not error:
            conn.endpoint_fd = fds[0]
        return error

    def _handoff(self, conn: Connection, msg: SegmentHandoff, fds: list[int]) -> str:
        if not conn.claimed:
            return "say hello on the ZeroMQ connection first"
        if len(msg.segments) != len(fds) or len(set(msg.segments)) != len(fds):
            return (f"{len(msg.segments)} segment ids for {len(fds)} file descriptors "
                    "(one each, no id twice)")
        try:
            for fd in fds:
                check_segment(fd)
        except BadRequest as exc:
            return exc.message
        return self._on_handoff(conn, list(msg.segments), fds)
