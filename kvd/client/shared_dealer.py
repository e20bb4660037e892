"""``SharedDealer``: the connection of a ``KvdClient``, shared by any number of threads.

It owns the ZeroMQ DEALER on the daemon's local socket, polled here (no event loop), with
the client's lifeline (``kvd.client.lifeline``) in the same poll: a daemon that goes away
closes it, and every wait then fails at once. Calls from several threads are in flight at
once, each waiting only for its own reply: a lock is held only around each call on the
DEALER (ZeroMQ sockets are not thread-safe), and one waiting thread at a time reads,
keeping each reply for its owner (a waiting thread, or a ``Transfer`` not yet asked) in
the stash and waking the others (``wait_reply``). What a request means, and how one is
stopped in the daemon, is the client's business (``kvd.client.sync``); this module only
moves messages and hands each reply to whoever waits for it.

The DEALER's ``zmq.FD`` is edge-triggered (``kvd.loop_socket``): a send may consume the
edge that announced a reply. So the reading thread takes messages until ``zmq.EVENTS``
shows none before it sleeps in ``poll``, and a thread that sends checks ``EVENTS`` after
its send and wakes the reading thread (a pipe in its poll) when a message is waiting.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from kvd.client.base import Call, RequestBuilder, decode_replies, ended_by, open_connection
from kvd.client.lifeline import LAST_WORDS_S, ClientLifeline
from kvd.client.shm import Segment
from kvd.errors import DaemonUnavailable
from kvd.loop_socket import NOBLOCK, descriptor, has_message
from kvd.protocol import Bye, Reply

_MAIN_THREAD = threading.main_thread().ident  # (signal handlers run in it: wait_reply)
_HAND_OVER: list[bytes] = []  # (_receive: the main thread leaves the reading to another)


class SharedDealer:
    """The DEALER, lifeline and reply stash of one client; safe to share between threads."""

    def __init__(self, builder: RequestBuilder) -> None:
        self._b = builder
        self._sock: zmq.Socket[Any] | None = None  # the DEALER
        self._monitor: zmq.Socket[Any] | None = None  # its connection's end (base.ended_by)
        self._dealer_ended = False
        self._lifeline: ClientLifeline | None = None
        self._poller: select.poll | None = None
        # The reading thread sleeps in poll on the DEALER's descriptor, the lifeline and
        # this pipe, which a sender writes to when its send took the DEALER's edge.
        self._wake_r = self._wake_w = -1  # (made by open)
        self._gone_at = 0.0  # when the lifeline was seen closed (0: not yet)
        # Held around each call on the DEALER (and while it is closed): ZeroMQ sockets are
        # not thread-safe. Never held while waiting for a reply.
        self._write_lock = threading.RLock()
        # Guards the replies' side (stash, outstanding ids, who reads, dead); threads
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
        # Why every wait fails (the daemon is gone, or the client closed or dropped the
        # connection); None while the connection is usable.
        self.dead: DaemonUnavailable | None = None
        self._stash: dict[int, Reply] = {}
        self._outstanding: set[int] = set()
        self.closing = False  # close began (begin_close): only its Bye is sent from now on
        self.shut = threading.Event()  # close ended (shut_down)

    def open(self, wait_s: float) -> None:
        """Connect the lifeline, then the DEALER (the daemon's hello comes next)."""
        self._lifeline, self._sock, self._monitor = open_connection(self._b.socket_path, wait_s)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = select.poll()
        self._poller.register(descriptor(self._sock), select.POLLIN)
        self._poller.register(descriptor(self._monitor), select.POLLIN)
        self._poller.register(self._lifeline.fileno(), 0)  # (its end: POLLHUP, always)
        self._poller.register(self._wake_r, select.POLLIN)

    # ------------------------------------------------------------ state, for the client

    @property
    def connected(self) -> bool:  # (``open`` made the DEALER; it may have closed since)
        return self._sock is not None

    def begin_close(self) -> bool:
        """From now on only a Bye is sent; False if a close began already."""
        with self._write_lock:
            if self.closing:
                return False
            self.closing = True  # other threads send nothing after the Bye
            return True

    def in_flight(self) -> bool:
        with self._replies_lock:
            return bool(self._outstanding - set(self._stash))

    def answered(self, req_id: int) -> bool:
        with self._replies_lock:
            return req_id in self._stash

    def forget(self, req_id: int) -> Reply | None:
        """Nobody waits for ``req_id`` any more: a reply to it that comes is dropped. The
        one stashed already, if any."""
        with self._replies_lock:
            self._outstanding.discard(req_id)
            return self._stash.pop(req_id, None)

    def hand_over(self, segments: Sequence[Segment], timeout_s: float) -> None:
        """Give the daemon shared-memory segments, on the lifeline."""
        if self._lifeline is None or self.dead is not None:
            raise self.dead or DaemonUnavailable("client is not connected")
        self._lifeline.hand_over(segments, timeout_s)

    def hang_up(self, err: DaemonUnavailable) -> None:
        """Fail every wait with ``err`` and close the lifeline's connection: the daemon
        ends the session when it sees it close."""
        self._die(err)
        if self._lifeline is not None:
            with contextlib.suppress(OSError):
                self._lifeline.sock.shutdown(socket.SHUT_RDWR)
        self._wake_reader()

    # ------------------------------------------------------------ closing

    def shut_down(self) -> None:
        """Every wait fails from now on; the sockets are closed once no thread polls them
        (a descriptor closed under a poll does not wake it, and its number may be
        reused)."""
        self._die(DaemonUnavailable("client closed"))
        if self._sock is not None:
            self._wake_reader()
            deadline = time.monotonic() + self._b.timeout_s
            with self._replies_lock:
                while self._reading and (left := deadline - time.monotonic()) > 0:
                    self._sleep(left)
            with self._write_lock:
                if self._monitor is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        self._sock.disable_monitor()
                    self._monitor.close(linger=0)
                self._sock.close(linger=0)
        if self._lifeline is not None:
            self._lifeline.close()
        with self._write_lock:  # (a thread that wakes the reader writes under it)
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
        self.shut.set()

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
        """Wake the thread asleep in poll, if one is (from any thread)."""
        with self._write_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(OSError):  # (full: it is woken already)
                    os.write(self._wake_w, b"!")

    def _die(self, err: DaemonUnavailable) -> DaemonUnavailable:
        """The connection is unusable: every wait fails from now on, with the first
        cause."""
        with self._replies_lock:
            if self.dead is None:
                self.dead = err
            self._wake()
            return self.dead

    def send(self, call: Call, waits: bool = False) -> bool:
        """Send ``call``. ``waits``: the caller waits for its reply next, and is counted
        as waiting from now on (``wait_reply``, to which it passes the result)."""
        req_id = call.msg.req_id
        counted = waits and threading.get_ident() != _MAIN_THREAD
        with self._write_lock:  # (another thread's write holds it at most its timeout)
            if self._sock is None or (self.closing and not isinstance(call.msg, Bye)):
                raise DaemonUnavailable("client is not connected")
            if self.dead is not None:
                raise self.dead
            with self._replies_lock:  # before it goes: another thread may read its reply
                self._outstanding.add(req_id)
                self._others += counted
            try:
                self._write(self._b.encode(call))
            except BaseException:
                with self._replies_lock:
                    self._outstanding.discard(req_id)
                    self._others -= counted
                    self._wake()  # (a main thread may wait for this one to read)
                raise
        return counted

    def wait_reply(self, req_id: int, timeout_s: float, poll_only: bool = False,
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
        waiting from before its request goes (``send``: ``counted``, ended here)."""
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
                payloads = self._receive(main) if self._ready(left) else []
                with self._replies_lock:
                    if payloads is _HAND_OVER:  # others came while it waited: one reads
                        self._reading = reading = False
                        self._wake()
                        continue
                    # Taken in the order read, before another thread may read on: a
                    # request's reply is stashed before its cancel's (``KvdClient._stop``).
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
        if self.dead is not None:
            raise self.dead
        return None

    def _ready(self, wait_s: float) -> bool:
        """Whether there is something to read (or the daemon is gone) within ``wait_s``."""
        assert self._poller is not None and self._sock is not None
        with self._write_lock:
            if self._sock.closed or has_message(self._sock):
                return True
        if self._gone_at:  # (the daemon's last words: see _receive)
            words_left = self._gone_at + LAST_WORDS_S - time.monotonic()
            if words_left <= 0 or self._dealer_ended:
                return True  # (_receive says the daemon is gone)
            wait_s = min(wait_s, words_left)
        ready = self._poller.poll(math.ceil(max(0.0, wait_s) * 1000))
        if any(fd == self._wake_r for fd, _ in ready):
            with contextlib.suppress(OSError):
                while os.read(self._wake_r, 4096):
                    pass
        return bool(ready)

    def _receive(self, main: bool) -> list[bytes] | None:
        """The replies waiting (it is ready): [] if none after all, None once the daemon
        is gone (its lifeline closed) and nothing is left to read, ``_HAND_OVER`` if
        ``main`` and another thread waits.

        The main thread's check that no other thread waits is made under the write lock,
        which ``send`` holds while it counts its caller as waiting: no other thread's
        request goes between the check and the read, so what the main thread reads is
        no waiting thread's reply. What it read is kept if a signal handler's exception
        strikes while it reads."""
        assert self._sock is not None and self._lifeline is not None
        payloads: list[bytes] = []
        with self._write_lock:
            if main and self._others:
                return _HAND_OVER
            try:
                # The monitor first: a connection's end comes after its last reply, so
                # the replies read next include all of them.
                while self._monitor is not None and has_message(self._monitor):
                    self._dealer_ended |= ended_by(self._monitor.recv_multipart(NOBLOCK))
                while has_message(self._sock):
                    payloads.append(self._sock.recv(NOBLOCK))
            except zmq.ZMQError:  # (closed: the client is shutting down)
                return None
            except BaseException:
                with self._replies_lock:
                    self._take(payloads)
                raise
        if payloads:
            return payloads
        if not self._gone_at and self._lifeline.gone():
            # The daemon is gone. Its last replies travel apart from the lifeline and may
            # still come: they are taken until the DEALER's connection has ended too (or
            # for LAST_WORDS_S), then the waits fail.
            self._gone_at = time.monotonic()
            with self._write_lock:
                assert self._poller is not None
                with contextlib.suppress(KeyError, ValueError):
                    self._poller.unregister(self._lifeline.fileno())
        if self._gone_at and (self._dealer_ended
                              or time.monotonic() - self._gone_at >= LAST_WORDS_S):
            return None
        return payloads

    def _take(self, payloads: list[bytes] | None) -> bool:
        """Replies into the stash (None: the daemon is gone, and the client dead).
        Whether a waiter has news. (Under ``_replies_lock``.)"""
        if payloads is None:
            self.dead = self.dead or self._b.disconnected()
            return True
        news = False
        for reply in decode_replies(payloads):
            if reply.req_id in self._outstanding:
                self._stash[reply.req_id] = reply
                news = True
        return news

