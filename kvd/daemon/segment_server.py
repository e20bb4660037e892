"""The segment socket: where clients hand over the shared-memory segments of their CPU
tensors, as file descriptors.

A client's CPU tensors live in memfd segments sealed against shrinking (client/shm.py). A
file descriptor can only travel as ``SCM_RIGHTS`` ancillary data, which the local socket's
asyncio transport drops, so segments come over this second Unix socket, next to the local
one (``<socket_path>.seg``, same directory, same mode): a ``SOCK_SEQPACKET`` connection
carries one ``SegmentHandoff`` (the session's token from its ``Welcome`` and the segment
ids) with one descriptor per id, and gets one ``SegmentsTaken`` back. A thread of its own
accepts, a few more read (a handoff is rare: once per segment and session; a client that
connects and says nothing holds one of them for ``_READ_TIMEOUT_S``); the session's table
is changed on the event loop.

Nothing from the socket is trusted: the message is decoded with msgspec against its type;
a descriptor must be a regular file sealed against shrinking (so no mapping of it can ever
end in SIGBUS), and a token must name a live session. Every refusal is answered, counted
in ``bad_messages["segments"]``, and closes the descriptors it came with.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import msgspec

from kvd.daemon.accepting import Throttled, accept_error
from kvd.daemon.socket_files import BoundFile, bind_unix, remove_bound
from kvd.errors import BadRequest
from kvd.memory.segments import check_segment
from kvd.protocol import MAX_SEGMENTS_PER_HANDOFF, SegmentHandoff, SegmentsTaken

log = logging.getLogger(__name__)

_READ_TIMEOUT_S = 5.0  # a client that connects and says nothing is cut off after this
_READERS = 8
_MAX_MESSAGE_BYTES = 4096
_decoder = msgspec.msgpack.Decoder(SegmentHandoff)


def segment_socket_path(socket_path: str) -> str:
    return socket_path + ".seg"


class SegmentServer:
    """Accepts handoffs on ``path``; ``adopt(token, ids, fds)`` runs on ``loop`` and
    returns an error text ('' when the session took them, and with them the fds)."""

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop,
                 adopt: Callable[[bytes, list[int], list[int]], str],
                 count_bad: Callable[[str], None]) -> None:
        self.path = path
        self._loop = loop
        self._adopt = adopt
        self._count_bad = count_bad
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._readers = concurrent.futures.ThreadPoolExecutor(
            _READERS, thread_name_prefix="kvd-segments")
        self._stopping = False
        self._bound: BoundFile | None = None  # the socket file bound here: removed at close
        self._accept_failed = Throttled(log)

    def bind(self) -> None:
        """Listen (mode 0660, like the local socket, whose directory it shares)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old_umask = os.umask(0o117)
        try:
            # (a file there was left by a daemon that died: the path is this daemon's)
            self._bound = bind_unix(sock, self.path)
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old_umask)
        self._sock = sock
        # Not a daemon thread: close() stops it (the _stopping flag, then the shutdown that
        # wakes its accept) and joins it with a timeout.
        self._thread = threading.Thread(target=self._serve, name="kvd-segments")
        self._thread.start()
        log.info("segment socket listening path=%s", self.path)

    def close(self) -> None:
        self._stopping = True
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
            sock.close()
        if self._thread is not None:
            self._thread.join(10)
        self._readers.shutdown(wait=True, cancel_futures=True)  # (each read is bounded)
        remove_bound(self._bound)  # ours only: a daemon refused at start bound none
        self._bound = None

    # ------------------------------------------------------------ the thread

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stopping:
            try:
                conn, _ = sock.accept()
            except OSError as exc:
                if self._stopping:
                    return
                self._accept_failed.warning("segment socket: accept failed: %s",
                                            accept_error(exc))
                time.sleep(0.1)  # (out of descriptors, say: not a busy loop meanwhile)
                continue
            try:
                self._readers.submit(self._serve_one, conn)
            except RuntimeError:  # shut down meanwhile
                conn.close()
                return

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._handle(conn)
            except Exception:  # never let one client stop the socket
                log.exception("segment handoff failed")

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(_READ_TIMEOUT_S)
        fds: list[int] = []
        try:
            try:
                data, ancdata, flags, _ = conn.recvmsg(
                    _MAX_MESSAGE_BYTES, socket.CMSG_SPACE(MAX_SEGMENTS_PER_HANDOFF * 4))
            except (TimeoutError, OSError):
                return  # silent or gone: nothing to answer
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                    fds.extend(got)
            error = self._take(data, flags, fds)
            if not error:
                fds = []  # the session has them now
            else:
                with contextlib.suppress(RuntimeError):  # (the loop is gone at shutdown)
                    self._loop.call_soon_threadsafe(self._count_bad, "segments")
                log.info("segment handoff refused: %s", error)
            with contextlib.suppress(OSError):
                conn.sendall(msgspec.msgpack.encode(SegmentsTaken(error=error)))
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _take(self, data: bytes, flags: int, fds: list[int]) -> str:
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
        try:
            future = asyncio.run_coroutine_threadsafe(
                _on_loop(self._adopt, msg.token, list(msg.segments), fds), self._loop)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            return "the daemon is stopping"
        try:
            return future.result(_READ_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            if future.cancel():  # never ran: the descriptors are still ours to close
                return "the daemon's loop did not answer in time"
            return future.result()  # it ran meanwhile, and its answer is the truth


async def _on_loop(adopt: Callable[[bytes, list[int], list[int]], str], token: bytes,
                   ids: list[int], fds: list[int]) -> str:
    return adopt(token, ids, fds)
