"""``KvdClient``: the blocking twin of ``AsyncKvdClient``, same methods and results.

Requests are built by the shared ``RequestBuilder``; this shell only sends them and waits
for their replies, on a ``SharedDealer`` (``kvd.client.shared_dealer``): a ZeroMQ DEALER
it polls itself (no event loop), with its lifeline in the same poll. A client is safe to
share between threads, and any number of them can have calls in flight on it at once,
each waiting only for its own reply (how: ``kvd.client.shared_dealer``). For concurrency
within a thread, use the async client. A call that ends before its reply (its timeout, an
exception such as ``KeyboardInterrupt``), ``Transfer.cancel`` and ``close`` stop the
request in the daemon and return once it says no more bytes move in the request's blocks;
without that word in the client's timeout, the connection is dropped
(``KvdClient._stop``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvd.client.base import Call, Region, RequestBuilder, result_of, stoppable
from kvd.client.shared_dealer import SharedDealer
from kvd.errors import DaemonUnavailable, KvdError
from kvd.protocol import ALL, WHOLE, Done, Part, Reply, Share

log = logging.getLogger(__name__)


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
        self._dealer = SharedDealer(self._b)
        self._segments_lock = threading.Lock()
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
        self._dealer.open(wait_s)
        try:
            welcome = self._call(self._b.hello(wait_s))
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
        if not self._dealer.begin_close():
            return
        try:
            if self._dealer.connected and self.epoch and self._dealer.dead is None:
                in_flight = self._dealer.in_flight()
                try:
                    self._call(self._b.bye(in_flight))
                except (KvdError, OSError) as exc:
                    if in_flight:
                        log.warning("closing with requests in flight: %s", exc)
        finally:
            self._dealer.shut_down()

    def _send(self, call: Call, waits: bool = False) -> bool:
        """Send ``call`` (``SharedDealer.send``: ``waits``, the caller waits for its reply
        next)."""
        return self._dealer.send(call, waits)

    def _wait_reply(self, req_id: int, timeout_s: float, poll_only: bool = False,
                    counted: bool | None = None) -> Reply | None:
        """The reply to ``req_id``, or None if it has not come within ``timeout_s``
        (``SharedDealer.wait_reply``)."""
        return self._dealer.wait_reply(req_id, timeout_s, poll_only, counted)

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
            answered = self._dealer.answered(req_id)
            if stoppable(call) and not answered:
                with contextlib.suppress(DaemonUnavailable):  # dropped: the caller's error
                    self._stop(req_id, None)
        finally:
            self._dealer.forget(req_id)
        return self._dealer.claim(req_id)

    def _stop(self, target: int, timeout_s: float | None) -> None:
        """Cancel request ``target`` in the daemon and return once the daemon says it has
        ended (its reply, stashed, then the cancel's): no more bytes land in or are read
        from its blocks. Without that word within ``timeout_s`` (the client's by default),
        or when the wait is interrupted, the connection is dropped (``_drop``): the daemon
        then stops the session's requests, and ``DaemonUnavailable`` says what that
        leaves. While the client closes, its Bye stops every request: the end of
        ``close`` is waited for instead."""
        dead = self._dealer.dead
        if dead is not None:
            raise dead  # the daemon has closed the session, or we dropped it
        call = self._b.cancel(target, timeout_s)
        why = ""
        if self._dealer.closing:
            if not self._dealer.wait_shut(call.timeout_s):
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
                    self._dealer.forget(call.msg.req_id)
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
        self._dealer.hang_up(err)
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
                self._dealer.hand_over(segments, call.timeout_s)
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
            timeout_s: float | None = None, share: Share = ALL,
            into: Part = WHOLE, sender: str | None = None) -> int:
        """Wait up to ``timeout_s`` for ``key`` and write it into ``blocks``. ``sender``:
        the daemon that puts the key here (host:port), if known: the get fails at once
        (``PeerUnreachable``) if that daemon cannot be reached or goes while it waits."""
        nbytes: int = self._call(self._b.get(key, region, blocks, timeout_s, share, into,
                                             sender))
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
                  timeout_s: float | None = None, share: Share = ALL,
                  into: Part = WHOLE, sender: str | None = None) -> Transfer:
        """``get`` without blocking: the returned transfer ends when the bytes are in."""
        return self._start(self._b.get(key, region, blocks, timeout_s, share, into, sender))

    def renew(self, key: str, src: str, *, ttl_s: float,
              timeout_s: float | None = None) -> Transfer:
        """Keep ``key``, lent at daemon ``src`` (host:port, or this daemon's), for at least
        ``ttl_s`` more: its reader is still coming. The transfer ends (0 bytes) once
        ``src`` has done it; ``UnknownKey`` if it holds no such key, ``KeyGone`` if it went."""
        return self._start(self._b.renew(key, src, ttl_s, timeout_s))

    def release(self, key: str, src: str, *, timeout_s: float | None = None,
                skip: int = 0) -> Transfer:
        """Drop ``key``, lent at daemon ``src``, now: its reader will not come (its lender
        gets its blocks back). The transfer ends (0 bytes) once ``src`` has done it.
        ``skip`` (not 0): the reader has the key's first ``skip`` blocks and still reads
        the rest: a put of it from ``src`` sends only those (``Release.skip``)."""
        return self._start(self._b.release(key, src, timeout_s, skip))

    def start_pull(self, key: str, src: str, region: Region | int, blocks: Iterable[int], *,
                   timeout_s: float | None = None, wait_for_key_s: float = 0.0,
                   share: Share = ALL, into: Part = WHOLE) -> Transfer:
        """``pull`` without blocking: the returned transfer ends when the bytes are in."""
        return self._start(self._b.pull(key, src, region, blocks, timeout_s, wait_for_key_s,
                                        share, into))

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
             timeout_s: float | None = None, wait_for_key_s: float = 0.0,
                   share: Share = ALL, into: Part = WHOLE) -> int:
        """Fetch ``key`` published (or offloaded) on daemon ``src`` (host:port) into
        ``blocks``. If ``src`` does not hold the key it fails (``UnknownKey``) at once, or,
        with ``wait_for_key_s``, once the key has not appeared there for that long.
        ``share``: what of the key this pull takes (a part of each block, from a block
        on, for how many readers; ``kvd.Share``); ``into``: the part of each of
        ``blocks`` it lands in (``kvd.Part``)."""
        nbytes: int = self._call(self._b.pull(key, src, region, blocks, timeout_s,
                                              wait_for_key_s, share, into))
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
