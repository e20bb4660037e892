"""``AsyncKvdClient``: the asyncio client of a local kvd daemon.

One Unix socket connection (length-prefixed messages, ``kvd.framing``); replies are
matched to waiting futures by ``req_id`` as they arrive, so any number of requests can be
in flight. Every call has a timeout. Cancelling a call (or a ``Transfer``) also cancels it
in the daemon, which answers only once no more bytes can land in the caller's blocks. A
daemon that goes away closes the connection: every pending call fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvd.client.base import (
    MAX_REPLY_BYTES,
    Call,
    Region,
    RequestBuilder,
    decode_replies,
    result_of,
)
from kvd.client.shm import hand_over
from kvd.errors import Cancelled, DaemonUnavailable, KvdError
from kvd.framing import FramedProtocol, Oversized
from kvd.protocol import Bye, Reply, encode

log = logging.getLogger(__name__)


class _Connection(FramedProtocol):
    """The socket's side of an ``AsyncKvdClient``: replies in, requests out."""

    def __init__(self, client: AsyncKvdClient) -> None:
        super().__init__(MAX_REPLY_BYTES)
        self.client = client
        self.lost = False
        self._writable: asyncio.Future[None] | None = None  # set while writing is paused

    def on_frame(self, item: bytes | Oversized) -> None:
        for reply in decode_replies([item]):
            self.client._on_reply(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.lost = True
        self.resume_writing()
        self.client._on_lost()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    async def write(self, data: bytes) -> None:
        """Send one message; wait while the daemon is not taking what was queued before."""
        if self.lost or not self.send(data):
            raise OSError("connection closed")
        if self._writable is not None:
            await asyncio.shield(self._writable)


class AsyncTransfer:
    """A put or lend in flight: ``await t.wait()``, ``t.done()``, ``await t.cancel()``."""

    def __init__(self, client: AsyncKvdClient, call: Call, future: asyncio.Future[Reply],
                 started: float) -> None:
        self._client = client
        self._call = call
        self._future = future
        self._started = started
        self.req_id: int = call.msg.req_id
        self.key: str = call.msg.key

    def done(self) -> bool:
        return self._future.done()

    async def wait(self, timeout_s: float | None = None) -> int:
        """Bytes moved, once the receiving daemon has them; raises the transfer's error."""
        wait_s = self._call.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(wait_s):
                reply = await asyncio.shield(self._future)
        except TimeoutError:
            raise self._client._b.unavailable(f"transfer {self.key!r}", wait_s) from None
        return int(result_of(self._call, reply, time.perf_counter() - self._started))

    async def cancel(self, timeout_s: float | None = None) -> None:
        """Cancel in the daemon; returns when it is settled (``wait`` then raises
        ``Cancelled``, unless the transfer had already finished)."""
        if not self._future.done():
            await self._client._call(self._client._b.cancel(self.req_id, timeout_s))


class AsyncKvdClient:
    """Talk to the local daemon: ``async with AsyncKvdClient() as c: await c.ping()``."""

    def __init__(self, socket_path: str | None = None, *, name: str = "",
                 timeout_s: float = 30.0) -> None:
        self._b = RequestBuilder(socket_path, name, timeout_s)
        self._conn: _Connection | None = None
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._segments_lock = asyncio.Lock()
        self._dead: DaemonUnavailable | None = None
        self._closed = False
        self.node_id = ""
        self.epoch = 0

    @property
    def socket_path(self) -> str:
        return self._b.socket_path

    async def __aenter__(self) -> AsyncKvdClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def connect(self, timeout_s: float | None = None) -> None:
        """Connect and say hello; ``DaemonUnavailable`` naming the socket if no daemon
        answers within the timeout."""
        self._b.check_socket()
        call = self._b.hello(timeout_s)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(call.timeout_s):
                _, self._conn = await loop.create_unix_connection(
                    lambda: _Connection(self), self._b.socket_path)
        except (OSError, TimeoutError) as exc:
            raise DaemonUnavailable(f"cannot connect to kvd daemon at {self._b.socket_path}: "
                                    f"{getattr(exc, 'strerror', None) or exc!r}") from None
        try:
            welcome = await self._call(call)
        except (KvdError, OSError) as exc:
            await self.aclose()
            raise DaemonUnavailable(
                f"kvd daemon at {self._b.socket_path} did not answer hello: {exc}"
            ) from None
        self.node_id, self.epoch = welcome.node_id, welcome.epoch
        self._b.welcomed(welcome)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._conn is not None and self._dead is None and self.epoch:
            with contextlib.suppress(KvdError, OSError):
                await self._call(self._b.bye())
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(DaemonUnavailable("client closed"))
        self._pending.clear()
        if self._conn is not None:
            self._conn.close()

    def _on_reply(self, reply: Reply) -> None:
        fut = self._pending.pop(reply.req_id, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _on_lost(self) -> None:
        if self._closed:
            return
        self._dead = self._b.disconnected()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._dead)
        self._pending.clear()

    async def _send(self, call: Call) -> asyncio.Future[Reply]:
        if self._conn is None or (self._closed and not isinstance(call.msg, Bye)):
            raise DaemonUnavailable("client is not connected")
        if self._dead is not None:
            raise self._dead
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[call.msg.req_id] = fut
        try:
            async with asyncio.timeout(call.timeout_s):
                await self._conn.write(encode(call.msg))
        except TimeoutError:
            self._pending.pop(call.msg.req_id, None)
            raise DaemonUnavailable(
                f"cannot reach kvd daemon at {self._b.socket_path}") from None
        except OSError:
            self._pending.pop(call.msg.req_id, None)
            raise self._dead or self._b.disconnected() from None
        return fut

    async def _call(self, call: Call) -> Any:
        started = time.perf_counter()
        fut = await self._send(call)
        try:
            async with asyncio.timeout(call.timeout_s):
                reply = await fut
        except TimeoutError:
            self._pending.pop(call.msg.req_id, None)
            self._cancel_remote(call)
            raise self._b.unavailable(type(call.msg).__name__.lower(), call.timeout_s) from None
        except asyncio.CancelledError:
            self._pending.pop(call.msg.req_id, None)
            self._cancel_remote(call)
            raise
        return result_of(call, reply, time.perf_counter() - started)

    def _cancel_remote(self, call: Call) -> None:
        """Tell the daemon to drop a request we stopped waiting for (fire and forget)."""
        if self._conn is None or self._closed or call.kind in ("none", "rtt", "stats"):
            return
        self._conn.send(encode(self._b.cancel(call.msg.req_id, None).msg))

    # ------------------------------------------------------------ operations

    async def ping(self, *, timeout_s: float | None = None) -> float:
        """Round-trip time to the daemon, in seconds."""
        result: float = await self._call(self._b.ping(timeout_s))
        return result

    async def drain(self, *, grace_s: float | None = None,
                    timeout_s: float | None = None) -> dict[str, Any]:
        """Make the daemon stop taking work, finish what is in flight, and exit; returns
        its report (how much finished, how much was cancelled at the grace)."""
        report: dict[str, Any] = await self._call(self._b.drain(grace_s, timeout_s))
        return report

    async def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(self._b.stats(timeout_s))
        return result

    async def register(self, name: str, tensors: Sequence[Any], *, block_dim: int = 0,
                       timeout_s: float | None = None) -> Region:
        """Share tensors (from ``kvd.shared_empty``) with the daemon once."""
        call = self._b.register(name, tensors, block_dim, timeout_s)
        async with self._segments_lock:
            segments = self._b.segments_to_hand(call)
            if segments:  # a blocking sendmsg and its answer: not on this loop
                await asyncio.to_thread(hand_over, self._b.segment_socket,
                                        self._b.segment_token, segments, call.timeout_s)
                self._b.handed(segments)
        region: Region = await self._call(call)
        return region

    async def unregister(self, region: Region | int, *, timeout_s: float | None = None) -> None:
        await self._call(self._b.unregister(region, timeout_s))

    async def offload(self, key: str, region: Region | int, blocks: Iterable[int], *,
                      ttl_s: float | None = None, timeout_s: float | None = None) -> int:
        """Copy blocks into the daemon's host pool under ``key``; returns bytes stored.
        Without ``ttl_s`` the key lives until deleted or this client goes away."""
        nbytes: int = await self._call(self._b.offload(key, region, blocks, ttl_s, timeout_s))
        return nbytes

    async def get(self, key: str, region: Region | int, blocks: Iterable[int], *,
                  timeout_s: float | None = None) -> int:
        """Wait up to ``timeout_s`` for ``key`` and write it into ``blocks``."""
        nbytes: int = await self._call(self._b.get(key, region, blocks, timeout_s))
        return nbytes

    async def put(self, key: str, region: Region | int, blocks: Iterable[int], *,
                  to: str | None = None, ttl_s: float | None = None,
                  timeout_s: float | None = None) -> AsyncTransfer:
        """Send blocks to daemon ``to`` (this one by default) under ``key``."""
        call = self._b.put(key, region, blocks, to, ttl_s, timeout_s)
        started = time.perf_counter()
        return AsyncTransfer(self, call, await self._send(call), started)

    async def lend(self, key: str, region: Region | int, blocks: Iterable[int], *,
                   ttl_s: float, timeout_s: float | None = None) -> AsyncTransfer:
        """Publish blocks in place for one reader (a get here, or a peer's pull). The
        transfer ends when the daemon no longer reads them, with the bytes that reader
        took (0 if nobody did within ``ttl_s``); do not reuse the blocks before."""
        call = self._b.lend(key, region, blocks, ttl_s, timeout_s)
        started = time.perf_counter()
        return AsyncTransfer(self, call, await self._send(call), started)

    async def pull(self, key: str, src: str, region: Region | int, blocks: Iterable[int], *,
                   timeout_s: float | None = None, wait_for_key_s: float = 0.0) -> int:
        """Fetch ``key`` published (or offloaded) on daemon ``src`` (host:port) into
        ``blocks``. If ``src`` does not hold the key it fails (``UnknownKey``) at once, or,
        with ``wait_for_key_s``, once the key has not appeared there for that long."""
        nbytes: int = await self._call(self._b.pull(key, src, region, blocks, timeout_s,
                                                    wait_for_key_s))
        return nbytes

    async def publish(self, key: str, region: Region | int, blocks: Iterable[int], *,
                      ttl_s: float | None = None, timeout_s: float | None = None) -> int:
        """Offer blocks under ``key`` in place (no copy) until unpublished."""
        nbytes: int = await self._call(self._b.publish(key, region, blocks, ttl_s, timeout_s))
        return nbytes

    async def unpublish(self, key: str, *, timeout_s: float | None = None) -> None:
        await self._call(self._b.unpublish(key, timeout_s))

    async def delete(self, key: str, *, timeout_s: float | None = None) -> None:
        await self._call(self._b.delete(key, timeout_s))

    async def cancel(self, transfer: AsyncTransfer, *, timeout_s: float | None = None) -> None:
        await transfer.cancel(timeout_s)


__all__ = ["AsyncKvdClient", "AsyncTransfer", "Cancelled"]
