"""``KvdClient``: the blocking twin of ``AsyncKvdClient``, same methods and results.

Requests are built by the shared ``RequestBuilder``; this shell only sends and waits, on
a ZeroMQ DEALER it polls itself (no event loop), with its lifeline
(``kvd.client.lifeline``) in the same poll: a daemon that goes away closes it, and every
wait then fails at once. A client is safe to share between threads, and any number of
them can have calls in flight on it at once, each waiting only for its own reply: a lock
held only around each call on the DEALER (ZeroMQ sockets are not thread-safe), and one
waiting thread at a time reads, keeping each reply for its owner (a waiting thread, or a
``Transfer`` not yet asked) and waking the others (``KvdClient._wait_reply``). For
concurrency within a thread, use the async client. A call that ends before its reply
(its timeout, an exception such as ``KeyboardInterrupt``), ``Transfer.cancel`` and
``close`` stop the request in the daemon and return once it says no more bytes move in
the request's blocks; without that word in the client's timeout, the connection is
dropped (``KvdClient._stop``).

The DEALER's ``zmq.FD`` is edge-triggered (``kvd.loop_socket``): a send may consume the
edge that announced a reply. So the reading thread takes messages until ``zmq.EVENTS``
shows none before it sleeps in ``poll``, and a thread that sends checks ``EVENTS`` after
its send and wakes the reading thread (a pipe in its poll) when a message is waiting.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import zmq

from kvd.client.base import (
    Call,
    Region,
    RequestBuilder,
    context,
    dealer,
    decode_replies,
    result_of,
    stoppable,
)
from kvd.client.lifeline import LAST_WORDS_S, ClientLifeline
from kvd.errors import DaemonUnavailable, KvdError
from kvd.loop_socket import NOBLOCK, descriptor, has_message
from kvd.protocol import Bye, Done, Reply, encode

log = logging.getLogger(__name__)
_MAIN_THREAD = threading.main_thread().ident  # (signal handlers run in it: _wait_reply)


class Transfer:
    """A request in flight (``put``, ``lend``, ``start_get``, ``start_pull``): ``t.wait()``,
    ``t.done()``, ``t.cancel()``."""

    def __init__(self, client: KvdClient, call: Call, started: float) -> None:
        self._client = client
        self._call = call
        self._started = started
        self._result: Any = None
        self._error: BaseException | None = None
        self._finished = False
        self.req_id: int = call.msg.req_id
        self.key: str = call.msg.key

    def done(self) -> bool:
        """Whether it has ended; never waits (another thread's wait included)."""
        if not self._finished:
            reply = self._client._wait_reply(self.req_id, 0.0, poll_only=True)
            if reply is not None:
                self._settle(reply)
        return self._finished

    def _settle(self, reply: Reply) -> None:
        self._finished = True
        try:
            self._result = result_of(self._call, reply, time.perf_counter() - self._started)
        except KvdError as exc:
            self._error = exc

    def wait(self, timeout_s: float | None = None) -> int:
        """Bytes moved, once the receiving daemon has them; raises the transfer's error."""
        if not self._finished:
            wait_s = self._call.timeout_s if timeout_s is None else timeout_s
            reply = self._client._wait_reply(self.req_id, wait_s)
            if reply is None:
                raise self._client._b.unavailable(f"transfer {self.key!r}", wait_s)
            self._settle(reply)
        if self._error is not None:
            raise self._error
        return int(self._result)

    def cancel(self, timeout_s: float | None = None) -> None:
        """Cancel in the daemon; returns when it is settled: the daemon reads and writes
        the blocks no more (``wait`` then raises ``Cancelled``, unless the transfer had
        finished). ``DaemonUnavailable`` if it could not say so in time: the client is
        then closed."""
        if not self.done():
            self._client._stop(self.req_id, timeout_s)


class KvdClient:
    """Talk to the local daemon: ``with KvdClient() as c: c.ping()``.

    Safe to share between threads: calls from several threads are in flight at once, each
    waits only for its own reply (a blocking ``get`` in one thread holds up no other's
    call)."""

    def __init__(self, socket_path: str | None = None, *, name: str = "",
                 timeout_s: float = 30.0) -> None:
        self._b = RequestBuilder(socket_path, name, timeout_s)
        self._sock: zmq.Socket[Any] | None = None  # the DEALER
        self._lifeline: ClientLifeline | None = None
        self._poller: select.poll | None = None
        # The reading thread sleeps in poll on the DEALER's descriptor, the lifeline and
        # this pipe, which a sender writes to when its send took the DEALER's edge.
        self._wake_r = self._wake_w = -1  # (made by connect)
        self._gone_at = 0.0  # when the lifeline was seen closed (0: not yet)
        # Held around each call on the DEALER (and while it is closed): ZeroMQ sockets are
        # not thread-safe. Never held while waiting for a reply.
        self._write_lock = threading.RLock()
        # Guards the replies' side (stash, outstanding ids, who reads, _dead); threads
        # whose reply has not come sleep on _replies while another reads.
        self._replies_lock = threading.RLock()
        self._replies = threading.Condition(self._replies_lock)
        # Both are reentrant (a signal handler that closes the client may run while its
        # thread holds one) and taken with ``with`` on the lock itself: the exception of a
        # signal handler (KeyboardInterrupt) can strike in the Python code of
        # Condition.__enter__ or between an acquire and a ``try``, leaving it held.
        self._reading = False  # a thread is reading the socket (at most one)
        self._sleepers = 0  # threads asleep on _replies (none: no one to wake)
        self._others = 0  # threads other than the main one waiting for a reply
        self._dead: DaemonUnavailable | None = None
        self._segments_lock = threading.Lock()
        self._stash: dict[int, Reply] = {}
        self._outstanding: set[int] = set()
        self._closed = False  # close began: only its Bye is sent from now on
        self._shut = threading.Event()  # close ended
        self.node_id = ""
        self.epoch = 0

    @property
    def socket_path(self) -> str:
        return self._b.socket_path

    @property
    def name(self) -> str:
        return self._b.name

    def __enter__(self) -> KvdClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self, timeout_s: float | None = None) -> None:
        """Connect and say hello; ``DaemonUnavailable`` naming the socket if no daemon
        answers within the timeout."""
        self._b.check_socket()
        wait_s = self._b.hello_timeout(timeout_s)
        self._lifeline = ClientLifeline.connect(self._b.segment_socket, wait_s)
        self._sock = dealer(context(), self._b.socket_path)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = select.poll()
        self._poller.register(descriptor(self._sock), select.POLLIN)
        self._poller.register(self._lifeline.fileno(), 0)  # (its end: POLLHUP, always)
        self._poller.register(self._wake_r, select.POLLIN)
        try:
            welcome = self._call(self._b.hello(wait_s, self._lifeline.token))
        except (KvdError, OSError) as exc:
            self.close()
            raise DaemonUnavailable(
                f"kvd daemon at {self._b.socket_path} did not answer hello: {exc}"
            ) from None
        self.node_id, self.epoch = welcome.node_id, welcome.epoch
        self._b.welcomed(welcome)

    def close(self) -> None:
        """Close the session. Its requests still in flight are stopped first: this
        returns once the daemon says no more bytes move in their blocks (or, past the
        client's timeout without that word, with a warning). Calls of other threads then
        end: those in flight with the daemon's answer (the Bye stops them first), later
        ones with ``DaemonUnavailable``."""
        with self._write_lock:
            if self._closed:
                return
            self._closed = True  # other threads send nothing after the Bye
        try:
            if self._sock is not None and self.epoch and self._dead is None:
                with self._replies_lock:
                    in_flight = bool(self._outstanding - set(self._stash))
                try:
                    self._call(self._b.bye(in_flight))
                except (KvdError, OSError) as exc:
                    if in_flight:
                        log.warning("closing with requests in flight: %s", exc)
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        """Every wait fails from now on; the sockets are closed once no thread polls them
        (a descriptor closed under a poll does not wake it, and its number may be
        reused)."""
        with self._replies_lock:
            if self._dead is None:
                self._dead = DaemonUnavailable("client closed")
            self._wake()
        if self._sock is not None:
            self._wake_reader()
            deadline = time.monotonic() + self._b.timeout_s
            with self._replies_lock:
                while self._reading and (left := deadline - time.monotonic()) > 0:
                    self._sleep(left)
            with self._write_lock:
                self._sock.close(linger=0)
        if self._lifeline is not None:
            self._lifeline.close()
        with self._write_lock:  # (a thread that wakes the reader writes under it)
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
        self._shut.set()

    # ------------------------------------------------------------ I/O

    def _sleep(self, timeout_s: float) -> None:
        """Until woken (``_wake``) or ``timeout_s``. (Under ``_replies_lock``.)"""
        self._sleepers += 1
        try:
            self._replies.wait(timeout_s)
        finally:
            self._sleepers -= 1

    def _wake(self) -> None:
        """Wake the threads asleep on ``_replies``, if any. (Under ``_replies_lock``.)"""
        if self._sleepers:
            self._replies.notify_all()

    def _write(self, payload: bytes) -> None:
        """Queue one message on the DEALER, then wake the reading thread if the send took
        the edge of a message waiting (module doc). (Under ``_write_lock``.)"""
        assert self._sock is not None
        try:
            self._sock.send(payload, NOBLOCK)
        except zmq.Again:
            if self._lifeline is not None and self._lifeline.gone():
                raise self._die(self._b.disconnected()) from None
            raise self._die(DaemonUnavailable(
                f"kvd daemon at {self._b.socket_path} stopped reading requests (its "
                "queue for this client is full): create a new client")) from None
        except zmq.ZMQError:
            raise self._die(self._b.disconnected()) from None
        # A thread asleep in poll is woken if this send took the edge of a message. (One
        # that starts reading after this checks for a message before it sleeps.)
        if self._reading and has_message(self._sock):
            self._wake_reader()

    def _wake_reader(self) -> None:
        with self._write_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(OSError):  # (full: it is woken already)
                    os.write(self._wake_w, b"!")

    def _die(self, err: DaemonUnavailable) -> DaemonUnavailable:
        """The connection is unusable: every wait fails from now on, with the first
        cause."""
        with self._replies_lock:
            if self._dead is None:
                self._dead = err
            self._wake()
            return self._dead

    def _send(self, call: Call, waits: bool = False) -> bool:
        """Send ``call``. ``waits``: the caller waits for its reply next, and is counted
        as waiting from now on (``_wait_reply``, to which it passes the result)."""
        req_id = call.msg.req_id
        counted = waits and threading.get_ident() != _MAIN_THREAD
        with self._write_lock:  # (another thread's write holds it at most its timeout)
            if self._sock is None or (self._closed and not isinstance(call.msg, Bye)):
                raise DaemonUnavailable("client is not connected")
            if self._dead is not None:
                raise self._dead
            with self._replies_lock:  # before it goes: another thread may read its reply
                self._outstanding.add(req_id)
                self._others += counted
            try:
                self._write(encode(call.msg))
            except BaseException:
                with self._replies_lock:
                    self._outstanding.discard(req_id)
                    self._others -= counted
                    self._wake()  # (a main thread may wait for this one to read)
                raise
        return counted

    def _wait_reply(self, req_id: int, timeout_s: float, poll_only: bool = False,
                    counted: bool | None = None) -> Reply | None:
        """The reply to ``req_id``, or None if it has not come within ``timeout_s`` (at
        once with ``poll_only``: never waits, not even for another thread's read).

        One waiting thread at a time reads the socket (the reader), and keeps every reply
        to an outstanding request in the stash, waking the other waiters; they sleep until
        theirs is there, their deadline passes (they return without reading) or the reader
        leaves, once its own reply came or its deadline passed: one of them reads then.

        Signal handlers run in the main thread, and the exception one raises there (a
        ``KeyboardInterrupt``) may strike between reading replies and stashing them: the
        main thread reads only while no other thread waits, and hands the reading on when
        one does, so that it loses no other thread's reply. Another thread counts as
        waiting from before its request goes (``_send``: ``counted``, ended here)."""
        deadline = time.monotonic() + timeout_s
        main = threading.get_ident() == _MAIN_THREAD
        if counted is None:
            counted = not main
            if counted:
                with self._replies_lock:
                    self._others += 1
        reading = False
        try:
            while True:
                with self._replies_lock:
                    while not reading:
                        reply = self._taken(req_id)
                        if reply is not None:
                            return reply
                        left = 0.0 if poll_only else deadline - time.monotonic()
                        if not self._reading and not (main and self._others):
                            reading = self._reading = True
                        elif left <= 0:
                            return None
                        else:
                            self._sleep(left)
                left = 0.0 if poll_only else deadline - time.monotonic()
                ready = self._ready(left)
                if ready and main and self._others:  # (read again under the lock)
                    with self._replies_lock:
                        if self._others:  # they came while it waited: one of them reads
                            self._reading = reading = False
                            self._wake()
                            continue
                payloads = self._receive() if ready else []
                with self._replies_lock:
                    # Taken in the order read, before another thread may read on: a
                    # request's reply is stashed before its cancel's (``_stop``).
                    if self._take(payloads):
                        self._wake()
                    reply = self._taken(req_id)
                    if reply is not None or left <= 0:
                        return reply
        finally:
            with self._replies_lock:
                if reading:
                    self._reading = False
                if counted:
                    self._others -= 1
                if not self._reading:
                    self._wake()  # one of them reads on

    def _taken(self, req_id: int) -> Reply | None:
        """The stashed reply to ``req_id``, out of the stash; raises once the client is
        dead (after the replies that came before). (Under ``_replies_lock``.)"""
        if req_id in self._stash:
            self._outstanding.discard(req_id)
            return self._stash.pop(req_id)
        if self._dead is not None:
            raise self._dead
        return None

    def _ready(self, wait_s: float) -> bool:
        """Whether there is something to read (or the daemon is gone) within ``wait_s``."""
        assert self._poller is not None and self._sock is not None
        with self._write_lock:
            if self._sock.closed or has_message(self._sock):
                return True
        if self._gone_at:  # (the daemon's last words: see _receive)
            words_left = self._gone_at + LAST_WORDS_S - time.monotonic()
            if words_left <= 0:
                return True  # (_receive says the daemon is gone)
            wait_s = min(wait_s, words_left)
        ready = self._poller.poll(math.ceil(max(0.0, wait_s) * 1000))
        if any(fd == self._wake_r for fd, _ in ready):
            with contextlib.suppress(OSError):
                while os.read(self._wake_r, 4096):
                    pass
        return bool(ready)

    def _receive(self) -> list[bytes] | None:
        """The replies waiting (it is ready): [] if none after all, None once the daemon
        is gone (its lifeline closed) and nothing is left to read."""
        assert self._sock is not None and self._lifeline is not None
        payloads: list[bytes] = []
        with self._write_lock:
            try:
                while has_message(self._sock):
                    payloads.append(self._sock.recv(NOBLOCK))
            except zmq.ZMQError:  # (closed: the client is shutting down)
                return None
        if payloads:
            return payloads
        if not self._gone_at and self._lifeline.gone():
            # The daemon is gone. Its last replies travel apart from the lifeline and may
            # still come: they are taken for LAST_WORDS_S, then the waits fail.
            self._gone_at = time.monotonic()
            with self._write_lock:
                assert self._poller is not None
                with contextlib.suppress(KeyError, ValueError):
                    self._poller.unregister(self._lifeline.fileno())
        if self._gone_at and time.monotonic() - self._gone_at >= LAST_WORDS_S:
            return None
        return payloads

    def _take(self, payloads: list[bytes] | None) -> bool:
        """Replies into the stash (None: the daemon is gone, and the client dead).
        Whether a waiter has news. (Under ``_replies_lock``.)"""
        if payloads is None:
            self._dead = self._dead or self._b.disconnected()
            return True
        news = False
        for reply in decode_replies(payloads):
            if reply.req_id in self._outstanding:
                self._stash[reply.req_id] = reply
                news = True
        return news

    def _call(self, call: Call) -> Any:
        started = time.perf_counter()
        req_id = call.msg.req_id
        try:
            counted = self._send(call, waits=True)
            reply = self._wait_reply(req_id, call.timeout_s, counted=counted)
        except KvdError:
            raise  # the connection is gone, or the request did not go
        except BaseException:  # KeyboardInterrupt and the like end the call here
            self._abandon(call)  # (struck in _send, it may have gone all the same)
            raise
        if reply is None:
            reply = self._abandon(call)  # (it may have come while the daemon stopped it)
            if reply is None:
                raise self._b.unavailable(type(call.msg).__name__.lower(), call.timeout_s)
        return result_of(call, reply, time.perf_counter() - started)

    def _abandon(self, call: Call) -> Reply | None:
        """We stop waiting for ``call``: stop it in the daemon first, unless it has been
        answered or is one the daemon answers at once (``_stop``). Its reply, if any."""
        req_id = call.msg.req_id
        try:
            with self._replies_lock:
                answered = req_id in self._stash
            if stoppable(call) and not answered:
                with contextlib.suppress(DaemonUnavailable):  # dropped: the caller's error
                    self._stop(req_id, None)
        finally:
            with self._replies_lock:
                self._outstanding.discard(req_id)
        with self._replies_lock:
            return self._stash.pop(req_id, None)

    def _stop(self, target: int, timeout_s: float | None) -> None:
        """Cancel request ``target`` in the daemon and return once the daemon says it has
        ended (its reply, stashed, then the cancel's): no more bytes land in or are read
        from its blocks. Without that word within ``timeout_s`` (the client's by default),
        or when the wait is interrupted, the connection is dropped (``_drop``): the daemon
        then stops the session's requests, and ``DaemonUnavailable`` says what that
        leaves. While the client closes, its Bye stops every request: the end of
        ``close`` is waited for instead."""
        if self._dead is not None:
            raise self._dead  # the daemon has closed the session, or we dropped it
        call = self._b.cancel(target, timeout_s)
        why = ""
        if self._closed:
            if not self._shut.wait(call.timeout_s):
                why = f"the client did not close within {call.timeout_s:g}s"
        else:
            try:
                counted = self._send(call, waits=True)
                reply = self._wait_reply(call.msg.req_id, call.timeout_s, counted=counted)
            except KvdError as exc:
                why = exc.message
            except BaseException:
                self._drop(target, "the wait for its cancel was interrupted")
                raise
            else:
                if reply is None:
                    with self._replies_lock:
                        self._outstanding.discard(call.msg.req_id)
                    why = f"no answer to its cancel within {call.timeout_s:g}s"
                elif not isinstance(reply, Done):
                    why = getattr(reply, "message", type(reply).__name__)
        if why:
            raise self._drop(target, why)

    def _drop(self, target: int, why: str) -> DaemonUnavailable:
        """Close the connection of a client whose request ``target`` the daemon did not
        confirm stopped: the daemon then cancels every request of the session and keeps
        its regions mapped until they end. Every wait fails from now on."""
        err = self._b.unconfirmed(target, why)
        log.warning("%s", err.message)
        self._die(err)
        if self._lifeline is not None:  # the daemon ends the session when it closes
            with contextlib.suppress(OSError):
                self._lifeline.sock.shutdown(socket.SHUT_RDWR)
        self._wake_reader()
        return err

    # ------------------------------------------------------------ operations

    def ping(self, *, timeout_s: float | None = None) -> float:
        """Round-trip time to the daemon, in seconds."""
        result: float = self._call(self._b.ping(timeout_s))
        return result

    def drain(self, *, grace_s: float | None = None,
              timeout_s: float | None = None) -> dict[str, Any]:
        """Make the daemon stop taking work, finish what is in flight, and exit; returns
        its report (how much finished, how much was cancelled at the grace)."""
        report: dict[str, Any] = self._call(self._b.drain(grace_s, timeout_s))
        return report

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self._call(self._b.stats(timeout_s))
        return result

    def register(self, name: str, tensors: Sequence[Any], *, block_dim: int = 0,
                 timeout_s: float | None = None) -> Region:
        """Share tensors (from ``kvd.shared_empty``) with the daemon once."""
        call = self._b.register(name, tensors, block_dim, timeout_s)
        with self._segments_lock:  # two threads registering one new segment: hand it once
            segments = self._b.segments_to_hand(call)
            if segments:
                if self._lifeline is None or self._dead is not None:
                    raise self._dead or DaemonUnavailable("client is not connected")
                self._lifeline.hand_over(segments, call.timeout_s)
                self._b.handed(segments)
        region: Region = self._call(call)
        return region

    def unregister(self, region: Region | int, *, timeout_s: float | None = None) -> None:
        self._call(self._b.unregister(region, timeout_s))

    def offload(self, key: str, region: Region | int, blocks: Iterable[int], *,
                ttl_s: float | None = None, timeout_s: float | None = None) -> int:
        """Copy blocks into the daemon's host pool under ``key``; returns bytes stored."""
        nbytes: int = self._call(self._b.offload(key, region, blocks, ttl_s, timeout_s))
        return nbytes

    def get(self, key: str, region: Region | int, blocks: Iterable[int], *,
            timeout_s: float | None = None) -> int:
        """Wait up to ``timeout_s`` for ``key`` and write it into ``blocks``."""
        nbytes: int = self._call(self._b.get(key, region, blocks, timeout_s))
        return nbytes

    def put(self, key: str, region: Region | int, blocks: Iterable[int], *,
            to: str | None = None, ttl_s: float | None = None,
            timeout_s: float | None = None) -> Transfer:
        """Send blocks to daemon ``to`` (this one by default) under ``key``."""
        return self._start(self._b.put(key, region, blocks, to, ttl_s, timeout_s))

    def lend(self, key: str, region: Region | int, blocks: Iterable[int], *, ttl_s: float,
             timeout_s: float | None = None) -> Transfer:
        """Publish blocks in place for one reader (a get here, or a peer's pull). The
        transfer ends when the daemon no longer reads them, with the bytes that reader
        took (0 if nobody did within ``ttl_s``); do not reuse the blocks before."""
        return self._start(self._b.lend(key, region, blocks, ttl_s, timeout_s))

    def start_get(self, key: str, region: Region | int, blocks: Iterable[int], *,
                  timeout_s: float | None = None) -> Transfer:
        """``get`` without blocking: the returned transfer ends when the bytes are in."""
        return self._start(self._b.get(key, region, blocks, timeout_s))

    def start_pull(self, key: str, src: str, region: Region | int, blocks: Iterable[int], *,
                   timeout_s: float | None = None, wait_for_key_s: float = 0.0) -> Transfer:
        """``pull`` without blocking: the returned transfer ends when the bytes are in."""
        return self._start(self._b.pull(key, src, region, blocks, timeout_s, wait_for_key_s))

    def _start(self, call: Call) -> Transfer:
        started = time.perf_counter()
        try:
            self._send(call)
        except KvdError:
            raise
        except BaseException:  # (a KeyboardInterrupt may strike once it has gone)
            self._abandon(call)
            raise
        return Transfer(self, call, started)

    def pull(self, key: str, src: str, region: Region | int, blocks: Iterable[int], *,
             timeout_s: float | None = None, wait_for_key_s: float = 0.0) -> int:
        """Fetch ``key`` published (or offloaded) on daemon ``src`` (host:port) into
        ``blocks``. If ``src`` does not hold the key it fails (``UnknownKey``) at once, or,
        with ``wait_for_key_s``, once the key has not appeared there for that long."""
        nbytes: int = self._call(self._b.pull(key, src, region, blocks, timeout_s,
                                              wait_for_key_s))
        return nbytes

    def publish(self, key: str, region: Region | int, blocks: Iterable[int], *,
                ttl_s: float | None = None, timeout_s: float | None = None) -> int:
        """Offer blocks under ``key`` in place (no copy) until unpublished."""
        nbytes: int = self._call(self._b.publish(key, region, blocks, ttl_s, timeout_s))
        return nbytes

    def unpublish(self, key: str, *, timeout_s: float | None = None) -> None:
        self._call(self._b.unpublish(key, timeout_s))

    def delete(self, key: str, *, timeout_s: float | None = None) -> None:
        self._call(self._b.delete(key, timeout_s))

    def cancel(self, transfer: Transfer, *, timeout_s: float | None = None) -> None:
        transfer.cancel(timeout_s)
