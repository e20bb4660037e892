"""The operations a client can ask for, on state owned by the event loop.

The engine knows nothing of sockets: the local server decodes a request, calls the method
here with the client's session id, and turns the return value or the ``KvdError`` into a
reply. Bytes move only in the copy worker (``transport.local``); the loop allocates,
bookkeeps and awaits.

Rules that keep memory honest:
- pool memory for a key is allocated before its bytes are copied and freed exactly once,
  by ``Item.release`` (after the last reader) or on a failed copy;
- a copy that is running when its request is cancelled is waited for before the
  cancellation is reported, so no bytes land in blocks the client already got back;
- a session's regions are removed only after its copies have finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from kvd.config import Config
from kvd.daemon.busy_poll import BusyPoll
from kvd.daemon.futures import TimedOut, time_out, wait_out
from kvd.daemon.leases import Leases
from kvd.daemon.local_copies import LocalCopies, after_ready
from kvd.daemon.metrics import Metrics
from kvd.daemon.store import Item, KeyStore, Waiter
from kvd.errors import (
    BadRequest,
    Cancelled,
    Draining,
    KvdError,
    KvdTimeout,
    LayoutMismatch,
    UnknownKey,
)
from kvd.memory.pool import HostPool
from kvd.memory.regions import (
    IdArray,
    Layout,
    Region,
    RegionTable,
    build_region_tensors,
    describe_layout,
    packed_offsets,
    part_layout,
    part_of_blocks,
    torch_dtype,
)
from kvd.protocol import ALL, WHOLE, CudaIpcTensor, Part, Share, TensorSpec
from kvd.transport import local
from kvd.transport.chunks import BlockSet, plan_chunks

log = logging.getLogger(__name__)

_T = TypeVar("_T")

@dataclass
class Counters:
    """Plain counters; the metrics module exports them."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (op, code)
    bytes_in: int = 0  # written into regions
    bytes_out: int = 0  # read from regions
    expired_keys: int = 0
    gpu_spills: int = 0  # arrivals that found GPU staging full and went to the host pool

    def request(self, op: str, code: str) -> None:
        self.requests[(op, code)] = self.requests.get((op, code), 0) + 1


def _sum_by(table: dict[tuple[str, str], int], part: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, n in table.items():
        out[key[part]] = out.get(key[part], 0) + n
    return out


def unfit(
    key: str, layout: Layout, num_blocks: int, region: Region, idx: torch.Tensor,
    share: Share = ALL, first: int = 0,
) -> KvdError | None:
    """Why ``share`` of data of ``layout`` x ``num_blocks`` (the key's blocks from
    ``first`` on) cannot be written to ``idx`` of ``region``."""
    if share.skip < first:
        return BadRequest(f"key {key!r} holds its blocks from {first} on (its reader "
                          f"released the ones before): a read cannot take them from "
                          f"{share.skip}")
    if share.skip >= first + num_blocks:
        return BadRequest(f"key {key!r} holds {first + num_blocks} blocks: a read cannot "
                          f"skip {share.skip} of them")
    num_blocks -= share.skip - first
    whole, layout = layout, part_layout(layout, share.part)
    if not layout:
        return BadRequest(f"key {key!r} (layout {describe_layout(whole)}) cannot be cut "
                          f"into {share.part.count} parts")
    if layout != region.layout:
        return LayoutMismatch(
            f"key {key!r} has layout {describe_layout(layout)} but region "
            f"{region.name!r} has {describe_layout(region.layout)}"
        )
    if num_blocks != len(idx):
        return BadRequest(
            f"key {key!r} holds {num_blocks} blocks, {len(idx)} destination blocks given"
        )
    return None


def uncut(item: Item, share: Share) -> KvdError | None:
    """Why a published item's blocks cannot be read in ``share``'s parts (each block not
    one run), found before a read is counted; None if they can."""
    if item.region is None or share.part == WHOLE:
        return None
    try:
        item.region.part(share.part)
    except BadRequest as err:
        return err
    return None


class Remote(Protocol):
    """Transfers to and from other daemons (``transfers.PeerTransfers``): what the engine
    hands a put to another daemon, and a pull from one."""

    @property
    def address(self) -> str: ...

    async def push_blocks(self, key: str, region: Region, idx: torch.Tensor, to: str,
                          ttl_s: float | None, timeout_s: float, first: int = 0) -> int: ...

    async def pull(self, key: str, src: str, region: Region, idx: torch.Tensor,
                   timeout_s: float, wait_for_key_s: float = 0.0, share: Share = ALL,
                   ) -> int: ...


@dataclass(frozen=True)
class Delivered:
    """A waiter's get was served directly by a put: the bytes are already in place."""

    nbytes: int


class Engine:
    def __init__(self, config: Config, pool: HostPool, worker: local.CopyWorker,
                 metrics: Metrics | None = None,
                 gpu_pools: dict[str, HostPool] | None = None,
                 busy_poll_window_s: float = 0.0) -> None:
        self.config = config
        self.gpu_pools = gpu_pools or {}  # "cuda:N" -> staging for arrivals nobody awaits
        self.metrics = metrics or Metrics()
        self.pool = pool
        self.regions = RegionTable()
        self.store = KeyStore()
        self.counters = Counters()
        self.draining = False
        self._loop = asyncio.get_running_loop()
        # Messages touch it; work handed to threads pauses it (daemon/busy_poll.py).
        self.busy_poll = BusyPoll(self._loop, busy_poll_window_s)
        self.copies = LocalCopies(worker, self.busy_poll, self.metrics)
        self.self_names = {"", "local", config.node_id}
        self.remote: Remote | None = None  # set once the daemon has a peer plane
        # Told each key that appears (stored, published, lent), after the gets waiting here.
        self.key_listeners: list[Callable[[str], None]] = []
        self.leases = Leases(self)  # lent keys renewed and released by their readers

    # ------------------------------------------------------------ helpers

    def here(self, address: str) -> bool:
        """Whether a put's destination or a pull's source names this daemon: ``local``,
        its node id, or its own peer address (what two engines that share this daemon
        give each other, as each gives the other node's address between nodes)."""
        return address in self.self_names or (self.remote is not None
                                              and address == self.remote.address)

    def check_accepting(self) -> None:
        if self.draining:
            raise Draining("daemon is draining: no new work accepted")

    def _source(
        self, session: int, region_id: int, blocks: IdArray
    ) -> tuple[Region, torch.Tensor]:
        """New work reading ``blocks`` of one of the session's regions."""
        self.check_accepting()
        region = self.regions.get(session, region_id)
        return region, region.block_index(blocks, writing=False)

    def _destination(
        self, session: int, region_id: int, blocks: IdArray, timeout_s: float
    ) -> tuple[Region, torch.Tensor]:
        """New work writing into ``blocks`` of one of the session's regions."""
        self.check_accepting()
        region = self.regions.get(session, region_id)
        idx = region.block_index(blocks, writing=True)
        self.check_wait(timeout_s)
        return region, idx

    def ttl_deadline(self, ttl_s: float | None) -> float | None:
        if ttl_s is None:
            return None
        if ttl_s <= 0 or ttl_s > self.config.max_ttl_s:
            raise BadRequest(f"ttl_s must be in (0, {self.config.max_ttl_s}], got {ttl_s}")
        return self._loop.time() + ttl_s

    def check_wait(self, timeout_s: float) -> None:
        if timeout_s > self.config.max_wait_s:
            raise BadRequest(f"timeout_s must be <= {self.config.max_wait_s}, got {timeout_s}")

    def _schedule_expiry(self, item: Item) -> None:
        if item.expires_at is None:
            return

        def expire() -> None:
            item.timer = None
            if self.store.find(item.key) is item:
                log.info("key expired key=%s bytes=%d", item.key, item.nbytes)
                self.counters.expired_keys += 1
                if item.published and item.consume_once:  # a lend nobody came for
                    self.leases.counters.expired += 1
                self.store.remove(item, "expired")

        item.timer = self._loop.call_at(item.expires_at, expire)

    def extend(self, item: Item, expires_at: float) -> None:
        """Move ``item``'s expiry to ``expires_at`` (a lease renewed)."""
        if item.timer is not None:
            item.timer.cancel()
            item.timer = None
        item.expires_at = expires_at
        self._schedule_expiry(item)

    def free_pool_item(self, item: Item) -> None:
        if item.pool_block is not None:
            (item.pool or self.pool).free(item.pool_block)
            item.pool_block = None

    async def _fill_pool_item(
        self,
        key: str,
        region: Region,
        idx: torch.Tensor,
        *,
        owner: int | None,
        expires_at: float | None,
        consume_once: bool,
    ) -> Item:
        """Reserve ``key``, gather the blocks into pool memory, store it, wake waiters."""
        self.store.reserve(key)
        block = None
        try:
            _, nbytes = packed_offsets(region.layout, len(idx))
            block = self.pool.alloc(max(nbytes, 1))
            await self.copies.copy([region], nbytes, after_ready, region, local.gather,
                                   region.tensors, region.layout, idx, self.pool.view(block))
        except BaseException:
            if block is not None:
                self.pool.free(block)
            self.store.unreserve(key)
            raise
        item = Item(key=key, layout=region.layout, num_blocks=len(idx), nbytes=nbytes,
                    owner=owner, expires_at=expires_at, consume_once=consume_once,
                    pool_block=block, on_free=self.free_pool_item)
        self.counters.bytes_out += nbytes
        self.add_item(item)
        return item

    def add_item(self, item: Item) -> None:
        if item.consume_once and self.leases.released(item.key):
            # Its reader released it while its bytes came in: they are dropped as they land.
            self.store.unreserve(item.key)
            item.release()
            log.info("key released while it came in, dropped key=%s", item.key)
            return
        self.store.insert(item)
        self._schedule_expiry(item)
        self._wake_waiters(item)
        for listener in self.key_listeners:
            if item.removed:  # consumed by a get already
                return
            listener(item.key)

    def _wake_waiters(self, item: Item) -> None:
        """Hand a new item to the gets waiting for its key (one, if it is consumed). A get
        whose blocks cannot hold it fails, and the item stays for the next one."""
        while not item.removed:
            waiter = self.store.next_waiter(item.key)
            if waiter is None:
                return
            problem = (unfit(item.key, item.layout, item.num_blocks, waiter.region, waiter.idx,
                             waiter.share, item.first) or uncut(item, waiter.share))
            if problem is not None:
                waiter.settle(problem)
                continue
            self.claim(item, waiter.share)
            waiter.settle(item)

    def claim(self, item: Item, share: Share = ALL) -> None:
        """Take a read of ``share`` of ``item``; a consumed item leaves the store once all
        of it is read (by as many readers as its share says)."""
        item.readers += 1
        if item.consume_once and item.count_read(share):
            self.store.pop(item.key, "taken by its reader")
            item.removed = True
            if item.timer is not None:
                item.timer.cancel()
                item.timer = None

    async def _read_item_into(self, item: Item, region: Region, idx: torch.Tensor,
                              share: Share = ALL) -> int:
        """Copy ``share`` of a claimed (and fitting) item into blocks; the claim is
        released whatever happens."""
        share = item.held(share)
        pool = item.pool or self.pool
        try:
            nbytes = region.bytes_per_block * len(idx)
            if item.region is not None:
                assert item.region_idx is not None
                nbytes = await self.copies.copy_blocks(
                    [item.region, region], nbytes, item.region.part(share.part),
                    item.region_idx[share.skip:], region.tensors, idx)
            elif share != ALL:
                assert item.pool_block is not None
                packed = BlockSet.packed(pool.view(item.pool_block), item.layout,
                                         item.num_blocks)
                typed = [t.view(torch_dtype(e.dtype))
                         for t, e in zip(packed.tensors, item.layout, strict=True)]
                tensors, _ = part_of_blocks(typed, item.layout, share.part,
                                            f"key {item.key!r}")
                src_idx = torch.arange(share.skip, item.num_blocks)
                nbytes = await self.copies.copy(
                    [region], nbytes, local.copy_blocks, tensors, src_idx, region.tensors,
                    idx, gpu=tensors[0].is_cuda)
            else:
                assert item.pool_block is not None
                view = pool.view(item.pool_block)
                nbytes = await self.copies.copy(
                    [region], item.nbytes, local.scatter, view, item.layout, region.tensors,
                    idx, gpu=view.is_cuda)
            item.bytes_read += nbytes
        finally:
            item.end_read()
        self.counters.bytes_in += nbytes
        return nbytes

    # ------------------------------------------------------------ operations

    async def register(
        self, session: int, name: str, tensors: Sequence[TensorSpec], block_dim: int,
        segments: Mapping[int, int] | None = None,
    ) -> Region:
        """``segments``: the session's shared-memory segments (descriptors by id) its CPU
        tensors may live in."""
        self.check_accepting()
        self.regions.check_name(session, name)
        if any(isinstance(spec, CudaIpcTensor) for spec in tensors):
            # Opening CUDA IPC handles (and CUDA itself, the first time) takes a while.
            built = await asyncio.to_thread(build_region_tensors, name, tensors, block_dim,
                                            dict(segments or {}))
        else:
            built = build_region_tensors(name, tensors, block_dim, segments)
        region = self.regions.add(session, name, *built)
        log.info(
            "region registered session=%d region=%d name=%s tensors=%d blocks=%d",
            session, region.region_id, name, len(region.tensors), region.num_blocks,
        )
        return region

    async def unregister(self, session: int, region_id: int) -> None:
        region = self.regions.get(session, region_id)
        await self._drop_region(region, reason="region unregistered")

    async def _drop_region(self, region: Region, *, reason: str) -> None:
        # Fail the gets parked on this region, drop keys published from it, then wait
        # for copies touching it before its memory mapping goes away.
        for waiter in self.store.all_waiters():
            if waiter.region.region_id == region.region_id and not waiter.future.done():
                waiter.settle(Cancelled(reason))
        for item in self.store.items():
            if item.region is region:
                self.store.remove(item, "dropped with its region")
        pending = self.copies.holding(region)
        if pending:
            await asyncio.wait(pending, timeout=60.0)
        self.regions.remove(region)
        log.info("region dropped region=%d name=%s reason=%s", region.region_id,
                 region.name, reason)

    async def offload(
        self, session: int, key: str, region_id: int, blocks: IdArray,
        ttl_s: float | None,
    ) -> int:
        region, idx = self._source(session, region_id, blocks)
        item = await self._fill_pool_item(
            key, region, idx, owner=session, expires_at=self.ttl_deadline(ttl_s),
            consume_once=False,
        )
        log.debug("offloaded key=%s bytes=%d", key, item.nbytes)
        return item.nbytes

    async def get(
        self, session: int, req_id: int, key: str, region_id: int, blocks: IdArray,
        timeout_s: float, missing: type[KvdError] = KvdTimeout, share: Share = ALL,
        into: Part = WHOLE,
    ) -> int:
        """Read ``share`` of ``key`` into part ``into`` of the blocks, waiting up to
        ``timeout_s`` for it to appear; when it does not, ``missing`` (a pull of a key of
        this daemon says ``UnknownKey``)."""
        region, idx = self._destination(session, region_id, blocks, timeout_s)
        region = region.part(into)
        item = self.store.find(key)
        if item is not None:
            problem = unfit(key, item.layout, item.num_blocks, region, idx, share,
                            item.first) or uncut(item, share)
            if problem is not None:
                raise problem  # the item stays for a get that fits
            self.claim(item, share)
            return await self._read_item_into(item, region, idx, share)
        if timeout_s == 0:
            raise UnknownKey(f"no key {key!r}")
        if self.leases.released(key):  # its reader (this one?) said it will not come
            raise self.store.missing(key)
        ours = BlockSet(region.tensors, idx.numpy())
        waiter = Waiter(session, req_id, region, idx, self._loop.create_future(), ours,
                        share)
        self.store.add_waiter(key, waiter)
        # Made while we wait rather than after the bytes' offer came, or the put on this
        # daemon whose one-launch copy writes through the map.
        self.prepare_gpu_blocks(ours, region.layout, local_copy=True)
        timer = time_out(waiter.wake, timeout_s)
        try:
            # Not the future itself: a cancel of it would hide a put still writing
            # into our blocks from _settle_abandoned (Waiter.wake).
            result = await waiter.wake
        except (TimedOut, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and waiter.stop_delivery is not None:
                waiter.stop_delivery()  # (past a timeout, bytes on their way still land)
            late = await self._settle_abandoned(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            if late is None:
                raise missing(f"no key {key!r} arrived within {timeout_s:g}s") from None
            result = late
        finally:
            timer.cancel()
            self.store.drop_waiter(key, waiter)
        if isinstance(result, Delivered):
            return result.nbytes
        return await self._read_item_into(result, region, idx, share)

    async def _settle_abandoned(self, waiter: Waiter) -> Delivered | None:
        """A get is leaving (timeout or cancel). If a put is writing into its blocks, wait
        for that copy so nothing lands after the reply; hand back an unread claim. A
        cancel during that wait (after a timeout) is raised once it is over."""
        cancelled = False
        if waiter.delivering and not waiter.future.done():
            cancelled = await wait_out(waiter.future, 60.0)
        late: Delivered | None = None
        if not waiter.future.done() or waiter.future.cancelled():
            waiter.future.cancel()
        elif waiter.future.exception() is None:
            result = waiter.future.result()
            if isinstance(result, Delivered):
                late = result
            else:
                self._unclaim(result, waiter.share)
        if cancelled:
            raise asyncio.CancelledError
        return late

    def _unclaim(self, item: Item, share: Share) -> None:
        item.readers -= 1
        if item.consume_once:
            item.count_read(share, by=-1)
        if item.consume_once and self.store.find(item.key) is None and item.removed:
            # Nobody read it: put it back for the next get rather than lose it.
            item.removed = False
            self.add_item(item)
        elif item.removed:
            item.release()

    async def put(
        self, session: int, key: str, region_id: int, blocks: IdArray, to: str,
        ttl_s: float | None, timeout_s: float,
    ) -> int:
        region, idx = self._source(session, region_id, blocks)
        self.check_wait(timeout_s)
        if self.leases.released(key):  # its reader said it will not come for it
            log.info("put of a released key answered at once key=%s", key)
            return 0
        if not self.here(to):
            if self.remote is None:
                raise BadRequest(f"unknown destination {to!r}: this daemon has no peer plane")
            # Its reader may have released its first blocks (it has them): only the rest
            # is sent, and the receiver stores the key as starting there.
            first = self.store.tail(key)
            if first >= len(idx):
                log.info("put of a key its reader has whole answered at once key=%s", key)
                return 0
            return await self.remote.push_blocks(key, region, idx[first:], to, ttl_s,
                                                 timeout_s, first)
        expires_at = self.ttl_deadline(ttl_s if ttl_s is not None else self.config.put_ttl_s)
        if self.store.exists(key):
            raise BadRequest(f"key {key!r} already exists")
        while (waiter := self.store.next_waiter(key, takes=ALL)) is not None:
            problem = unfit(key, region.layout, len(idx), waiter.region, waiter.idx)
            if problem is None:
                return await self._deliver(key, region, idx, waiter)
            waiter.settle(problem)  # that get was wrong; keep the data
        item = await self._fill_pool_item(
            key, region, idx, owner=None, expires_at=expires_at, consume_once=True
        )
        log.debug("put stored key=%s bytes=%d", key, item.nbytes)
        return item.nbytes

    async def _deliver(self, key: str, region: Region, idx: torch.Tensor, waiter: Waiter) -> int:
        """Put straight into the blocks of a waiting get: one copy, no pool."""
        waiter.delivering = True
        try:
            nbytes = await self.copies.copy_blocks(
                [region, waiter.region], region.bytes_per_block * len(idx), region, idx,
                waiter.region.tensors, waiter.idx, waiter.blocks)
        except BaseException as exc:
            if not waiter.future.done():
                waiter.settle(
                    exc if isinstance(exc, Exception) else Cancelled("put was cancelled")
                )
            raise
        self.counters.bytes_out += nbytes
        self.counters.bytes_in += nbytes
        if not waiter.future.done():
            waiter.settle(Delivered(nbytes))
        return nbytes

    async def pull(
        self, session: int, key: str, src: str, region_id: int, blocks: IdArray,
        timeout_s: float, wait_for_key_s: float = 0.0, share: Share = ALL,
        into: Part = WHOLE,
    ) -> int:
        """Read ``share`` of ``key`` from daemon ``src`` into part ``into`` of the blocks."""
        region, idx = self._destination(session, region_id, blocks, timeout_s)
        region = region.part(into)
        wait_for_key_s = min(wait_for_key_s, timeout_s)
        if self.here(src):
            if self.store.find(key) is None and self.store.gone(key):
                raise self.store.missing(key)  # KeyGone: it will not come back, no wait
            return await self.get(session, 0, key, region_id, blocks, wait_for_key_s,
                                  missing=UnknownKey, share=share, into=into)
        if self.remote is None:
            raise BadRequest(f"unknown source {src!r}: this daemon has no peer plane")
        return await self.remote.pull(key, src, region, idx, timeout_s, wait_for_key_s,
                                      share)

    def publish(
        self, session: int, key: str, region_id: int, blocks: IdArray,
        ttl_s: float | None, consume_once: bool = False,
        on_free: Callable[[Item], None] | None = None,
    ) -> Item:
        """Store a slice of a region under ``key``, read in place."""
        region, idx = self._source(session, region_id, blocks)
        expires_at = self.ttl_deadline(ttl_s)
        self.store.reserve(key)
        _, nbytes = packed_offsets(region.layout, len(idx))
        slice_ = BlockSet(region.tensors, idx.numpy())
        item = Item(
            key=key, layout=region.layout, num_blocks=len(idx), nbytes=nbytes, owner=session,
            expires_at=expires_at, consume_once=consume_once, region=region, region_idx=idx,
            blocks=slice_, on_free=on_free,
        )
        # A peer's pull will send these blocks (the vLLM connector's flow: prefill lends,
        # decode pulls): what its send needs of them is found now, not after the pull came
        # (one may be waiting already: it is served as the item is added).
        self.prepare_gpu_blocks(slice_, region.layout)
        self.add_item(item)
        return item

    async def lend(
        self, session: int, key: str, region_id: int, blocks: IdArray, ttl_s: float,
    ) -> int:
        """Publish for one reader; returns, once no copy reads the blocks any more, the
        bytes that reader took (0: nobody took them before the TTL or a cancel). Until then
        the owner must not reuse the blocks."""
        if self.leases.released(key):  # its reader said it will not come, before this
            self._source(session, region_id, blocks)  # (a bad request is still refused)
            log.info("lend of a released key answered at once key=%s", key)
            return 0
        freed: asyncio.Future[int] = self._loop.create_future()

        def on_free(item: Item) -> None:
            if not freed.done():
                freed.set_result(item.bytes_read)

        item = self.publish(session, key, region_id, blocks, ttl_s, consume_once=True,
                            on_free=on_free)
        try:
            return await asyncio.shield(freed)
        except asyncio.CancelledError:
            # Withdrawn by the owner: a read in progress still finishes before we answer.
            self.store.remove(item, "withdrawn by its owner")
            await wait_out(freed, 60.0)
            raise

    def unpublish(self, session: int, key: str) -> None:
        item = self._owned_item(session, key)
        if not item.published:
            raise BadRequest(f"key {key!r} is stored, not published; use delete")
        self.store.remove(item, "unpublished")

    def delete(self, session: int, key: str) -> None:
        item = self._owned_item(session, key, any_owner=True)
        if item.published:
            raise BadRequest(f"key {key!r} is published; use unpublish")
        self.store.remove(item, "deleted")

    def _owned_item(self, session: int, key: str, any_owner: bool = False) -> Item:
        item = self.store.find(key)
        if item is None:
            raise UnknownKey(f"no key {key!r}")
        if item.owner != session and not (any_owner and item.owner is None):
            raise BadRequest(f"key {key!r} belongs to another client")
        return item

    # ------------------------------------------------------------ data from other daemons

    def prepare_gpu_blocks(self, blocks: BlockSet, layout: Layout,
                           local_copy: bool = False) -> None:
        """What an NCCL transfer of GPU ``blocks`` needs of them, found ahead of it: the
        copy kernel's map (its upload is ~0.1-0.3 ms, on the critical path when made at
        the transfer's start) and the views a send or receive takes straight from or into
        them, for the usual chunk size. ``local_copy``: the map in any case, for a copy
        within this daemon (a put into a waiting get: 35-70 us of the put's path on the
        H200 host otherwise)."""
        device = blocks.tensors[0].device if blocks.tensors else None
        if device is None or device.type != "cuda":
            return
        direct = blocks.direct_chunks(plan_chunks(layout, len(blocks.ids),
                                                  self.config.nccl_chunk_bytes), device)
        if local_copy or any(view is None for view in direct):  # staging, or a local copy
            blocks.block_map(device)

    # ------------------------------------------------------------ sessions and stats

    async def drop_session(self, session: int, reason: str) -> None:
        """Release what a client owned."""
        for item in self.store.items():
            if item.owner != session:
                continue
            if item.published or item.expires_at is None:
                self.store.remove(item, "dropped when its owner left")
            else:
                item.owner = None  # outlives its owner until its TTL; anyone may delete it
        for region in self.regions.owned_by(session):
            await self._drop_region(region, reason=reason)

    def stats(self) -> dict[str, Any]:
        pool: dict[str, Any] = {**self.pool.stats(), "pinned": self.pool.pinned}
        gpu_staging = {dev: p.stats() for dev, p in self.gpu_pools.items()}
        return {
            "node_id": self.config.node_id,
            "draining": self.draining,
            "pool": pool,
            "regions": len(self.regions),
            "keys": len(self.store),
            "keys_pool_bytes": self.store.pool_bytes(),
            "waiting_gets": self.store.waiting_count(),
            "ops": _sum_by(self.counters.requests, 0),
            "op_errors": _sum_by({k: v for k, v in self.counters.requests.items()
                                  if k[1] != "ok"}, 1),
            "bytes_in": self.counters.bytes_in,
            "bytes_out": self.counters.bytes_out,
            "expired_keys": self.counters.expired_keys,
            "leases": self.leases.stats(),
            "gpu_staging": gpu_staging,
            "gpu_spills": self.counters.gpu_spills,
            "busy_poll": self.busy_poll.stats(),
            "time": time.time(),
        }

