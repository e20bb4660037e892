"""Length-prefixed messages on a stream socket: the local socket's framing.

Each message is a 4-byte big-endian length, then that many bytes (one msgspec message).
``FrameReader`` cuts a byte stream into such payloads as bytes arrive, in any pieces. A
length above the reader's limit is reported instead of delivered; past a second, hard
limit it is reported as soon as its length is read and skipped as it comes, so the stream
stays in step and one runaway message cannot make anyone hold it in memory.

Many connections, each with a large message half sent, could still add up: a daemon's
connections (its local socket's and its peer port's) share one ``FrameBudget`` for the
bytes of their unfinished messages, and the connection whose bytes would take the total
past it is closed.

Why not ZeroMQ here (it was until 2026-11-30): a ZeroMQ message crosses an I/O thread at
each end, two thread wake-ups per message. Measured on the GPU host, a 200-byte round trip
took 77 us over ZeroMQ IPC against 17 us over a plain Unix socket (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
HEADER_BYTES = HEADER.size
# A daemon's budget for unfinished messages, all its connections together, in messages of
# the largest size it takes: its clients and peers all sending one at the same moment fit
# (each is read as it comes, so a message stays unfinished only while it is on its way).
BUDGET_MESSAGES = 64
_REPORT_EVERY_S = 10.0  # a closing for the budget is logged at most this often


def frame(payload: bytes) -> bytes:
    """One message, ready to write."""
    return HEADER.pack(len(payload)) + payload


@dataclass(frozen=True)
class Oversized:
    """A message longer than the reader's limit, not delivered: its length, and its
    bytes if it was short enough to be read whole (for the error reply's ``req_id``)."""

    nbytes: int
    payload: bytes


class FrameReader:
    """Feed bytes in; take whole payloads (and ``Oversized`` notices) out, in order.

    A message longer than ``max_payload_bytes`` is read whole and reported as
    ``Oversized``; one longer than ``skip_above`` is reported as soon as its length is
    read, and its bytes are thrown away as they come, never held."""

    def __init__(self, max_payload_bytes: int, skip_above: int | None = None) -> None:
        self.max_payload_bytes = max_payload_bytes
        self.skip_above = max(max_payload_bytes, skip_above or max_payload_bytes)
        self._buf = bytearray()
        self._pos = 0  # start of what is not taken yet (consumed bytes are cut once)
        self._skip = 0  # bytes of a message still to throw away

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[bytes | Oversized]:
        """The messages completed by ``data`` (a generator: consume it all)."""
        buf = self._buf
        self._cut()  # (what an earlier read took, if its generator was left unfinished)
        buf += data
        yield from self._take(buf)
        # Cut what this read took now, once per read and not once per message: a
        # connection that goes quiet after a large message must not keep holding it.
        self._cut()

    def _cut(self) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0

    def _take(self, buf: bytearray) -> Iterator[bytes | Oversized]:
        while True:
            if self._skip:
                dropped = min(self._skip, len(buf) - self._pos)
                self._pos += dropped
                self._skip -= dropped
                if self._skip:
                    return
            start = self._pos
            if len(buf) - start < HEADER_BYTES:
                return
            (n,) = HEADER.unpack_from(buf, start)
            if n > self.skip_above:
                self._pos = start + HEADER_BYTES
                self._skip = n
                yield Oversized(n, b"")
                continue
            end = start + HEADER_BYTES + n
            if len(buf) < end:
                return
            payload = bytes(buf[start + HEADER_BYTES : end])
            self._pos = end
            yield payload if n <= self.max_payload_bytes else Oversized(n, payload)

    @property
    def pending_bytes(self) -> int:
        """Bytes held for a message not complete yet."""
        return len(self._buf) - self._pos

    def clear(self) -> None:
        """Drop what is held (the connection is being closed)."""
        self._buf = bytearray()
        self._pos = 0
        self._skip = 0


def frame_budget_bytes(*largest_message_bytes: int) -> int:
    """The ``FrameBudget`` of a daemon whose sockets take messages up to these sizes."""
    return BUDGET_MESSAGES * max(largest_message_bytes)


class FrameBudget:
    """The bytes held for unfinished messages by every connection that shares it, against
    one limit (``limit_bytes``) for them all: ``FramedProtocol`` closes the connection
    whose bytes would take the total past it."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self.peak_bytes = 0
        self.refused = 0  # connections closed for it
        self._reported_at = -_REPORT_EVERY_S
        self._unreported = 0

    def report(self) -> int | None:
        """A refusal: whether to log it now (the refusals not logged since, to say so),
        or not (None: one was logged less than ``_REPORT_EVERY_S`` ago)."""
        self.refused += 1
        now = time.monotonic()
        if now - self._reported_at < _REPORT_EVERY_S:
            self._unreported += 1
            return None
        unreported, self._unreported, self._reported_at = self._unreported, 0, now
        return unreported

    def stats(self) -> dict[str, int]:
        return {"held_bytes": self.held_bytes, "limit_bytes": self.limit_bytes,
                "peak_bytes": self.peak_bytes, "refused": self.refused}


class FramedProtocol(asyncio.Protocol):
    """An asyncio connection carrying framed messages: each one (or ``Oversized`` notice)
    goes to ``on_frame`` as it completes, right in the read callback; ``send`` writes one.
    A handler's bug is logged and the reading goes on. ``write_limit``: the transport's
    write-buffer high-water mark, past which ``pause_writing`` is called. ``budget``: the
    ``FrameBudget`` its unfinished message counts against (past it, the connection is
    closed and counted as ``frame_budget`` in ``bad_messages``); ``what``: the
    connection's kind, for that log line."""

    def __init__(self, max_payload_bytes: int, skip_above: int | None = None,
                 write_limit: int | None = None, budget: FrameBudget | None = None,
                 bad_messages: dict[str, int] | None = None, what: str = "") -> None:
        self.frames = FrameReader(max_payload_bytes, skip_above)
        self.what = what or type(self).__name__
        self.transport: asyncio.Transport | None = None
        self._write_limit = write_limit
        self._budget = budget
        self._bad_messages = bad_messages
        self._charged = 0  # the bytes of the budget this connection holds

    def on_frame(self, item: bytes | Oversized) -> None:
        raise NotImplementedError

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if self._write_limit is not None:
            self.transport.set_write_buffer_limits(high=self._write_limit)

    def data_received(self, data: bytes) -> None:
        try:
            for item in self.frames.feed(data):
                if self.transport is None or self.transport.is_closing():
                    return
                try:
                    self.on_frame(item)
                except Exception:  # a bug must not stop the reader
                    log.exception("unhandled error in the %s message handler",
                                  type(self).__name__)
        finally:
            if self._budget is not None:
                self._charge(self._budget)

    def _charge(self, budget: FrameBudget) -> None:
        """Count what this connection now holds; close it if that takes the total past
        the budget (what it holds is dropped at once)."""
        held = self.frames.pending_bytes if self.transport is not None else 0
        budget.held_bytes += held - self._charged
        self._charged = held
        budget.peak_bytes = max(budget.peak_bytes, budget.held_bytes)
        if budget.held_bytes <= budget.limit_bytes or not held:
            return
        if self._bad_messages is not None:
            self._bad_messages["frame_budget"] = self._bad_messages.get("frame_budget", 0) + 1
        unreported = budget.report()
        if unreported is not None:
            peer = self.transport.get_extra_info("peername") if self.transport else None
            log.warning(
                "closing a %s connection%s: its unfinished message (%d bytes so far) would "
                "take the bytes held for unfinished messages, all connections together, "
                "past %d (a sender that never finishes its messages, or too many large "
                "ones at once)%s", self.what,
                f" from {peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "", held,
                budget.limit_bytes,
                f"; {unreported} more closed since the last such line" if unreported else "")
        self._release(budget)
        self.close(abort=True)

    def _release(self, budget: FrameBudget) -> None:
        budget.held_bytes -= self._charged
        self._charged = 0
        self.frames.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._budget is not None:
            self._release(self._budget)

    def send(self, payload: bytes) -> bool:
        """One message; False if the connection is closing or gone."""
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(frame(payload))
        return True

    def close(self, abort: bool = False) -> None:
        """Close after what is queued has gone out; ``abort``: drop it, close now."""
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()
