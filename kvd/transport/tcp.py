"""The TCP transport: one data connection per channel, bytes moved by the channel's thread.

A channel is one direction between this daemon and a peer. Its worker thread owns a
blocking socket (with a timeout, so no call waits forever) and moves bytes straight between
the socket and tensor memory with ``sendmsg`` / ``recvmsg_into`` on memoryviews, in chunks
of ``chunk_bytes``; the event loop only submits jobs and awaits their futures.

On the wire a transfer is a series of chunks, each a 21-byte header — magic, transfer id,
chunk length, flags (LAST, CANCELLED) — then its bytes. The receiver is driven by the
stream: the first chunk of a transfer selects the job registered for its id, and each
chunk is received straight into the next bytes of that job's views. Either side can stop a
transfer at a chunk boundary: the sender by sending a CANCELLED chunk, the receiver by
``forget``, after which the rest of its bytes are read into scratch and dropped. Either
way the stream stays in step and no byte lands in memory that was given back.

``abort`` shuts the socket down: a worker blocked in a call returns at once, and every job
fails. The peer plane aborts the channels of a peer it declares dead.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvd import timeline
from kvd.errors import Cancelled, KvdError, PeerUnreachable, ProtocolError

log = logging.getLogger(__name__)

HEADER = struct.Struct("!4sQQB")
MAGIC = b"KVD1"
FLAG_CANCELLED = 1
FLAG_LAST = 2
FLAG_EAGER = 4  # sent with its OFFER, before any ACCEPT: the receiver waits for its answer
DATA_HELLO = struct.Struct("!4s32s")  # magic, token: first bytes on a data connection
DATA_MAGIC = b"KVDD"
_STOP = object()
_SCRATCH_BYTES = 1 << 20


@dataclass(eq=False)
class SendJob:
    transfer_id: int
    views: Sequence[memoryview]
    future: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)
    stop: threading.Event = field(default_factory=threading.Event)  # cancel mid-transfer
    started_at: float = 0.0  # time.monotonic() of the first byte (for the metrics)
    eager: bool = False  # queued with the offer, not after the accept


@dataclass(eq=False)
class RecvJob:
    transfer_id: int
    views: Sequence[memoryview]
    nbytes: int
    future: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)
    abandoned: bool = False  # the receiver gave up: discard its bytes
    started_at: float = 0.0  # time.monotonic() of the first chunk (for the metrics)
    eager: bool = False  # its bytes may arrive before it is expected (see FLAG_EAGER)


def _nonempty(views: Sequence[memoryview]) -> list[memoryview]:
    return [v for v in views if len(v)]


def _take(pending: list[memoryview], n: int) -> list[memoryview]:
    """Remove the first ``n`` bytes from ``pending`` (a partly taken view is cut) and
    return them as views."""
    out: list[memoryview] = []
    while n:
        if not pending:
            raise ProtocolError("more bytes than the transfer's views hold")
        head = pending[0]
        if len(head) <= n:
            out.append(pending.pop(0))
            n -= len(head)
        else:
            out.append(head[:n])
            pending[0] = head[n:]
            n = 0
    return out


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
        # Also notified when a job is expected, or the channel fails or stops (RecvChannel).
        self._lock = threading.Condition(threading.Lock())  # (never taken twice by one thread)
        self._error: KvdError | None = None
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

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
                # The socket's own shutdown, also under TLS (SSLSocket.shutdown would drop
                # the TLS state a blocked worker is reading with).
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        self._fail_pending(error)

    def close(self, timeout_s: float) -> None:
        self.abort(PeerUnreachable(f"channel {self.name} closed"))
        self._stop()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("channel %s worker did not stop within %.1fs", self.name, timeout_s)
        else:
            self.on_broken = None  # (a closure over the link: let the link go now)
            self._release()
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _release(self) -> None:
        """Drop the worker's buffers (it has stopped)."""

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
        # The owner hears first, then the jobs fail: both reach the loop through its
        # queue, in this order, so whoever sees a job's failure sees the broken link too
        # (the other way round, a failed receive was counted while its link was still up).
        if self.on_broken is not None:
            self.on_broken(err)
        self.abort(err)
        log.warning("channel %s broken: %s", self.name, err.message)
        return err

    # subclasses
    def _run(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def _fail_pending(self, error: KvdError) -> None:
        """Fail the jobs waiting (a send worker drains its queue and fails each itself)."""


def _settle(fut: concurrent.futures.Future[int], *, result: int | None = None,
            error: BaseException | None = None) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result or 0)


class SendChannel(Channel):
    """Sends jobs in the order they were submitted, chunk by chunk."""

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

    def _run(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            if not job.future.set_running_or_notify_cancel():
                job.stop.set()
            if self._error is not None:
                _settle(job.future, error=self._error)
                continue
            try:
                self._send(self._wait_socket(), job)
            except BaseException as exc:
                _settle(job.future, error=self._broken(exc))
            timeline.mark("tcp.send.end")

    def _send(self, sock: socket.socket, job: SendJob) -> None:
        job.started_at = time.monotonic()
        timeline.mark("tcp.send.start")
        total = sum(len(v) for v in job.views)
        cursor, left = _nonempty(job.views), total
        eager = FLAG_EAGER if job.eager else 0
        while True:
            if job.stop.is_set():
                sock.sendall(HEADER.pack(MAGIC, job.transfer_id, 0, FLAG_CANCELLED | eager))
                _settle(job.future, error=Cancelled(
                    f"transfer {job.transfer_id} cancelled after {total - left} bytes"))
                return
            n = min(left, self.chunk_bytes)
            left -= n
            # Header and chunk in one call: one syscall per chunk in the common case.
            header = HEADER.pack(MAGIC, job.transfer_id, n, (0 if left else FLAG_LAST) | eager)
            pending = [memoryview(header), *_take(cursor, n)]
            if isinstance(sock, ssl.SSLSocket):  # no sendmsg: one record stream
                for view in pending:
                    sock.sendall(view)
                pending = []
            while pending:
                _take(pending, sock.sendmsg(pending[:512]))
            if not left:
                _settle(job.future, result=total)
                return


class RecvChannel(Channel):
    """Receives whatever the peer sends, into the job registered for its transfer id."""

    def __init__(self, name: str, chunk_bytes: int, io_timeout_s: float,
                 on_broken: Callable[[KvdError], None] | None = None,
                 attach_timeout_s: float | None = None) -> None:
        # How long an expected job may wait for the peer's data connection to appear.
        self.attach_timeout_s = io_timeout_s if attach_timeout_s is None else attach_timeout_s
        self._expected: dict[int, RecvJob] = {}
        self._current: RecvJob | None = None  # the transfer whose chunks are arriving
        self._writing = False  # bytes are going into the current job's views right now
        self._stopping = False
        # Where discarded bytes are read to: made on first use (most links never discard),
        # dropped when the channel closes.
        self._scratch: memoryview | None = None
        super().__init__(name, chunk_bytes, io_timeout_s, on_broken)

    def expect(self, job: RecvJob) -> concurrent.futures.Future[int]:
        """Register a job before telling the sender to go."""
        with self._lock:
            if self._error is not None:
                _settle(job.future, error=self._error)
            else:
                self._expected[job.transfer_id] = job
            self._lock.notify_all()
        return job.future

    def drop(self, transfer_id: int, nbytes: int) -> None:
        """The bytes of an eager transfer we did not accept: read and discard them."""
        self.expect(RecvJob(transfer_id, [], nbytes, abandoned=True, eager=True))

    def forget(self, transfer_id: int) -> None:
        """The receiver gives up on a transfer: from now on its bytes are discarded. Its
        future fails with ``Cancelled`` at once, or, if a chunk is being written into its
        views right now, as soon as that chunk is in: await the future before reusing
        the memory."""
        with self._lock:
            job = self._expected.get(transfer_id)
            if job is not None and not job.eager:
                # Its bytes will not come (the sender was told); an eager job's bytes
                # may be on their way already, so it stays to have them discarded.
                del self._expected[transfer_id]
            current = self._current
            if job is None and current is not None and current.transfer_id == transfer_id:
                job = current
            if job is None:
                return
            job.abandoned = True
            settle_now = not (job is current and self._writing)
        if settle_now:
            _settle(job.future, error=Cancelled(f"transfer {transfer_id} cancelled"))

    def _stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()

    def _fail_pending(self, error: KvdError) -> None:
        with self._lock:
            jobs, self._expected = list(self._expected.values()), {}
            if self._current is not None and not self._writing:
                jobs.append(self._current)
            self._lock.notify_all()  # a worker waiting for an eager transfer's offer: wake it
        for job in jobs:
            _settle(job.future, error=error)

    def _run(self) -> None:
        header = bytearray(HEADER.size)
        received = 0
        cursor: list[memoryview] | None = None
        unattached_since: float | None = None
        while not self._stopping:
            try:
                if not self._attached.wait(0.2):
                    unattached_since = self._check_attach_wait(unattached_since)
                    continue
                if self._error is not None:
                    return
                sock = self._wait_socket()
                idle = self._current is None
                if not self._recv_exactly(sock, [memoryview(header)], idle_ok=idle):
                    continue
                magic, tid, n, flags = HEADER.unpack(header)
                if magic != MAGIC:
                    raise ProtocolError(f"channel {self.name}: bad data header {magic!r}")
                job = self._start(tid, eager=bool(flags & FLAG_EAGER))
                if job is not None and cursor is None:
                    cursor, received = _nonempty(job.views), 0
                if flags & FLAG_CANCELLED:
                    if job is not None:
                        _settle(job.future, error=Cancelled(
                            f"transfer {tid} was cancelled by the sender"))
                    self._finish()
                    cursor = None
                    continue
                if job is not None and received + n > job.nbytes:
                    raise ProtocolError(
                        f"transfer {tid}: more than the {job.nbytes} bytes announced")
                if self._begin_write(job):
                    assert job is not None and cursor is not None
                    try:
                        self._recv_exactly(sock, _take(cursor, n))
                    finally:
                        self._end_write(job)
                else:
                    self._discard(sock, n)
                received += n
                if flags & FLAG_LAST:
                    if job is not None:
                        if received != job.nbytes:
                            raise ProtocolError(f"transfer {tid}: {received} bytes arrived, "
                                                f"{job.nbytes} announced")
                        _settle(job.future, result=received)
                    self._finish()
                    cursor = None
            except BaseException as exc:
                err = self._broken(exc)
                with self._lock:
                    current, self._current = self._current, None
                if current is not None:
                    _settle(current.future, error=err)
                return

    def _check_attach_wait(self, since: float | None) -> float | None:
        """No data connection yet: fine while nothing is expected; a job that waits longer
        than ``attach_timeout_s`` for one breaks the channel (its bytes cannot come)."""
        with self._lock:
            waiting = bool(self._expected)
        if not waiting:
            return None
        now = time.monotonic()
        if since is None:
            return now
        if now - since > self.attach_timeout_s:
            raise PeerUnreachable(f"channel {self.name}: the peer's data connection did not "
                                  f"come within {self.attach_timeout_s:g}s")
        return since

    def _start(self, tid: int, eager: bool = False) -> RecvJob | None:
        """The job the chunk with id ``tid`` belongs to (None: discard its bytes). The
        bytes of an eager transfer can overtake its OFFER (they travel on another
        connection): wait until the loop has answered it, one way or the other."""
        with self._lock:
            if eager and not self._lock.wait_for(
                    lambda: (tid in self._expected or self._error is not None
                             or self._stopping or (self._current is not None)),
                    self.io_timeout_s):
                raise ProtocolError(f"channel {self.name}: eager transfer {tid} was "
                                    f"never offered")
            if self._current is not None and self._current.transfer_id == tid:
                return self._current
            if self._current is not None:
                raise ProtocolError(f"channel {self.name}: transfer {tid} began before "
                                    f"transfer {self._current.transfer_id} ended")
            self._current = self._expected.pop(tid, None)
            if self._current is not None:
                self._current.started_at = time.monotonic()
                timeline.mark("tcp.recv.start")
            return self._current

    def _finish(self) -> None:
        timeline.mark("tcp.recv.end")
        with self._lock:
            self._current = None

    def _begin_write(self, job: RecvJob | None) -> bool:
        with self._lock:
            if job is None or job.abandoned or job.future.done():
                return False
            self._writing = True
            return True

    def _end_write(self, job: RecvJob) -> None:
        """The chunk is in: a job given up, or one on a channel aborted while the chunk
        was written (``_fail_pending`` leaves that one to us), fails now."""
        with self._lock:
            self._writing = False
            abandoned, error = job.abandoned, self._error
        if abandoned:
            _settle(job.future, error=Cancelled(f"transfer {job.transfer_id} cancelled"))
        elif error is not None:
            _settle(job.future, error=error)

    def _release(self) -> None:
        self._scratch = None

    def _discard(self, sock: socket.socket, nbytes: int) -> None:
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = memoryview(
                bytearray(max(self.chunk_bytes, _SCRATCH_BYTES)))
        while nbytes:
            n = min(nbytes, len(scratch))
            self._recv_exactly(sock, [scratch[:n]])
            nbytes -= n

    def _recv_exactly(self, sock: socket.socket, views: Sequence[memoryview],
                      idle_ok: bool = False) -> bool:
        """Fill ``views`` completely. With ``idle_ok``, a timeout before any byte arrived
        is not an error (an idle channel): returns False."""
        pending = _nonempty(views)
        got_any = False
        while pending:
            try:
                n = (sock.recv_into(pending[0]) if isinstance(sock, ssl.SSLSocket)
                     else sock.recvmsg_into(pending[:512])[0])
            except TimeoutError:
                if idle_ok and not got_any and not self._stopping:
                    return False
                raise
            if n == 0:
                raise PeerUnreachable(f"channel {self.name}: connection closed by peer")
            got_any = True
            _take(pending, n)
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
    "data_hello",
    "parse_data_hello",
]
