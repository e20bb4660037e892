"""A ZeroMQ socket read and written on an asyncio loop, without ``zmq.asyncio``.

The daemon's local and peer planes and the async client each own ZeroMQ sockets. A
``LoopSocket`` adds the socket's ``zmq.FD`` to the loop with ``add_reader`` and takes
every waiting message right in that callback, handing each one (its frames, copied) to
``on_message``. Measured on the 2-core machine, a 200-byte round trip costs 51-82 us this
way against 87-143 us through ``zmq.asyncio``, which wakes a task and builds a future per
message.

``zmq.FD`` is edge-triggered: it becomes readable when ZeroMQ's command mailbox gets a
command, and any call on the socket (a send included) may consume that command. So
reading goes on until ``zmq.EVENTS`` shows no ``POLLIN``, and a send outside a read
schedules a read for the next loop turn, which checks ``EVENTS`` again: a message that
came in while the send ran would otherwise wait, with no edge left to announce it, until
the next message arrives (a hang, when none does). One check per loop turn, not one per
send: a turn that sends the offers of 64 transfers asks ``EVENTS`` once.

A batch of ``_BATCH`` messages at most is taken per callback; more waiting are taken in
the next loop turn, so one busy socket cannot starve the loop's other callbacks.

``new_context`` makes the daemon's ZeroMQ context, and seeds libc's rand() first: the
routing ids its ROUTERs make up would otherwise be guessable (see ``_seed_rand``).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import secrets
import struct
from collections.abc import Callable, Sequence
from typing import Any, cast

import zmq

log = logging.getLogger(__name__)

_BATCH = 256
# Frames below this size are copied into ZeroMQ's message at send; larger ones are sent
# without a copy, their buffer held until ZeroMQ has written them. pyzmq frees such a
# buffer in its collector thread, which takes the GIL for each one: for an offer that
# carries its bytes (up to 64 KiB and its header) that costs the sending daemon more than
# the copy (~5% of its GIL-holding samples with 64 transfers in flight, py-spy).
COPY_BELOW_BYTES = 128 * 1024


# Plain ints: pyzmq's enum members cost a microsecond more per use, on every message.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)


def has_message(sock: zmq.Socket[Any]) -> bool:
    """Whether a whole message waits to be received (``zmq.EVENTS``; it also processes
    ZeroMQ's pending commands, which is what resets the edge of ``zmq.FD``)."""
    return bool(cast(int, sock.get(_EVENTS)) & _POLLIN)


def descriptor(sock: zmq.Socket[Any]) -> int:
    """The socket's ``zmq.FD``: readable (edge-triggered) when ZeroMQ has news for it."""
    return cast(int, sock.getsockopt(zmq.FD))


_MONITOR_EVENT = struct.Struct("=HI")  # a monitor message's first frame: event, value


def monitor_event(frames: Sequence[bytes]) -> tuple[int, int] | None:
    """A socket monitor's message as (event, value); None if it is not one."""
    if len(frames) == 2 and len(frames[0]) == _MONITOR_EVENT.size:
        event, value = _MONITOR_EVENT.unpack(frames[0])
        return event, value
    return None


def _seed_rand() -> None:
    """Seed libc's rand() from the OS's randomness, before a context's ROUTERs are made.

    Why: a ROUTER names each connection that brings no routing id of its own 0x00 + a
    counter, and libzmq (4.3.5, ``generate_random``) starts each ROUTER's counter at
    rand(), which nothing in the process seeds: every daemon of a build starts them at the
    same values (its peer ROUTER at 0xe43c9869). A stranger who connects with the next
    values as its own routing ids (``ZMQ_ROUTING_ID``), then connects without one, makes
    the ROUTER give a new connection a name in use, and libzmq aborts the process
    (``zmq_assert`` in add_out_pipe). Seeded, each id a stranger holds is the next one
    with a chance of one in 2**32."""
    ctypes.CDLL(None).srand(ctypes.c_uint(secrets.randbits(32)))


def new_context() -> zmq.Context[Any]:
    """The daemon's context, from which it makes every socket (its ROUTERs too), with
    libc's rand() seeded first (``_seed_rand``). One I/O thread: more gained nothing at
    control-message sizes, and each one is a thread to wake."""
    _seed_rand()
    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    ctx.setsockopt(zmq.LINGER, 0)  # (sockets made from it; a close never waits)
    return ctx


class LoopSocket:
    """``sock`` read on ``loop``: each message's frames go to ``on_message`` as they come
    (bytes, or ``zmq.Frame`` objects with ``copy=False``).

    ``send`` queues one message without blocking (False when ZeroMQ refuses it: the
    peer's queue is full, or, on a ROUTER with ``ROUTER_MANDATORY``, the routing id is
    unknown). A handler's bug is logged and reading goes on."""

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[Any]], None],
                 loop: asyncio.AbstractEventLoop | None = None, what: str = "", *,
                 copy: bool = True) -> None:
        self.sock = sock
        # False: on_message gets ``zmq.Frame``s, whose properties (``__fd``, ``User-Id``)
        # a handler may need; True: bytes.
        self._copy = copy
        self.what = what or "zmq socket"
        self._on_message = on_message
        self._loop = loop or asyncio.get_running_loop()
        self._fd = descriptor(sock)
        self._queued = False  # a read is scheduled with call_soon
        self._in_read = False  # sends from handlers: _read checks EVENTS next anyway
        self._watching = False
        self.closed = False
        self.refused_errno = 0  # why the last send that returned False was refused

    def start(self) -> None:
        """Watch the socket; what arrived before is read in the next loop turn."""
        if self._watching or self.closed:
            return
        self._watching = True
        self._loop.add_reader(self._fd, self._read)
        self._read_soon()

    def pause(self) -> None:
        """Stop reading (messages wait in ZeroMQ's queue); ``start`` resumes."""
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self._fd)

    def read_now(self) -> None:
        """Take every message that waits now, before anything else runs (its owner is
        about to act on what they say)."""
        while not self.closed and (frames := self._next()) is not None:
            self._handle(frames)

    def _next(self) -> list[Any] | None:
        """The next message waiting, or None (none, or the socket was closed under us)."""
        try:
            if not has_message(self.sock):
                return None
            return self.sock.recv_multipart(NOBLOCK, copy=self._copy)
        except zmq.ZMQError:  # (Again included)
            return None

    def _handle(self, frames: list[Any]) -> None:
        try:
            self._on_message(frames)
        except Exception:  # a bug must not stop the reader
            log.exception("unhandled error in the %s message handler", self.what)

    def _read_soon(self) -> None:
        if not self._queued:
            self._queued = True
            self._loop.call_soon(self._read)

    def _read(self) -> None:
        self._queued = False
        if not self._watching:
            return
        self._in_read = True
        try:
            for _ in range(_BATCH):
                frames = self._next()
                if frames is None:
                    return
                self._handle(frames)
                if not self._watching:
                    return
        finally:
            self._in_read = False
        self._read_soon()  # more may wait: the next turn takes them

    def send(self, frames: Sequence[bytes | memoryview]) -> bool:
        """Queue one message (its frames); False if ZeroMQ would not take it now."""
        if self.closed:
            return False
        sock = self.sock
        last = len(frames) - 1
        try:
            for i, frame in enumerate(frames):
                sock.send(frame, (_SNDMORE if i < last else 0) | NOBLOCK,
                          copy=len(frame) < COPY_BELOW_BYTES)
        except zmq.ZMQError as exc:  # Again (queue full), EHOSTUNREACH (unknown routing id)
            # (a multipart message is atomic: frames queued before the failure are dropped)
            self.refused_errno = exc.errno or 0
            return False
        finally:
            # The send may have consumed the edge that announced a message: the next loop
            # turn reads what waits (module doc). Within a read, the read checks anyway.
            if self._watching and not self._in_read:
                self._read_soon()
        return True

    def close(self, linger_s: float = 0.0) -> None:
        """Stop reading and close the socket; ``linger_s``: how long what is queued may
        still go out (in ZeroMQ's I/O thread; this does not wait)."""
        if self.closed:
            return
        self.pause()
        self.closed = True
        self.sock.close(linger=int(linger_s * 1000))
