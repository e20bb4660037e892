"""Keys the daemon holds, and the gets waiting for keys that have not arrived yet.

Owned by the event loop: no locks, no I/O. An ``Item`` is either bytes in the host pool
(offloaded by a client, or arrived by ``put`` before anyone asked) or a published slice of
a registered region (read in place). Items have an owner (a client session, or none) and
an optional expiry; the engine frees their memory through ``Item.release``.

An item being read by a copy cannot be freed under it: ``readers`` counts such copies, and
a removal during a read only marks the item ``removed``; the last reader frees it.

The store remembers why the last ``GONE_REMEMBERED`` keys went (taken, expired, withdrawn),
by a hash of their names: a pull that comes for such a key is answered at once instead of
waiting for a key that will not come back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from kvd.daemon.futures import settle_awaited
from kvd.errors import BadRequest, KeyGone, UnknownKey
from kvd.memory.pool import HostPool, PoolBlock
from kvd.memory.regions import Layout, Region
from kvd.protocol import ALL, Part, Share
from kvd.transport.chunks import BlockSet


@dataclass(eq=False)
class Item:
    key: str
    layout: Layout
    num_blocks: int
    nbytes: int
    owner: int | None  # session id; None for data that arrived from a put
    expires_at: float | None  # loop time
    consume_once: bool  # a put's data goes to exactly one get
    pool_block: PoolBlock | None = None
    pool: HostPool | None = None  # which pool holds pool_block (None: the host pool)
    region: Region | None = None  # published: read in place
    region_idx: torch.Tensor | None = None
    blocks: BlockSet | None = None  # published: the slice as a transfer reads it, made once
    readers: int = 0
    removed: bool = False
    bytes_read: int = 0  # by reads that completed (a lent item reports it to its owner)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    on_free: Callable[[Item], None] | None = field(default=None, repr=False)
    # A consumed item's reads so far, by the part each took (at most MAX_PARTS per cut).
    reads: dict[Part, int] = field(default_factory=dict, repr=False)
    # The key's block that is this item's first: arrived without the blocks before it,
    # which its reader released (it has them: ``Release.skip``). A read skips at least
    # these (``held``).
    first: int = 0

    @property
    def published(self) -> bool:
        return self.region is not None

    def held(self, share: Share) -> Share:
        """``share`` of the key as a cut of the blocks this item holds (``share.skip`` is
        at least ``first``: ``engine.unfit`` says so first)."""
        if not self.first:
            return share
        return msgspec.structs.replace(share, skip=share.skip - self.first)

    def count_read(self, share: Share, by: int = 1) -> bool:
        """Count a read of ``share`` (``by`` -1: one handed back unread); True once every
        part of its cut has been read by as many readers as it says."""
        part, count = share.part, share.part.count
        self.reads[part] = self.reads.get(part, 0) + by
        return all(self.reads.get(Part(i, count), 0) >= share.readers for i in range(count))

    def release(self) -> None:
        """Free the item's memory once no copy reads it."""
        self.removed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.readers == 0 and self.on_free is not None:
            on_free, self.on_free = self.on_free, None
            on_free(self)

    def end_read(self) -> None:
        self.readers -= 1
        if self.removed:
            self.release()


@dataclass(eq=False)
class Waiter:
    """A get parked until its key appears; resolved with a claim or a delivery."""

    session: int
    req_id: int
    region: Region  # (seen as the part of its blocks the get writes into)
    idx: torch.Tensor
    future: asyncio.Future[Any]
    blocks: BlockSet  # region's blocks idx in wire order, made (and mapped) ahead
    share: Share = ALL  # what of the key it takes: bytes of just that are delivered to it
    delivering: bool = False  # a put is copying straight into our blocks
    # Set while a peer's bytes come straight into our blocks: a cancelled get calls it
    # to have the rest dropped (it still waits for a chunk being written).
    stop_delivery: Callable[[], None] | None = None
    # What the get's task awaits: settled with ``future``, but a cancel of the task
    # cancels only this one. (``asyncio.shield(future)`` would do the same one turn of
    # the loop later: the shield's own callback comes between.)
    wake: asyncio.Future[Any] = field(init=False)

    def __post_init__(self) -> None:
        self.wake = self.future.get_loop().create_future()

    def settle(self, result: Any) -> None:
        """The get's answer: a claim, a ``Delivered``, or an error (raised by the get)."""
        settle_awaited(self.future, self.wake, result)


# Keys whose going is remembered (a 16-byte hash and a shared reason each: ~8 MiB at most).
GONE_REMEMBERED = 65536
# Why a lent key went when its reader said it will not come (``daemon/leases.py``): a lend
# of a key gone for this reason answers at once.
RELEASED = "released by its reader"


def _remember(table: collections.OrderedDict[bytes, Any], name: bytes, value: Any) -> None:
    """``table[name] = value``, newest last, the oldest forgotten past GONE_REMEMBERED."""
    table[name] = value
    table.move_to_end(name)
    if len(table) > GONE_REMEMBERED:
        table.popitem(last=False)


def _name_hash(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


class KeyStore:
    def __init__(self) -> None:
        self._items: dict[str, Item] = {}
        self._reserved: set[str] = set()  # keys whose bytes are being copied in
        self._waiters: dict[str, collections.deque[Waiter]] = {}
        self._gone: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        # Keys not here yet whose reader needs only their blocks from this one on.
        self._tails: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    # ---- items

    def __len__(self) -> int:
        return len(self._items)

    def reserve(self, key: str) -> None:
        """Claim a key name before its bytes are copied in, so two writers cannot race."""
        if key in self._items or key in self._reserved:
            raise BadRequest(f"key {key!r} already exists")
        self._reserved.add(key)

    def exists(self, key: str) -> bool:
        return key in self._items or key in self._reserved

    def unreserve(self, key: str) -> None:
        self._reserved.discard(key)

    def insert(self, item: Item) -> None:
        self._reserved.discard(item.key)
        self._items[item.key] = item
        self._gone.pop(_name_hash(item.key), None)

    def find(self, key: str) -> Item | None:
        return self._items.get(key)

    def pop(self, key: str, why: str) -> Item | None:
        """Take ``key`` out of the store (its memory stays: see ``remove``)."""
        item = self._items.pop(key, None)
        if item is not None:
            self.mark_gone(key, why)
        return item

    def remove(self, item: Item, why: str) -> None:
        if self._items.get(item.key) is item:
            del self._items[item.key]
            self.mark_gone(item.key, why)
        item.release()

    def gone(self, key: str) -> str:
        """Why ``key`` went, if it was here lately; '' if not."""
        return self._gone.get(_name_hash(key), "")

    def missing(self, key: str, where: str = "") -> UnknownKey:
        """The error for a key that is not here: ``KeyGone`` if it went lately."""
        if why := self.gone(key):
            return KeyGone(f"key {key!r}{where} was {why}")
        return UnknownKey(f"no key {key!r}{where}")

    def mark_gone(self, key: str, why: str) -> None:
        """Remember ``key`` as gone (``why``): a pull of it is answered at once."""
        _remember(self._gone, _name_hash(key), why)

    def keep_tail(self, key: str, first: int) -> None:
        """Remember that ``key``'s reader needs only its blocks from ``first`` on (it has
        the others), as many keys as gone ones."""
        name = _name_hash(key)
        _remember(self._tails, name, max(first, self._tails.get(name, 0)))

    def tail(self, key: str) -> int:
        """The first of ``key``'s blocks its reader needs (``keep_tail``); 0: all."""
        return self._tails.get(_name_hash(key), 0)

    def items(self) -> list[Item]:
        return list(self._items.values())

    def pool_bytes(self) -> int:
        return sum(i.nbytes for i in self._items.values() if i.pool_block is not None)

    # ---- waiters

    def add_waiter(self, key: str, waiter: Waiter) -> None:
        self._waiters.setdefault(key, collections.deque()).append(waiter)

    def drop_waiter(self, key: str, waiter: Waiter) -> None:
        queue = self._waiters.get(key)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(waiter)
        if not queue:
            del self._waiters[key]

    def waiters(self, key: str, takes: Share | None = None) -> list[Waiter]:
        """The gets still waiting for ``key``, oldest first (they stay in the queue);
        ``takes``: only those that take exactly that of it (the bytes of that cut may be
        delivered to them)."""
        return [w for w in self._waiters.get(key, ())
                if not w.future.done() and not (takes is not None and w.share != takes)]

    def next_waiter(self, key: str, takes: Share | None = None) -> Waiter | None:
        """The oldest waiter for ``key`` still waiting (``takes``: of those that take
        exactly that of it), removed from the queue."""
        queue = self._waiters.get(key)
        if not queue:
            return None
        kept: list[Waiter] = []
        found = None
        while queue:
            waiter = queue.popleft()
            if waiter.future.done():
                continue
            if takes is not None and waiter.share != takes:
                kept.append(waiter)
                continue
            found = waiter
            break
        queue.extendleft(reversed(kept))
        if not queue:
            del self._waiters[key]
        return found

    def waiting_count(self) -> int:
        return sum(len(q) for q in self._waiters.values())

    def all_waiters(self) -> list[Waiter]:
        return [w for q in self._waiters.values() for w in q]
