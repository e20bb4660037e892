"""The TCP transport: data connections whose bytes a few shared threads move.

A channel is one direction of one data connection between this daemon and a peer. No
thread is a channel's own: the bytes of every channel are moved by two small pools
(``DataThreads``), one for sends and one for receives, each thread owning a channel only
while it moves bytes. A send channel is served from its first queued job until its queue
is empty. A receive channel is watched by the event loop while no bytes are coming (an
idle one costs a registered descriptor, nothing else), and served from the moment its
connection is readable until the transfer that arrived, and any behind it, are in. So a
receive thread waits only on a transfer whose sender is writing it: two daemons whose
send threads all wait on each other's full socket buffers still read them.

A thread moves bytes straight between the socket (blocking, with a timeout, so no call
waits forever) and tensor memory with ``sendmsg`` / ``recvmsg_into`` on memoryviews, in
chunks of ``chunk_bytes``; the event loop only submits jobs and awaits their futures.

On the wire a transfer is a series of chunks, each a 21-byte header — magic, transfer id,
chunk length, flags (LAST, CANCELLED) — then its bytes. The receiver is driven by the
stream: the first chunk of a transfer selects the job registered for its id, and each
chunk is received straight into the next bytes of that job's views. Either side can stop a
transfer at a chunk boundary: the sender by sending a CANCELLED chunk, the receiver by
``forget``, after which the rest of its bytes are read into scratch and dropped. Either
way the stream stays in step and no byte lands in memory that was given back.

A sender closes a connection it has not used for a while (``SendChannel.close_idle``,
between transfers): the receiver reads its end at a transfer boundary, a clean close, and
takes the next connection the sender opens. ``abort`` shuts the socket down: a thread
blocked in a call returns at once, and every job fails. The peer plane aborts the channels
of a peer it declares dead.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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


class DataThreads:
    """The threads that move every data connection's bytes: ``THREADS`` for sends and as
    many for receives, shared by all links, made as work first needs them. A receive never
    waits for a send thread (see the module doc), and a link holds no thread while idle."""

    THREADS = 16  # per direction: channels moving bytes at once (others queue behind)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.send = concurrent.futures.ThreadPoolExecutor(self.THREADS, "kvd-send")
        self.recv = concurrent.futures.ThreadPoolExecutor(self.THREADS, "kvd-recv")

    def shutdown(self) -> None:
        """Once every channel is closed: the threads end when their work is done."""
        self.send.shutdown(wait=False)
        self.recv.shutdown(wait=False)


class Channel:
    """The socket, its serving by a pool thread, the failure state: what both directions
    share."""

    def __init__(self, name: str, chunk_bytes: int, io_timeout_s: float,
                 threads: concurrent.futures.ThreadPoolExecutor,
                 on_broken: Callable[[KvdError], None] | None = None) -> None:
        self.name = name
        self.on_broken = on_broken  # called from a pool thread when the stream breaks
        self.chunk_bytes = chunk_bytes
        self.io_timeout_s = io_timeout_s
        self._threads = threads
        # Also notified when a job is expected, a thread stops serving, or the channel
        # fails (never taken twice by one thread).
        self._lock = threading.Condition(threading.Lock())
        self._error: KvdError | None = None
        self._serving = False  # a pool thread serves this channel (or is asked to)

    def _prepare(self, sock: socket.socket) -> socket.socket:
        sock.settimeout(self.io_timeout_s)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _sockets(self) -> list[socket.socket]:
        raise NotImplementedError

    def abort(self, error: KvdError) -> None:
        """Fail everything on this channel now; a blocked thread returns at once."""
        with self._lock:
            if self._error is None:
                self._error = error
            socks = self._sockets()
            self._lock.notify_all()
        for sock in socks:
            with contextlib.suppress(OSError):
                # The socket's own shutdown, also under TLS (SSLSocket.shutdown would drop
                # the TLS state a blocked thread is reading with).
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        self._fail_pending(error)

    def close(self, timeout_s: float) -> None:
        """Abort, wait for the thread serving the channel to let it go, close the
        sockets (not on the loop: the wait can take a moment; a receive channel is
        taken off the loop first, ``RecvChannel.leave_loop``)."""
        self.abort(PeerUnreachable(f"channel {self.name} closed"))
        with self._lock:
            if not self._lock.wait_for(lambda: not self._serving, timeout_s):
                log.error("channel %s: its thread did not let it go within %.1fs",
                          self.name, timeout_s)
                return
            socks = self._sockets()
            self._clear()
        self.on_broken = None  # (a closure over the link: let the link go now)
        for sock in socks:
            sock.close()

    def _serve_soon(self) -> bool:
        """Have a pool thread serve the channel (the caller holds the lock); False if none
        can (the daemon is stopping, or no thread can start): the channel has failed."""
        if self._serving:
            return True
        self._serving = True
        try:
            self._threads.submit(self._serve)
        except RuntimeError as exc:  # shut down, or "can't start new thread"
            self._serving = False
            self._error = self._error or PeerUnreachable(f"channel {self.name}: {exc}")
            return False
        return True

    def _serve(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # (a bug: the channel must still be let go)
            log.exception("channel %s: serving failed", self.name)
            with self._lock:
                self._let_go()
            self.abort(PeerUnreachable(f"channel {self.name}: {exc!r}"))

    def _let_go(self) -> None:
        """The serving thread is done with the channel (the caller holds the lock: a job
        submitted, or bytes come, after this gets a thread of its own)."""
        self._serving = False
        self._lock.notify_all()

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
    def _work(self) -> None:
        """Serve the channel until nothing is left to do now, and let it go (``_let_go``)
        in the same hold of the lock that found nothing."""
        raise NotImplementedError

    def _clear(self) -> None:
        """Drop the sockets and buffers (under the lock; no thread serves it)."""

    def _fail_pending(self, error: KvdError) -> None:
        """Fail the jobs waiting."""


def _settle(fut: concurrent.futures.Future[int], *, result: int | None = None,
            error: BaseException | None = None) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result or 0)


class SendChannel(Channel):
    """Sends jobs in the order they were submitted, chunk by chunk, on a connection made
    before the channel."""

    def __init__(self, name: str, sock: socket.socket, chunk_bytes: int, io_timeout_s: float,
                 threads: concurrent.futures.ThreadPoolExecutor,
                 on_broken: Callable[[KvdError], None] | None = None) -> None:
        super().__init__(name, chunk_bytes, io_timeout_s, threads, on_broken)
        self._sock: socket.socket | None = self._prepare(sock)
        self._jobs: collections.deque[SendJob] = collections.deque()
        self.used_at = time.monotonic()  # its last job submitted or done

    def _sockets(self) -> list[socket.socket]:
        return [self._sock] if self._sock is not None else []

    def submit(self, job: SendJob) -> concurrent.futures.Future[int]:
        with self._lock:
            if self._error is not None:
                _settle(job.future, error=self._error)
                return job.future
            self._jobs.append(job)
            self.used_at = time.monotonic()
            if not self._serve_soon():
                self._jobs.remove(job)
                _settle(job.future, error=self._error)
        return job.future

    def close_idle(self, idle_s: float) -> bool:
        """Close the connection if no job has been on it for ``idle_s`` (the receiver
        reads a clean close); whether it did. Nothing is submitted afterwards: the link
        forgets the channel first."""
        with self._lock:
            if (self._serving or self._jobs or self._error is not None
                    or time.monotonic() - self.used_at < idle_s):
                return False
            self._error = PeerUnreachable(f"channel {self.name} closed (idle)")
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        return True

    def _fail_pending(self, error: KvdError) -> None:
        with self._lock:
            jobs = [] if self._serving else list(self._jobs)  # (a serving thread fails them)
            if jobs:
                self._jobs.clear()
        for job in jobs:
            _settle(job.future, error=error)

    def _clear(self) -> None:
        self._sock = None

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self.used_at = time.monotonic()
                    self._let_go()
                    return
                job = self._jobs.popleft()
                error, sock = self._error, self._sock
            if not job.future.set_running_or_notify_cancel():
                job.stop.set()
            if error is not None or sock is None:
                _settle(job.future, error=error or PeerUnreachable(f"{self.name} closed"))
                continue
            try:
                self._send(sock, job)
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
    """Receives whatever the peer sends, into the job registered for its transfer id.

    Its connections are the peer's: the one bytes come on, and at most one behind it (the
    peer closed the first when idle and opened another; the first is read to its end).
    The loop methods (``attach``, ``expect``, ``drop``, ``leave_loop``) run on the loop."""

    def __init__(self, name: str, chunk_bytes: int, io_timeout_s: float,
                 threads: DataThreads, on_broken: Callable[[KvdError], None] | None = None,
                 attach_timeout_s: float | None = None) -> None:
        super().__init__(name, chunk_bytes, io_timeout_s, threads.recv, on_broken)
        self._loop = threads.loop
        # How long an expected job may wait for the peer's data connection to appear.
        self.attach_timeout_s = io_timeout_s if attach_timeout_s is None else attach_timeout_s
        self._socks: collections.deque[socket.socket] = collections.deque()
        self._watched = -1  # the descriptor the loop watches for bytes (-1: none)
        self._attach_timer: asyncio.TimerHandle | None = None
        self._expected: dict[int, RecvJob] = {}
        self._current: RecvJob | None = None  # the transfer whose chunks are arriving
        self._writing = False  # bytes are going into the current job's views right now
        # Where discarded bytes are read to: made on first use (most links never discard),
        # dropped when the channel closes.
        self._scratch: memoryview | None = None

    def _sockets(self) -> list[socket.socket]:
        return list(self._socks)

    def attach(self, sock: socket.socket) -> None:
        """The peer's connection for its bytes (on the loop)."""
        self._prepare(sock)
        with self._lock:
            if self._error is not None or len(self._socks) >= 2:
                raise ProtocolError(f"channel {self.name} already has a connection")
            self._socks.append(sock)
            if len(self._socks) == 1 and not self._serving:
                self._watch()

    def expect(self, job: RecvJob) -> concurrent.futures.Future[int]:
        """Register a job before telling the sender to go (on the loop)."""
        with self._lock:
            if self._error is not None:
                _settle(job.future, error=self._error)
                return job.future
            self._expected[job.transfer_id] = job
            self._lock.notify_all()
            self._time_attach()
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

    def leave_loop(self) -> None:
        """Stop watching the connection and timing its coming (on the loop), before the
        channel is closed."""
        self.unwatch()
        if self._attach_timer is not None:
            self._attach_timer.cancel()
            self._attach_timer = None

    def unwatch(self) -> None:
        if self._watched >= 0:
            self._loop.remove_reader(self._watched)
            self._watched = -1

    # ------------------------------------------------------------ on the loop

    def _watch(self) -> None:
        """Wait on the loop for the next bytes (the lock held, no thread serving)."""
        if self._error is None and self._socks and self._watched < 0:
            self._watched = self._socks[0].fileno()
            self._loop.add_reader(self._watched, self._readable)

    def _readable(self) -> None:
        self.unwatch()
        with self._lock:
            if self._error is None and self._socks:
                self._serve_soon()

    def _rewatch(self) -> None:
        with self._lock:
            if not self._serving:
                self._watch()

    def _check_attached(self) -> None:
        """Jobs are expected and no connection has come for ``attach_timeout_s``: their
        bytes cannot come, and the link is broken."""
        self._attach_timer = None
        with self._lock:
            stranded = not self._socks and bool(self._expected) and self._error is None
        if stranded:
            self._broken(PeerUnreachable(
                f"channel {self.name}: the peer's data connection did not come within "
                f"{self.attach_timeout_s:g}s"))

    # ------------------------------------------------------------ in a pool thread

    def _fail_pending(self, error: KvdError) -> None:
        with self._lock:
            jobs, self._expected = list(self._expected.values()), {}
            if self._current is not None and not self._writing:
                jobs.append(self._current)
            self._lock.notify_all()  # a thread waiting for an eager transfer's offer: wake it
        for job in jobs:
            _settle(job.future, error=error)

    def _clear(self) -> None:
        self._socks.clear()
        self._scratch = None

    def _work(self) -> None:
        """Read transfers while bytes are there; at a transfer boundary with none waiting,
        give the connection back to the loop to watch."""
        header = bytearray(HEADER.size)
        received = 0
        cursor: list[memoryview] | None = None
        while True:
            with self._lock:
                if self._error is not None or not self._socks:
                    self._let_go()
                    return
                sock = self._socks[0]
                at_boundary = self._current is None
                if at_boundary and not _bytes_waiting(sock):
                    self._let_go()
                    with contextlib.suppress(RuntimeError):  # the loop is gone at shutdown
                        self._loop.call_soon_threadsafe(self._rewatch)
                    return
            try:
                if not self._recv_exactly(sock, [memoryview(header)], at_boundary=at_boundary):
                    self._next_connection(sock)  # the peer closed it, between transfers
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
                    self._let_go()
                if current is not None:
                    _settle(current.future, error=err)
                return

    def _next_connection(self, sock: socket.socket) -> None:
        """The peer closed ``sock`` between transfers: the next one it opened, if any,
        carries its bytes from now on."""
        with self._lock:
            if self._socks and self._socks[0] is sock:
                self._socks.popleft()
        with contextlib.suppress(RuntimeError):  # (the loop is gone at shutdown)
            self._loop.call_soon_threadsafe(self._start_attach_timer)
        sock.close()

    def _start_attach_timer(self) -> None:
        with self._lock:
            self._time_attach()

    def _time_attach(self) -> None:
        """Jobs are expected and no connection is there: time its coming (on the loop,
        the lock held; ``_check_attached``)."""
        if (self._expected and not self._socks and self._attach_timer is None
                and self._error is None):
            self._attach_timer = self._loop.call_later(self.attach_timeout_s,
                                                       self._check_attached)

    def _start(self, tid: int, eager: bool = False) -> RecvJob | None:
        """The job the chunk with id ``tid`` belongs to (None: discard its bytes). The
        bytes of an eager transfer can overtake its OFFER (they travel on another
        connection): wait until the loop has answered it, one way or the other."""
        with self._lock:
            if eager and not self._lock.wait_for(
                    lambda: (tid in self._expected or self._error is not None
                             or (self._current is not None)),
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
                      at_boundary: bool = False) -> bool:
        """Fill ``views`` completely. With ``at_boundary``, the connection's end before
        any byte (the peer closed it between transfers) is not an error: returns False."""
        pending = _nonempty(views)
        got_any = False
        while pending:
            n = (sock.recv_into(pending[0]) if isinstance(sock, ssl.SSLSocket)
                 else sock.recvmsg_into(pending[:512])[0])
            if n == 0:
                if at_boundary and not got_any:
                    return False
                raise PeerUnreachable(f"channel {self.name}: connection closed by peer")
            got_any = True
            _take(pending, n)
        return True


def _bytes_waiting(sock: socket.socket) -> bool:
    """Whether a read would not wait: bytes (or the connection's end) are there, in the
    kernel or already decrypted in the TLS layer."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poll = select.poll()
    poll.register(sock.fileno(), select.POLLIN)
    return bool(poll.poll(0))


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
    "DataThreads",
    "RecvChannel",
    "RecvJob",
    "SendChannel",
    "SendJob",
    "data_hello",
    "parse_data_hello",
]
