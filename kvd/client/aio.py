"""``AsyncKvdClient``: the asyncio client of a local kvd daemon.

A ZeroMQ DEALER on the daemon's local socket, read on the loop (``kvd.loop_socket``):
replies are matched to waiting futures by ``req_id`` as they arrive, so any number of
requests can be in flight. Its lifeline (``kvd.client.lifeline``) is watched on the loop
too: a daemon that goes away closes it, and every pending call fails at once. How a call
that ends early stops its request: ``kvd/client/base.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import zmq

from kvd.client.base import (
    Call,
    ClientShell,
    Region,
    RequestBuilder,
    decode_replies,
    ended_by,
    open_connection,
    refusal,
    result_of,
    stoppable,
)
from kvd.client.lifeline import LAST_WORDS_S, ClientLifeline, handoff_batches
from kvd.client.shm import Segment
from kvd.errors import DaemonUnavailable, KvdError
from kvd.loop_socket import LoopSocket
from kvd.protocol import ALL, WHOLE, Bye, Part, Reply, Share

log = logging.getLogger(__name__)


class AsyncTransfer:
    """A request in flight (``put``, ``lend``, ``start_get``, ``start_pull``):
    ``await t.wait()``, ``t.done()``, ``await t.cancel()``."""

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
        """Cancel in the daemon; returns when it is settled: the daemon reads and writes
        the blocks no more (``wait`` then raises ``Cancelled``, unless the transfer had
        finished). ``DaemonUnavailable`` if it could not say so in time: the client is
        then closed."""
        if not self._future.done():
            await self._client._stop(self.req_id, timeout_s)


class AsyncKvdClient(ClientShell):
    """Talk to the local daemon: ``async with AsyncKvdClient() as c: await c.ping()``."""

    def __init__(self, socket_path: str | None = None, *, name: str = "",
                 timeout_s: float = 30.0) -> None:
        self._b = RequestBuilder(socket_path, name, timeout_s)
        self._sock: LoopSocket | None = None
        self._monitor: LoopSocket | None = None  # the DEALER's connection's end
        self._dealer_ended = self._lifeline_ended = False
        self._lifeline: ClientLifeline | None = None
        self._handoff: asyncio.Future[bytes] | None = None  # a handoff's answer, awaited
        self._lost = False  # the daemon closed the lifeline, or we dropped the connection
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._segments_lock = asyncio.Lock()
        self._dead: DaemonUnavailable | None = None
        self._closed = False
        self.node_id = ""
        self.epoch = 0

    async def __aenter__(self) -> AsyncKvdClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def connect(self, timeout_s: float | None = None) -> None:
        """Connect and say hello; ``DaemonUnavailable`` naming the socket if no daemon
        answers within the timeout."""
        self._b.check_socket()
        wait_s = self._b.hello_timeout(timeout_s)
        lifeline, sock, monitor = await asyncio.to_thread(open_connection, self._b.socket_path,
                                                           wait_s)
        loop = asyncio.get_running_loop()
        lifeline.sock.setblocking(False)
        self._lifeline = lifeline
        loop.add_reader(lifeline.fileno(), self._on_lifeline)
        try:
            self._sock = LoopSocket(sock, self._on_frames, loop, "kvd client")
            self._monitor = LoopSocket(monitor, self._on_monitor, loop, "kvd client monitor")
            self._sock.start()
            self._monitor.start()
            welcome = await self._call(self._b.hello(wait_s))
        except (KvdError, OSError) as exc:
            await self.aclose()
            raise self._b.no_hello(exc) from None
        self._welcomed(welcome)

    async def aclose(self) -> None:
        """Close the session. Its requests still in flight are stopped first: this
        returns once the daemon says no more bytes move in their blocks (or, past the
        client's timeout without that word, with a warning)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._sock is not None and self._dead is None and self.epoch:
                in_flight = bool(self._pending)
                try:
                    await self._call(self._b.bye(in_flight))
                except (KvdError, OSError) as exc:
                    if in_flight:
                        log.warning("closing with requests in flight: %s", exc)
        finally:  # (also when aclose itself is cancelled: the connection goes regardless)
            self._fail_pending(DaemonUnavailable("client closed"))
            self._disconnect()

    def _disconnect(self) -> None:
        """Close the DEALER and the lifeline (the daemon ends the session, if any)."""
        self._lost = True
        if self._sock is not None:
            if self._monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.sock.disable_monitor()
                self._monitor.close()
            self._sock.close()
        if self._lifeline is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._lifeline.fileno())
            self._lifeline.close()
        if self._handoff is not None and not self._handoff.done():
            _fail(self._handoff, self._dead or DaemonUnavailable("client closed"))

    def _on_frames(self, frames: list[bytes]) -> None:
        for reply in decode_replies(frames[-1:]):  # (a DEALER gets the payload alone)
            fut = self._pending.pop(reply.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def _on_lifeline(self) -> None:
        """The lifeline is readable: a handoff's answer, or the daemon's end."""
        assert self._lifeline is not None
        try:
            data = self._lifeline.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data and self._handoff is not None and not self._handoff.done():
            self._handoff.set_result(data)
            return
        if data:
            log.warning("dropping an unexpected message on the lifeline")
            return
        # The daemon is gone: no new request goes, and the replies it sent last (they
        # travel apart from the lifeline) are taken until the DEALER's connection has
        # ended too (or for LAST_WORDS_S) before the calls still waiting fail.
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._lifeline.fileno())
        self._lost = True
        self._lifeline_ended = True
        if self._handoff is not None and not self._handoff.done():
            _fail(self._handoff, self._b.disconnected())
        if self._dealer_ended:
            self._gone()
        else:
            loop.call_later(LAST_WORDS_S, self._gone)

    def _on_monitor(self, event: list[bytes]) -> None:
        if ended_by(event):
            self._dealer_ended = True
            if self._lifeline_ended:
                self._gone()

    def _gone(self) -> None:
        if self._sock is not None and not self._sock.closed:
            self._sock.read_now()  # (its last replies, if their edge has not fired yet)
            err = self._dead or self._b.disconnected()  # (_drop's says more)
            if not self._closed:
                self._dead = err
            # (while closing too: a Bye waiting for its answer fails now, not at its timeout)
            self._fail_pending(err)
            self._disconnect()

    def _fail_pending(self, err: KvdError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                _fail(fut, err)
        self._pending.clear()

    def _queue(self, call: Call) -> asyncio.Future[Reply]:
        """Send ``call``; the future of its reply."""
        if self._sock is None or (self._closed and not isinstance(call.msg, Bye)):
            raise DaemonUnavailable("client is not connected")
        if self._dead is not None:
            raise self._dead
        if self._lost:
            raise self._b.disconnected()
        if not self._sock.send((self._b.encode(call),)):
            if self._lifeline is not None and self._lifeline.gone():
                raise self._b.disconnected()
            raise DaemonUnavailable(f"kvd daemon at {self._b.socket_path} is not taking "
                                    "requests (its queue for this client is full)")
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[call.msg.req_id] = fut
        return fut

    async def _call(self, call: Call) -> Any:
        started = time.perf_counter()
        fut = self._queue(call)
        try:
            async with asyncio.timeout(call.timeout_s):
                reply = await fut
        except TimeoutError:
            fut = await self._abandon(call, fut)
            if not fut.done() or fut.cancelled() or fut.exception() is not None:
                raise self._b.unavailable(type(call.msg).__name__.lower(),
                                          call.timeout_s) from None
            reply = fut.result()  # it came while the daemon stopped the request
        except asyncio.CancelledError:
            await self._abandon(call, fut)
            raise
        return result_of(call, reply, time.perf_counter() - started)

    async def _abandon(self, call: Call, fut: asyncio.Future[Reply]) -> asyncio.Future[Reply]:
        """We stop waiting for ``call`` (cancelled, or out of time): stop it in the daemon
        first, unless it has been answered or is one the daemon answers at once
        (``_stop``). Returns the future its reply, if it came meanwhile, is in."""
        req_id = call.msg.req_id
        if fut.cancelled() and self._pending.get(req_id) is fut:
            # Cancelling the task that awaited it cancelled it: a new one takes the reply.
            fut = self._pending[req_id] = asyncio.get_running_loop().create_future()
        try:
            if not fut.done() and stoppable(call):
                with contextlib.suppress(DaemonUnavailable):  # dropped: the caller's error
                    await self._stop(req_id, None)
        finally:
            self._pending.pop(req_id, None)
        return fut

    async def _stop(self, target: int, timeout_s: float | None) -> None:
        """Cancel request ``target`` in the daemon and return once the daemon says it has
        ended (its reply, then the cancel's); without that word within ``timeout_s`` (the
        client's by default), drop the connection (``_drop``). A cancel of the calling
        task does not cut this bounded wait short: it is raised after."""
        if self._dead is not None:
            raise self._dead  # the daemon has closed the session, or we dropped it
        call = self._b.cancel(target, timeout_s)
        # Closing: the Bye stops every request, and aclose fails the target's future once
        # the daemon has said so. That is waited for rather than a cancel's answer.
        confirm = self._pending.get(target) if self._closed else self._queue(call)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + call.timeout_s
        interrupted = False
        while confirm is not None and not confirm.done() and (
                left := deadline - loop.time()) > 0:
            try:
                await asyncio.wait([confirm], timeout=left)
            except asyncio.CancelledError:
                interrupted = True
        self._pending.pop(call.msg.req_id, None)
        why = ""
        if self._closed or confirm is None:
            pass
        elif not confirm.done():
            why = f"no answer to its cancel within {call.timeout_s:g}s"
        elif confirm.cancelled() or confirm.exception() is not None:
            why = "the connection was lost"
        else:
            why = refusal(confirm.result())
        err = self._drop(target, why) if why else None
        if interrupted:
            raise asyncio.CancelledError
        if err is not None:
            raise err

    def _drop(self, target: int, why: str) -> DaemonUnavailable:
        """Close the connection of a client whose request ``target`` the daemon did not
        confirm stopped. What is in flight fails now."""
        err = self._b.unconfirmed(target, why)
        if self._dead is None:
            self._dead = err
        self._disconnect()
        self._fail_pending(self._dead)
        return err

    # ------------------------------------------------------------ operations

    async def ping(self, *, timeout_s: float | None = None) -> float:
        """Round-trip time to the daemon, in seconds."""
        return await self._call(self._b.ping(timeout_s))

    async def drain(self, *, grace_s: float | None = None,
                    timeout_s: float | None = None) -> dict[str, Any]:
        """Make the daemon stop taking work, finish what is in flight, and exit; returns
        its report (how much finished, how much was cancelled at the grace)."""
        return await self._call(self._b.drain(grace_s, timeout_s))

    async def reload(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Make the daemon read its allow-list (``curve_allowed_keys_file``) again: keys
        added are accepted at once, and a peer whose key was taken off loses its links.
        Returns what changed; a ``ConfigError`` if the file is not valid (the daemon keeps
        the list it had)."""
        return await self._call(self._b.reload(timeout_s))

    async def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return await self._call(self._b.stats(timeout_s))

    async def register(self, name: str, tensors: Sequence[Any], *, block_dim: int = 0,
                       timeout_s: float | None = None) -> Region:
        """Share tensors (from ``kvd.shared_empty``) with the daemon once."""
        call = self._b.register(name, tensors, block_dim, timeout_s)
        async with self._segments_lock:
            segments = self._b.segments_to_hand(call)
            if segments:
                await self._hand_over(segments, call.timeout_s)
                self._b.handed(segments)
        return await self._call(call)

    async def _hand_over(self, segments: Sequence[Segment], timeout_s: float) -> None:
        """Hand the segments over on the lifeline; returns once the session has them."""
        loop = asyncio.get_running_loop()
        for batch in handoff_batches(segments):
            if self._lifeline is None or self._lost:
                raise self._dead or self._b.disconnected()
            self._handoff = answer = loop.create_future()
            self._lifeline.send_handoff(batch)
            try:
                async with asyncio.timeout(timeout_s):
                    data = await answer
            except TimeoutError:
                raise self._b.unavailable("segment handoff", timeout_s) from None
            finally:
                self._handoff = None
            self._lifeline.answer(data)

    async def unregister(self, region: Region | int, *, timeout_s: float | None = None) -> None:
        await self._call(self._b.unregister(region, timeout_s))

    async def offload(self, key: str, region: Region | int, blocks: Iterable[int], *,
                      ttl_s: float | None = None, timeout_s: float | None = None) -> int:
        """Copy blocks into the daemon's host pool under ``key``; returns bytes stored.
        Without ``ttl_s`` the key lives until deleted or this client goes away."""
        return await self._call(self._b.offload(key, region, blocks, ttl_s, timeout_s))

    async def get(self, key: str, region: Region | int, blocks: Iterable[int], *,
                  timeout_s: float | None = None, share: Share = ALL,
                  into: Part = WHOLE, sender: str | None = None) -> int:
        """Wait up to ``timeout_s`` for ``key`` and write it into ``blocks``. ``sender``:
        the daemon that puts the key here (host:port), if known: the get fails at once
        (``PeerUnreachable``) if that daemon cannot be reached or goes while it waits."""
        return await self._call(self._b.get(key, region, blocks, timeout_s, share, into,
                                            sender))

    async def put(self, key: str, region: Region | int, blocks: Iterable[int], *,
                  to: str | None = None, ttl_s: float | None = None,
                  timeout_s: float | None = None) -> AsyncTransfer:
        """Send blocks to daemon ``to`` (this one by default) under ``key``."""
        return self._start(self._b.put(key, region, blocks, to, ttl_s, timeout_s))

    async def lend(self, key: str, region: Region | int, blocks: Iterable[int], *,
                   ttl_s: float, timeout_s: float | None = None) -> AsyncTransfer:
        """Publish blocks in place for one reader (a get here, or a peer's pull). The
        transfer ends when the daemon no longer reads them, with the bytes that reader
        took (0 if nobody did within ``ttl_s``); do not reuse the blocks before."""
        return self._start(self._b.lend(key, region, blocks, ttl_s, timeout_s))

    async def start_get(self, key: str, region: Region | int, blocks: Iterable[int], *,
                        timeout_s: float | None = None, share: Share = ALL,
                        into: Part = WHOLE, sender: str | None = None) -> AsyncTransfer:
        """``get`` without waiting: the returned transfer ends when the bytes are in."""
        return self._start(self._b.get(key, region, blocks, timeout_s, share, into, sender))

    async def renew(self, key: str, src: str, *, ttl_s: float,
                    timeout_s: float | None = None) -> AsyncTransfer:
        """Keep ``key``, lent at daemon ``src`` (host:port, or this daemon's), for at least
        ``ttl_s`` more: its reader is still coming. The transfer ends (0 bytes) once
        ``src`` has done it; ``UnknownKey`` if it holds no such key, ``KeyGone`` if it went."""
        return self._start(self._b.renew(key, src, ttl_s, timeout_s))

    async def release(self, key: str, src: str, *, timeout_s: float | None = None,
                      skip: int = 0) -> AsyncTransfer:
        """Drop ``key``, lent at daemon ``src``, now: its reader will not come (its lender
        gets its blocks back). The transfer ends (0 bytes) once ``src`` has done it.
        ``skip`` (not 0): the reader has the key's first ``skip`` blocks and still reads
        the rest: a put of it from ``src`` sends only those (``Release.skip``)."""
        return self._start(self._b.release(key, src, timeout_s, skip))

    async def start_pull(self, key: str, src: str, region: Region | int,
                         blocks: Iterable[int], *, timeout_s: float | None = None,
                         wait_for_key_s: float = 0.0, share: Share = ALL,
                         into: Part = WHOLE) -> AsyncTransfer:
        """``pull`` without waiting: the returned transfer ends when the bytes are in."""
        return self._start(self._b.pull(key, src, region, blocks, timeout_s, wait_for_key_s,
                                        share, into))

    def _start(self, call: Call) -> AsyncTransfer:
        """Send ``call``; its transfer. (No await between the send and the transfer: a
        cancel of the caller cannot leave the request in flight without a handle.)"""
        started = time.perf_counter()
        return AsyncTransfer(self, call, self._queue(call), started)

    async def pull(self, key: str, src: str, region: Region | int, blocks: Iterable[int], *,
                   timeout_s: float | None = None, wait_for_key_s: float = 0.0,
                   share: Share = ALL, into: Part = WHOLE) -> int:
        """Fetch ``key`` published (or offloaded) on daemon ``src`` (host:port) into
        ``blocks``. If ``src`` does not hold the key it fails (``UnknownKey``) at once, or,
        with ``wait_for_key_s``, once the key has not appeared there for that long.
        ``share``: what of the key this pull takes (a part of each block, from a block
        on, for how many readers; ``kvd.Share``); ``into``: the part of each of
        ``blocks`` it lands in (``kvd.Part``)."""
        return await self._call(self._b.pull(key, src, region, blocks, timeout_s,
                                             wait_for_key_s, share, into))

    async def publish(self, key: str, region: Region | int, blocks: Iterable[int], *,
                      ttl_s: float | None = None, timeout_s: float | None = None) -> int:
        """Offer blocks under ``key`` in place (no copy) until unpublished."""
        return await self._call(self._b.publish(key, region, blocks, ttl_s, timeout_s))

    async def unpublish(self, key: str, *, timeout_s: float | None = None) -> None:
        await self._call(self._b.unpublish(key, timeout_s))

    async def delete(self, key: str, *, timeout_s: float | None = None) -> None:
        await self._call(self._b.delete(key, timeout_s))

    async def cancel(self, transfer: AsyncTransfer, *, timeout_s: float | None = None) -> None:
        await transfer.cancel(timeout_s)


__all__ = ["AsyncKvdClient", "AsyncTransfer"]


def _fail(fut: asyncio.Future[Any], err: KvdError) -> None:
    """End a pending call's future with ``err``. It is marked retrieved: a call whose
    caller is still there raises it all the same, and one whose caller has gone (a
    cancelled call's reply future, kept until the daemon confirms the stop) logs no
    "Future exception was never retrieved"."""
    fut.set_exception(err)
    fut.exception()
