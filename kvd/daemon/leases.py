"""Lent keys as their reader sees them: renewed while it waits, released when it will not
come; and a get that watches the daemon it waits on.

A lend (``Engine.lend``) offers blocks in place for one reader until its TTL. The vLLM
connector's decode is such a reader, and its request may wait in its engine's queue past
prefill's lease, or be aborted before it loads. So the reader may:

- ``renew`` the key: its expiry moves to ``ttl_s`` from now (``0 < ttl_s <= max_ttl_s``),
  never earlier than it was;
- ``release`` it: the key is dropped now, its lend answers 0 bytes (the lender frees its
  blocks), and pulls and gets waiting for it fail with ``KeyGone``. A release of a key not
  here yet is remembered with the keys gone (``KeyStore``, ``RELEASED``): its lend answers
  0 at once when it comes.

A key pushed for one reader (a put's) is released the same way, at either end: where it
is held it is dropped, and one that comes later is refused (its put fails with
``KeyGone``); where it will be pushed from, the put answers 0 at once and sends nothing.
A reader that has only a key's first blocks releases those (``skip``): a put of the key
then sends only the rest (``Engine.put``), stored as starting there (``Item.first``).

Only a lent key is renewed, and only a lent or pushed one released (``BadRequest``
otherwise). Whoever may pull a lent key may renew or release it: neither gives more than
the pull itself, and a renewal holds the lender's blocks at most ``max_ttl_s`` past its
own arrival. A reader's renew or release at another daemon, and the watch of a get's
sender (``Get.sender``), go through ``remote`` (``transfer/leasing.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

from kvd.daemon.store import RELEASED, Item
from kvd.errors import BadRequest

if TYPE_CHECKING:  # (types only: the engine imports this module)
    from kvd.daemon.engine import Engine

log = logging.getLogger(__name__)


class LeaseRemote(Protocol):
    """The peer side (``transfer.leasing.Leasing``): asks other daemons, watches them."""

    async def renew(self, key: str, src: str, ttl_s: float, timeout_s: float) -> None: ...

    async def release(self, key: str, src: str, timeout_s: float, skip: int = 0
                      ) -> None: ...

    async def watched(self, work: Awaitable[int], sender: str, timeout_s: float,
                      still_waiting: Callable[[], bool]) -> int: ...


@dataclass
class LeaseCounters:
    renewed: int = 0  # renewals taken here
    released: int = 0  # lent keys (or keys about to be) released here by their reader
    released_head: int = 0  # keys to be put whose reader released their first blocks
    expired: int = 0  # lent keys whose lease ended unread (counted by the engine)
    sender_lost: int = 0  # gets failed at once: the daemon they waited on was gone


class Leases:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._store = engine.store
        self.counters = LeaseCounters()
        self.remote: LeaseRemote | None = None  # set once the daemon has a peer plane
        # Told each key released before it was lent: the peers' pulls waiting for it.
        self.gone_listeners: list[Callable[[str], None]] = []

    # ------------------------------------------------------------ on this daemon's keys

    def renew(self, key: str, ttl_s: float) -> None:
        expires_at = self._engine.ttl_deadline(ttl_s)
        assert expires_at is not None
        item = self._lent(key)
        if item.expires_at is None or expires_at > item.expires_at:
            self._engine.extend(item, expires_at)
        self.counters.renewed += 1
        log.debug("lease renewed key=%s ttl_s=%g", key, ttl_s)

    def release(self, key: str, skip: int = 0) -> None:
        """``skip`` not 0: only the key's first ``skip`` blocks (``release_head``)."""
        item = self._store.find(key)
        if item is None:
            why = self._store.gone(key)
            if why == RELEASED:
                return  # (said twice)
            if why:
                raise self._store.missing(key)  # taken, expired, withdrawn: nothing to do
            if skip:
                # The reader has the key's first ``skip`` blocks: a put of it from here
                # sends only the others. (The gets and pulls waiting for it still wait:
                # the key still comes, and a read that skips less fails then.)
                self._store.keep_tail(key, skip)
                self.counters.released_head += 1
                log.info("key released in part before it came key=%s skip=%d", key, skip)
                return
            # Not here yet (or its bytes are arriving): remembered, so that its lend or put
            # answers at once when it comes, and bytes that arrive are dropped.
            self._store.mark_gone(key, RELEASED)
            self.counters.released += 1
            log.info("key released before it came key=%s", key)
            for waiter in self._store.waiters(key):
                waiter.settle(self._store.missing(key))
            for listener in self.gone_listeners:
                listener(key)
            return
        if not item.consume_once:
            raise BadRequest(f"key {key!r} is not for one reader (published or offloaded): "
                             "only a lent or pushed key can be released")
        if skip:  # here already, whole or not: its reader's read skips what it has
            log.info("key released in part, here already key=%s skip=%d", key, skip)
            return
        self._store.remove(item, RELEASED)
        self.counters.released += 1
        log.info("key released by its reader key=%s bytes=%d", key, item.nbytes)

    def released(self, key: str) -> bool:
        """Whether ``key``'s reader released it before it came."""
        return self._store.find(key) is None and self._store.gone(key) == RELEASED

    def _lent(self, key: str) -> Item:
        item = self._store.find(key)
        if item is None and not self._store.exists(key):
            raise self._store.missing(key)
        if item is None or not (item.published and item.consume_once):
            raise BadRequest(f"key {key!r} is not lent: only a lent key can be renewed or "
                             "released")
        return item

    # ------------------------------------------------------------ a client's requests

    def _peers(self, what: str, timeout_s: float) -> LeaseRemote:
        self._engine.check_wait(timeout_s)
        if self.remote is None:
            raise BadRequest(f"unknown {what}: this daemon has no peer plane")
        return self.remote

    async def renew_at(self, key: str, src: str, ttl_s: float, timeout_s: float) -> None:
        """A client's ``Renew``: here, or at daemon ``src``."""
        if self._engine.here(src):
            self.renew(key, ttl_s)
            return
        self._engine.ttl_deadline(ttl_s)  # (refused here rather than by the peer)
        await self._peers(f"source {src!r}", timeout_s).renew(key, src, ttl_s, timeout_s)

    async def release_at(self, key: str, src: str, timeout_s: float, skip: int = 0
                         ) -> None:
        """A client's ``Release``: here, or at daemon ``src``."""
        if self._engine.here(src):
            self.release(key, skip)
            return
        await self._peers(f"source {src!r}", timeout_s).release(key, src, timeout_s, skip)

    async def get_watching(self, get: Awaitable[int], session: int, req_id: int, key: str,
                           sender: str, timeout_s: float) -> int:
        """A client's ``Get`` with a ``sender``: the get, failed at once if ``sender``
        cannot be reached or its link is lost while the get still waits for ``key``
        (bytes already coming, from there or elsewhere, are let in)."""
        if self._engine.here(sender) or self.remote is None:  # (no peer plane: nobody sends)
            return await get

        def still_waiting() -> bool:
            return any(w.session == session and w.req_id == req_id
                       for w in self._store.waiters(key))

        return await self.remote.watched(get, sender, timeout_s, still_waiting)

    def stats(self) -> dict[str, int]:
        return asdict(self.counters)
