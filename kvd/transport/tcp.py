"""The TCP transport: one data connection per channel, bytes moved by the channel's thread.

A channel is one direction between this daemon and a peer. Its worker thread owns a
blocking socket (with a timeout, so no call waits forever) and moves bytes straight between
the socket and tensor memory with ``sendmsg`` / ``recvmsg_into`` on memoryviews, in chunks
of ``chunk_bytes``; the event loop only submits jobs and awaits their futures.

Every transfer on the wire is a 21-byte header — magic, transfer id, byte count, flags —
then the bytes. The receiving side is driven by the stream: it reads a header, looks up the
job registered for that transfer id, and receives into its views. A job cancelled before
its bytes arrive is dropped from the table, and its bytes are read into a scratch buffer
and discarded, so the stream stays in step and nothing lands in memory that was given back.
A sender whose job is cancelled before it starts sends only a header flagged CANCELLED.

``abort`` shuts the socket down: a worker blocked in a call returns at once, and every job
fails. The peer plane aborts the channels of a peer it declares dead.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvd.errors import Cancelled, KvdError, PeerUnreachable, ProtocolError, TransferFailed

log = logging.getLogger(__name__)

HEADER = struct.Struct("!4sQQB")
MAGIC = b"KVD1"
FLAG_CANCELLED = 1
DATA_HELLO = struct.Struct("!4s32s")  # magic, token: first bytes on a data connection
DATA_MAGIC = b"KVDD"
_STOP = object()
_SCRATCH_BYTES = 1 << 20


@dataclass(eq=False)
class SendJob:
    transfer_id: int
    views: Sequence[memoryview]
    future: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)


@dataclass(eq=False)
class RecvJob:
    transfer_id: int
    views: Sequence[memoryview]
    nbytes: int
    future: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)


class Channel:
    """Socket slot, worker thread, failure state: what both directions share."""

    def __init__(self, name: str, chunk_bytes: int, io_timeout_s: float,
                 on_broken: Callable[[KvdError], None] | None = None) -> None:
        self.name = name
        self.on_broken = on_broken  # called from the worker thread when the stream breaks
        self.chunk_bytes = chunk_bytes
        self.io_timeout_s = io_timeout_s
        self._sock: socket.socket | None = None
        self._attached = threading.Event()
        self._lock = threading.Lock()
        self._error: KvdError | None = None
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

    @property
    def broken(self) -> KvdError | None:
        return self._error

    def attach(self, sock: socket.socket) -> None:
        sock.settimeout(self.io_timeout_s)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._sock is not None or self._error is not None:
                raise ProtocolError(f"channel {self.name} already has a connection")
            self._sock = sock
        self._attached.set()

    def abort(self, error: KvdError) -> None:
        """Fail everything on this channel now; a blocked worker returns at once."""
        with self._lock:
            if self._error is None:
                self._error = error
            sock = self._sock
        self._attached.set()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._fail_pending(error)

    def close(self, timeout_s: float) -> None:
        self.abort(PeerUnreachable(f"channel {self.name} closed"))
        self._stop()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("channel %s worker did not stop within %.1fs", self.name, timeout_s)
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _wait_socket(self) -> socket.socket:
        if not self._attached.wait(self.io_timeout_s):
            raise PeerUnreachable(f"channel {self.name}: data connection not set up in time")
        if self._error is not None:
            raise self._error
        assert self._sock is not None
        return self._sock

    def _broken(self, exc: BaseException) -> KvdError:
        if self._error is not None:
            return self._error
        err = (exc if isinstance(exc, KvdError)
               else PeerUnreachable(f"channel {self.name}: {exc!r}"))
        self.abort(err)
        log.warning("channel %s broken: %s", self.name, err.message)
        if self.on_broken is not None:
            self.on_broken(err)
        return err

    # subclasses
    def _run(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def _fail_pending(self, error: KvdError) -> None:
        raise NotImplementedError


def _settle(fut: concurrent.futures.Future[int], *, result: int | None = None,
            error: BaseException | None = None) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result or 0)


class SendChannel(Channel):
    """Sends jobs in the order they were submitted."""

    def __init__(self, name: str, chunk_bytes: int, io_timeout_s: float,
                 on_broken: Callable[[KvdError], None] | None = None) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        super().__init__(name, chunk_bytes, io_timeout_s, on_broken)

    def submit(self, job: SendJob) -> concurrent.futures.Future[int]:
        if self._error is not None:
            _settle(job.future, error=self._error)
        else:
            self._jobs.put(job)
        return job.future

    def _stop(self) -> None:
        self._jobs.put(_STOP)

    def _fail_pending(self, error: KvdError) -> None:
        pass  # the worker drains the queue and fails each job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            cancelled = not job.future.set_running_or_notify_cancel()
            if self._error is not None:
                if not cancelled:
                    _settle(job.future, error=self._error)
                continue
            try:
                sock = self._wait_socket()
                if cancelled:
                    sock.sendall(HEADER.pack(MAGIC, job.transfer_id, 0, FLAG_CANCELLED))
                    continue
                nbytes = sum(len(v) for v in job.views)
                sock.sendall(HEADER.pack(MAGIC, job.transfer_id, nbytes, 0))
                self._send_views(sock, job.views)
                _settle(job.future, result=nbytes)
            except BaseException as exc:
                err = self._broken(exc)
                if not cancelled:
                    _settle(job.future, error=err)

    def _send_views(self, sock: socket.socket, views: Sequence[memoryview]) -> None:
        pending = list(views)
        while pending:
            batch, size = [], 0
            for v in pending:
                batch.append(v)
                size += len(v)
                if size >= self.chunk_bytes or len(batch) >= 512:
                    break
            sent = sock.sendmsg(batch)
            # Drop what went out; a partly sent view continues from where it stopped.
            while sent and pending:
                head = pending[0]
                if sent >= len(head):
                    sent -= len(head)
                    pending.pop(0)
                else:
                    pending[0] = head[sent:]
                    sent = 0


class RecvChannel(Channel):
    """Receives whatever the peer sends, into the job registered for its transfer id."""

    def __init__(self, name: str, chunk_bytes: int, io_timeout_s: float,
                 on_broken: Callable[[KvdError], None] | None = None) -> None:
        self._expected: dict[int, RecvJob] = {}
        self._running: RecvJob | None = None
        self._stopping = False
        super().__init__(name, chunk_bytes, io_timeout_s, on_broken)
        self._scratch = bytearray(_SCRATCH_BYTES)

    def expect(self, job: RecvJob) -> concurrent.futures.Future[int]:
        """Register a job before telling the sender to go."""
        with self._lock:
            if self._error is not None:
                _settle(job.future, error=self._error)
            else:
                self._expected[job.transfer_id] = job
        return job.future

    def forget(self, transfer_id: int) -> bool:
        """Drop a job whose bytes have not started to arrive (they will be discarded).
        False if they are arriving now: wait for its future instead."""
        with self._lock:
            job = self._expected.pop(transfer_id, None)
        if job is None:
            return False
        _settle(job.future, error=Cancelled(f"transfer {transfer_id} cancelled"))
        return True

    def _stop(self) -> None:
        self._stopping = True

    def _fail_pending(self, error: KvdError) -> None:
        with self._lock:
            jobs, self._expected = list(self._expected.values()), {}
        for job in jobs:
            _settle(job.future, error=error)

    def _run(self) -> None:
        header = bytearray(HEADER.size)
        while not self._stopping:
            try:
                if not self._attached.wait(0.2):
                    continue
                if self._error is not None:
                    return
                sock = self._wait_socket()
                if not self._recv_exactly(sock, [memoryview(header)], first=True):
                    continue
                magic, tid, nbytes, flags = HEADER.unpack(header)
                if magic != MAGIC:
                    raise ProtocolError(f"channel {self.name}: bad data header {magic!r}")
                with self._lock:
                    job = self._expected.pop(tid, None)
                    self._running = job
                if flags & FLAG_CANCELLED:
                    if job is not None:
                        _settle(job.future, error=Cancelled(
                            f"transfer {tid} was cancelled by the sender"))
                    continue
                if job is None or job.future.done():
                    self._discard(sock, nbytes)
                    continue
                if nbytes != job.nbytes:
                    raise ProtocolError(
                        f"transfer {tid}: {nbytes} bytes announced, {job.nbytes} expected")
                self._recv_exactly(sock, job.views)
                _settle(job.future, result=nbytes)
            except BaseException as exc:
                err = self._broken(exc)
                running, self._running = self._running, None
                if running is not None:
                    _settle(running.future, error=err)
                return
            finally:
                self._running = None

    def _discard(self, sock: socket.socket, nbytes: int) -> None:
        scratch = memoryview(self._scratch)
        while nbytes:
            n = min(nbytes, len(scratch))
            self._recv_exactly(sock, [scratch[:n]])
            nbytes -= n

    def _recv_exactly(self, sock: socket.socket, views: Sequence[memoryview],
                      first: bool = False) -> bool:
        """Fill ``views`` completely. With ``first``, a timeout before any byte arrived is
        not an error (an idle channel): returns False."""
        pending = [v for v in views if len(v)]
        got_any = False
        while pending:
            batch, size = [], 0
            for v in pending:
                batch.append(v)
                size += len(v)
                if size >= self.chunk_bytes or len(batch) >= 512:
                    break
            try:
                n = sock.recvmsg_into(batch)[0]
            except TimeoutError:
                if first and not got_any and not self._stopping:
                    return False
                raise
            if n == 0:
                raise PeerUnreachable(f"channel {self.name}: connection closed by peer")
            got_any = True
            while n and pending:
                head = pending[0]
                if n >= len(head):
                    n -= len(head)
                    pending.pop(0)
                else:
                    pending[0] = head[n:]
                    n = 0
        return True


def data_hello(token: bytes) -> bytes:
    return DATA_HELLO.pack(DATA_MAGIC, token)


def parse_data_hello(data: bytes) -> bytes:
    if len(data) != DATA_HELLO.size:
        raise ProtocolError("short data connection hello")
    magic, token = DATA_HELLO.unpack(data)
    if magic != DATA_MAGIC:
        raise ProtocolError("bad data connection magic")
    return bytes(token)


__all__ = [
    "DATA_HELLO",
    "RecvChannel",
    "RecvJob",
    "SendChannel",
    "SendJob",
    "TransferFailed",
    "data_hello",
    "parse_data_hello",
]
