"""``KvdClient``: the blocking twin of ``AsyncKvdClient``, with the same methods, results
and docstrings (a method without one here takes its twin's: ``_twin_docs``).

Requests are built by the shared ``RequestBuilder``; this shell sends them and waits for
their replies on a ``SharedDealer`` (``kvd.client.shared_dealer``), which lets threads
share one client. For concurrency within a thread, use the async client. An exception such
as ``KeyboardInterrupt`` ends a call as a timeout does: its request is stopped first
(``kvd/client/base.py``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvd.client.aio import AsyncKvdClient, AsyncTransfer
from kvd.client.base import (
    Call,
    ClientShell,
    Region,
    RequestBuilder,
    refusal,
    result_of,
    stoppable,
)
from kvd.client.shared_dealer import SharedDealer
from kvd.errors import DaemonUnavailable, KvdError
from kvd.protocol import ALL, WHOLE, Part, Reply, Share

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
            reply = self._client._dealer.wait_reply(self.req_id, 0.0, poll_only=True)
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
        if not self._finished:
            wait_s = self._call.timeout_s if timeout_s is None else timeout_s
            reply = self._client._dealer.wait_reply(self.req_id, wait_s)
            if reply is None:
                raise self._client._b.unavailable(f"transfer {self.key!r}", wait_s)
            self._settle(reply)
        if self._error is not None:
            raise self._error
        return int(self._result)

    def cancel(self, timeout_s: float | None = None) -> None:
        if not self.done():
            self._client._stop(self.req_id, timeout_s)


class KvdClient(ClientShell):
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

    def __enter__(self) -> KvdClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self, timeout_s: float | None = None) -> None:
        self._b.check_socket()
        wait_s = self._b.hello_timeout(timeout_s)
        self._dealer.open(wait_s)
        try:
            welcome = self._call(self._b.hello(wait_s))
        except (KvdError, OSError) as exc:
            self.close()
            raise self._b.no_hello(exc) from None
        self._welcomed(welcome)

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

    def _call(self, call: Call) -> Any:
        started = time.perf_counter()
        req_id = call.msg.req_id
        try:
            counted = self._dealer.send(call, waits=True)
            reply = self._dealer.wait_reply(req_id, call.timeout_s, counted=counted)
        except KvdError:
            raise  # the connection is gone, or the request did not go
        except BaseException:  # KeyboardInterrupt and the like end the call here
            self._abandon(call)  # (struck in send, it may have gone all the same)
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
            if stoppable(call) and not self._dealer.answered(req_id):
                with contextlib.suppress(DaemonUnavailable):  # dropped: the caller's error
                    self._stop(req_id, None)
        finally:
            reply = self._dealer.forget(req_id)
        return reply

    def _stop(self, target: int, timeout_s: float | None) -> None:
        """Cancel request ``target`` in the daemon and return once the daemon says it has
        ended (its reply, stashed, then the cancel's). Without that word within
        ``timeout_s`` (the client's by default), or when the wait is interrupted, the
        connection is dropped (``_drop``). While the client closes, its Bye stops every
        request: the end of ``close`` is waited for instead."""
        dead = self._dealer.dead
        if dead is not None:
            raise dead  # the daemon has closed the session, or we dropped it
        call = self._b.cancel(target, timeout_s)
        why = ""
        if self._dealer.closing:
            if not self._dealer.shut.wait(call.timeout_s):
                why = f"the client did not close within {call.timeout_s:g}s"
        else:
            try:
                counted = self._dealer.send(call, waits=True)
                reply = self._dealer.wait_reply(call.msg.req_id, call.timeout_s,
                                                counted=counted)
            except KvdError as exc:
                why = exc.message
            except BaseException:
                self._drop(target, "the wait for its cancel was interrupted")
                raise
            else:
                if reply is None:
                    self._dealer.forget(call.msg.req_id)
                    why = f"no answer to its cancel within {call.timeout_s:g}s"
                else:
                    why = refusal(reply)
        if why:
            raise self._drop(target, why)

    def _drop(self, target: int, why: str) -> DaemonUnavailable:
        """Close the connection of a client whose request ``target`` the daemon did not
        confirm stopped. Every wait fails from now on."""
        err = self._b.unconfirmed(target, why)
        self._dealer.hang_up(err)
        return err

    # ------------------------------------------------------------ operations

    def ping(self, *, timeout_s: float | None = None) -> float:
        return self._call(self._b.ping(timeout_s))

    def drain(self, *, grace_s: float | None = None,
              timeout_s: float | None = None) -> dict[str, Any]:
        return self._call(self._b.drain(grace_s, timeout_s))

    def reload(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return self._call(self._b.reload(timeout_s))

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return self._call(self._b.stats(timeout_s))

    def register(self, name: str, tensors: Sequence[Any], *, block_dim: int = 0,
                 timeout_s: float | None = None) -> Region:
        call = self._b.register(name, tensors, block_dim, timeout_s)
        with self._segments_lock:  # two threads registering one new segment: hand it once
            segments = self._b.segments_to_hand(call)
            if segments:
                self._dealer.hand_over(segments, call.timeout_s)
                self._b.handed(segments)
        return self._call(call)

    def unregister(self, region: Region | int, *, timeout_s: float | None = None) -> None:
        self._call(self._b.unregister(region, timeout_s))

    def offload(self, key: str, region: Region | int, blocks: Iterable[int], *,
                ttl_s: float | None = None, timeout_s: float | None = None) -> int:
        return self._call(self._b.offload(key, region, blocks, ttl_s, timeout_s))

    def get(self, key: str, region: Region | int, blocks: Iterable[int], *,
            timeout_s: float | None = None, share: Share = ALL,
            into: Part = WHOLE, sender: str | None = None) -> int:
        return self._call(self._b.get(key, region, blocks, timeout_s, share, into, sender))

    def put(self, key: str, region: Region | int, blocks: Iterable[int], *,
            to: str | None = None, ttl_s: float | None = None,
            timeout_s: float | None = None) -> Transfer:
        return self._start(self._b.put(key, region, blocks, to, ttl_s, timeout_s))

    def lend(self, key: str, region: Region | int, blocks: Iterable[int], *, ttl_s: float,
             timeout_s: float | None = None) -> Transfer:
        return self._start(self._b.lend(key, region, blocks, ttl_s, timeout_s))

    def start_get(self, key: str, region: Region | int, blocks: Iterable[int], *,
                  timeout_s: float | None = None, share: Share = ALL,
                  into: Part = WHOLE, sender: str | None = None) -> Transfer:
        return self._start(self._b.get(key, region, blocks, timeout_s, share, into, sender))

    def renew(self, key: str, src: str, *, ttl_s: float,
              timeout_s: float | None = None) -> Transfer:
        return self._start(self._b.renew(key, src, ttl_s, timeout_s))

    def release(self, key: str, src: str, *, timeout_s: float | None = None,
                skip: int = 0) -> Transfer:
        return self._start(self._b.release(key, src, timeout_s, skip))

    def start_pull(self, key: str, src: str, region: Region | int, blocks: Iterable[int], *,
                   timeout_s: float | None = None, wait_for_key_s: float = 0.0,
                   share: Share = ALL, into: Part = WHOLE) -> Transfer:
        return self._start(self._b.pull(key, src, region, blocks, timeout_s, wait_for_key_s,
                                        share, into))

    def _start(self, call: Call) -> Transfer:
        started = time.perf_counter()
        try:
            self._dealer.send(call)
        except KvdError:
            raise
        except BaseException:  # (a KeyboardInterrupt may strike once it has gone)
            self._abandon(call)
            raise
        return Transfer(self, call, started)

    def pull(self, key: str, src: str, region: Region | int, blocks: Iterable[int], *,
             timeout_s: float | None = None, wait_for_key_s: float = 0.0,
             share: Share = ALL, into: Part = WHOLE) -> int:
        return self._call(self._b.pull(key, src, region, blocks, timeout_s, wait_for_key_s,
                                       share, into))

    def publish(self, key: str, region: Region | int, blocks: Iterable[int], *,
                ttl_s: float | None = None, timeout_s: float | None = None) -> int:
        return self._call(self._b.publish(key, region, blocks, ttl_s, timeout_s))

    def unpublish(self, key: str, *, timeout_s: float | None = None) -> None:
        self._call(self._b.unpublish(key, timeout_s))

    def delete(self, key: str, *, timeout_s: float | None = None) -> None:
        self._call(self._b.delete(key, timeout_s))

    def cancel(self, transfer: Transfer, *, timeout_s: float | None = None) -> None:
        transfer.cancel(timeout_s)


def _twin_docs(cls: type, twin: type) -> None:
    """One text for both twins: each method of ``cls`` without a docstring gets its async
    twin's."""
    for name, member in vars(cls).items():
        if callable(member) and member.__doc__ is None and hasattr(twin, name):
            member.__doc__ = getattr(twin, name).__doc__


_twin_docs(KvdClient, AsyncKvdClient)
_twin_docs(Transfer, AsyncTransfer)
