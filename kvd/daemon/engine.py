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
from typing import Any, TypeVar

import torch

from kvd import timeline
from kvd.config import Config
from kvd.daemon.busy_poll import BusyPoll
from kvd.daemon.futures import on_loop, wait_out
from kvd.daemon.metrics import Metrics
from kvd.daemon.store import Item, KeyStore, Waiter
from kvd.errors import (
    BadRequest,
    Cancelled,
    Draining,
    KvdError,
    KvdTimeout,
    LayoutMismatch,
    PoolExhausted,
    TransferFailed,
    UnknownKey,
)
from kvd.memory.pool import HostPool, PoolBlock
from kvd.memory.regions import (
    IdArray,
    Layout,
    Region,
    RegionTable,
    build_region_tensors,
    describe_layout,
    packed_offsets,
)
from kvd.protocol import CudaIpcTensor, TensorSpec
from kvd.transport import local
from kvd.transport.chunks import BlockSet, plan_chunks

log = logging.getLogger(__name__)

_T = TypeVar("_T")

INLINE_COPY_BYTES = 256 * 1024
# A GPU copy queued from the loop (Engine._gpu_copy_on_loop) is polled at every turn for
# its expected time (bytes at this rate, plus this much), then every _GPU_COPY_POLL_S,
# and given up after _GPU_COPY_TIMEOUT_S plus 1 s per GB.
_GPU_COPY_SPIN_S = 0.002
_GPU_COPY_BYTES_PER_S = 200e9
_GPU_COPY_POLL_S = 0.0002
_GPU_COPY_TIMEOUT_S = 60.0


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


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any, float]:
    """Run ``fn`` in the worker, with when it started and ended (for the metrics)."""
    started = time.monotonic()
    timeline.mark("copy.start")
    result = fn(*args)
    timeline.mark("copy.end")
    return started, result, time.monotonic()


def _after_ready(source: Region, fn: Callable[..., _T], *args: Any) -> _T:
    """Run a copy that reads ``source`` after the writes its client recorded (interprocess
    CUDA events, see ``protocol.CudaIpcTensor.ready_event``)."""
    if source.ready_events:
        from kvd.memory.cuda_ipc import wait_ready

        wait_ready(source.ready_events)
    return fn(*args)


def _sum_by(table: dict[tuple[str, str], int], part: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, n in table.items():
        out[key[part]] = out.get(key[part], 0) + n
    return out


def _unfit(
    key: str, layout: Layout, num_blocks: int, region: Region, idx: torch.Tensor
) -> KvdError | None:
    """Why data of ``layout`` x ``num_blocks`` cannot be written to ``idx`` of ``region``."""
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


@dataclass(eq=False)
class Arrival:
    """Where the bytes of one incoming transfer go, and what to do when they are in."""

    key: str
    layout: Layout
    num_blocks: int
    expires_at: float | None
    blocks: BlockSet  # the destination memory, wire order
    waiter: Waiter | None = None  # a get waiting for the key: its blocks
    pool_block: PoolBlock | None = None  # else pool memory (host or GPU), stored as the key
    pool: HostPool | None = None
    region: Region | None = None  # a pull: the puller's blocks

    @property
    def device(self) -> torch.device:
        """Where the bytes land (the first tensor's device)."""
        return self.blocks.tensors[0].device

    def wire_views(self) -> list[memoryview]:
        """The destination as memoryviews, for a socket (host memory only)."""
        return self.blocks.views()


@dataclass(frozen=True)
class _Delivered:
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
        self._copies_in_flight: dict[int, int] = {}  # id -> bytes
        self.pool = pool
        self.worker = worker
        self.regions = RegionTable()
        self.store = KeyStore()
        self.counters = Counters()
        self.draining = False
        self._loop = asyncio.get_running_loop()
        # Messages touch it; work handed to threads pauses it (daemon/busy_poll.py).
        self.busy_poll = BusyPoll(self._loop, busy_poll_window_s)
        self._region_copies: dict[int, set[asyncio.Future[Any]]] = {}
        self._background: set[asyncio.Task[None]] = set()  # GPU copies polled past a cancel
        self.self_names = {"", "local", config.node_id}
        self.remote: Any = None  # the peer transfers, when the daemon has a peer plane
        # Told each key that appears (stored, published, lent), after the gets waiting here.
        self.key_listeners: list[Callable[[str], None]] = []

    # ------------------------------------------------------------ helpers

    def _check_accepting(self) -> None:
        if self.draining:
            raise Draining("daemon is draining: no new work accepted")

    def _source(
        self, session: int, region_id: int, blocks: IdArray
    ) -> tuple[Region, torch.Tensor]:
        """New work reading ``blocks`` of one of the session's regions."""
        self._check_accepting()
        region = self.regions.get(session, region_id)
        return region, region.block_index(blocks, writing=False)

    def _destination(
        self, session: int, region_id: int, blocks: IdArray, timeout_s: float
    ) -> tuple[Region, torch.Tensor]:
        """New work writing into ``blocks`` of one of the session's regions."""
        self._check_accepting()
        region = self.regions.get(session, region_id)
        idx = region.block_index(blocks, writing=True)
        self._check_wait(timeout_s)
        return region, idx

    def _ttl_deadline(self, ttl_s: float | None) -> float | None:
        if ttl_s is None:
            return None
        if ttl_s <= 0 or ttl_s > self.config.max_ttl_s:
            raise BadRequest(f"ttl_s must be in (0, {self.config.max_ttl_s}], got {ttl_s}")
        return self._loop.time() + ttl_s

    def _check_wait(self, timeout_s: float) -> float:
        if timeout_s > self.config.max_wait_s:
            raise BadRequest(f"timeout_s must be <= {self.config.max_wait_s}, got {timeout_s}")
        return timeout_s

    async def _copy(
        self, regions: Sequence[Region], nbytes: int, fn: Callable[..., int], *args: Any,
        gpu: bool = False,
    ) -> int:
        """Run a copy in the worker; if cancelled mid-copy, wait for it to finish first.

        A copy of at most INLINE_COPY_BYTES runs on the loop: it takes microseconds, less
        than the two thread hand-offs (and GIL switches) the worker would cost."""
        submitted = time.monotonic()
        if nbytes <= INLINE_COPY_BYTES and not gpu and not any(r.on_gpu for r in regions):
            try:
                result = fn(*args)
            except Exception:
                self._record_copy("failed", nbytes, 0.0, None)
                raise
            self._record_copy("done", nbytes, 0.0, time.monotonic() - submitted)
            return result
        cfut = self.worker.submit(_timed, fn, *args)
        self.busy_poll.thread_work(cfut)
        afut = on_loop(cfut)
        self._copies_in_flight[id(afut)] = nbytes
        outcome, started, ended = "failed", None, None
        self.hold_regions(regions, afut)
        try:
            try:
                started, result, ended = await asyncio.shield(afut)
                outcome = "done"
                return int(result)
            except asyncio.CancelledError:
                outcome = "cancelled"
                if not cfut.cancel():
                    await wait_out(afut, 60.0)
                raise
        finally:
            del self._copies_in_flight[id(afut)]
            self._record_copy(outcome, nbytes,
                              None if started is None else started - submitted,
                              None if started is None or ended is None else ended - started)

    async def _copy_blocks(
        self, regions: Sequence[Region], nbytes: int, source: Region, src_idx: torch.Tensor,
        dst: Sequence[torch.Tensor], dst_idx: torch.Tensor, dst_blocks: BlockSet | None = None,
    ) -> int:
        """Blocks of ``source`` into blocks of another region (``regions``: both). Between
        GPU regions the copy is queued from the loop and its completion polled there
        (``_gpu_copy_on_loop``); otherwise, or where the copy kernel cannot describe the
        memory, in the copy worker."""
        if source.on_gpu and dst and dst[0].is_cuda:
            done = await self._gpu_copy_on_loop(regions, nbytes, source, src_idx, dst,
                                                dst_idx, dst_blocks)
            if done is not None:
                return done
        return await self._copy(regions, nbytes, _after_ready, source, local.copy_blocks,
                                source.tensors, src_idx, dst, dst_idx)

    async def _gpu_copy_on_loop(
        self, regions: Sequence[Region], nbytes: int, source: Region, src_idx: torch.Tensor,
        dst: Sequence[torch.Tensor], dst_idx: torch.Tensor, dst_blocks: BlockSet | None,
    ) -> int | None:
        """Queue a copy between GPU regions from the loop: kernel launches and stream
        waits, no wait for the GPU here. That saves the copy worker's two hand-offs
        (~200 us on the H200 host before the worker started, then its wait and the way
        back) and keeps the loop spinning (busy_poll) instead of pausing for a thread.
        The bytes are in when the destination's events complete, polled at every turn of
        the loop while the copy should still be running, then every 0.2 ms; the regions
        stay mapped until then, even past a cancel or the deadline. None: not queued."""
        submitted = time.monotonic()
        try:
            queued = _after_ready(source, local.copy_gpu_blocks_queued, source.tensors,
                                  src_idx, dst, dst_idx, dst_blocks)
        except Exception:
            self._record_copy("failed", nbytes, 0.0, None)
            raise
        if queued is None:
            return None
        copied, events = queued
        done: asyncio.Future[None] = self._loop.create_future()
        self.hold_regions(regions, done)
        self._copies_in_flight[id(done)] = nbytes
        busy_until = submitted + _GPU_COPY_SPIN_S + nbytes / _GPU_COPY_BYTES_PER_S
        deadline = submitted + _GPU_COPY_TIMEOUT_S + nbytes / 1e9

        async def complete() -> None:
            try:
                while not all(e.query() for e in events):
                    now = time.monotonic()
                    if now > deadline:
                        # Still holding the regions: a GPU this late is stuck, but the
                        # copy may yet write into them.
                        log.error("a GPU copy of %d bytes is not done after %.0fs",
                                  nbytes, now - submitted)
                        await asyncio.sleep(1.0)
                    else:
                        await asyncio.sleep(0 if now < busy_until else _GPU_COPY_POLL_S)
                done.set_result(None)
            except BaseException as exc:  # a failed launch shows here (CUDA error)
                done.set_exception(exc)

        waiter = self._loop.create_task(complete())
        outcome = "failed"
        try:
            await asyncio.wait_for(asyncio.shield(done), deadline - time.monotonic())
            outcome = "done"
            return copied
        except TimeoutError:
            raise TransferFailed(f"GPU copy of {nbytes} bytes did not complete within "
                                 f"{deadline - submitted:.0f}s") from None
        except asyncio.CancelledError:
            outcome = "cancelled"
            await wait_out(done, 60.0)  # bytes already on their way land first
            raise
        finally:
            del self._copies_in_flight[id(done)]
            if done.done() and not done.cancelled():
                done.exception()  # retrieved: reported through the await above
            if not waiter.done():
                self._background.add(waiter)
                waiter.add_done_callback(self._background.discard)
            self._record_copy(outcome, nbytes, 0.0, time.monotonic() - submitted)

    def _record_copy(self, outcome: str, nbytes: int, queue_s: float | None,
                     wire_s: float | None) -> None:
        self.metrics.transfer(peer="local", direction="local", transport="local",
                              outcome=outcome, nbytes=nbytes, queue_s=queue_s, wire_s=wire_s)

    def in_flight(self) -> tuple[int, int]:
        """Local copies running or queued: how many, how many bytes."""
        return len(self._copies_in_flight), sum(self._copies_in_flight.values())

    def _schedule_expiry(self, item: Item) -> None:
        if item.expires_at is None:
            return

        def expire() -> None:
            item.timer = None
            if self.store.find(item.key) is item:
                log.info("key expired key=%s bytes=%d", item.key, item.nbytes)
                self.counters.expired_keys += 1
                self.store.remove(item)

        item.timer = self._loop.call_at(item.expires_at, expire)

    def _free_pool_item(self, item: Item) -> None:
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
        try:
            _, nbytes = packed_offsets(region.layout, len(idx))
            block = self.pool.alloc(max(nbytes, 1))
            try:
                view = self.pool.view(block)
                await self._copy([region], nbytes, _after_ready, region, local.gather,
                                 region.tensors, region.layout,
                                 idx, view)
            except BaseException:
                self.pool.free(block)
                raise
        except BaseException:
            self.store.unreserve(key)
            raise
        item = Item(
            key=key,
            layout=region.layout,
            num_blocks=len(idx),
            nbytes=nbytes,
            owner=owner,
            expires_at=expires_at,
            consume_once=consume_once,
            pool_block=block,
            on_free=self._free_pool_item,
        )
        self.counters.bytes_out += nbytes
        self._add_item(item)
        return item

    def _add_item(self, item: Item) -> None:
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
            problem = _unfit(item.key, item.layout, item.num_blocks, waiter.region, waiter.idx)
            if problem is not None:
                waiter.future.set_exception(problem)
                continue
            self._claim(item)
            waiter.future.set_result(item)
            if item.consume_once:
                return

    def _claim(self, item: Item) -> None:
        """Take a reader's share of ``item``; a consumed item leaves the store now."""
        item.readers += 1
        if item.consume_once:
            self.store.pop(item.key)
            item.removed = True
            if item.timer is not None:
                item.timer.cancel()
                item.timer = None

    async def _read_item_into(self, item: Item, region: Region, idx: torch.Tensor) -> int:
        """Copy a claimed (and fitting) item into blocks; the claim is released whatever
        happens."""
        try:
            if item.region is not None:
                assert item.region_idx is not None
                nbytes = await self._copy_blocks(
                    [item.region, region], item.nbytes, item.region, item.region_idx,
                    region.tensors, idx)
            else:
                assert item.pool_block is not None
                pool = item.pool or self.pool
                view = pool.view(item.pool_block)
                nbytes = await self._copy(
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
        self._check_accepting()
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
            if waiter.region is region and not waiter.future.done():
                waiter.future.set_exception(Cancelled(reason))
        for item in self.store.items():
            if item.region is region:
                self.store.remove(item)
        pending = self._region_copies.get(region.region_id)
        if pending:
            await asyncio.wait(set(pending), timeout=60.0)
        self.regions.remove(region)
        log.info("region dropped region=%d name=%s reason=%s", region.region_id,
                 region.name, reason)

    async def offload(
        self, session: int, key: str, region_id: int, blocks: IdArray,
        ttl_s: float | None,
    ) -> int:
        region, idx = self._source(session, region_id, blocks)
        item = await self._fill_pool_item(
            key, region, idx, owner=session, expires_at=self._ttl_deadline(ttl_s),
            consume_once=False,
        )
        log.debug("offloaded key=%s bytes=%d", key, item.nbytes)
        return item.nbytes

    async def get(
        self, session: int, req_id: int, key: str, region_id: int, blocks: IdArray,
        timeout_s: float, missing: type[KvdError] = KvdTimeout,
    ) -> int:
        """Read ``key`` into the blocks, waiting up to ``timeout_s`` for it to appear; when
        it does not, ``missing`` (a pull of a key of this daemon says ``UnknownKey``)."""
        region, idx = self._destination(session, region_id, blocks, timeout_s)
        item = self.store.find(key)
        if item is not None:
            problem = _unfit(key, item.layout, item.num_blocks, region, idx)
            if problem is not None:
                raise problem  # the item stays for a get that fits
            self._claim(item)
            return await self._read_item_into(item, region, idx)
        if timeout_s == 0:
            raise UnknownKey(f"no key {key!r}")
        ours = BlockSet(region.tensors, idx.numpy())
        waiter = Waiter(session, req_id, region, idx, self._loop.create_future(), ours)
        self.store.add_waiter(key, waiter)
        # Made while we wait rather than after the bytes' offer came.
        self.prepare_gpu_blocks(ours, region.layout)
        try:
            async with asyncio.timeout(timeout_s):
                # Shielded: a cancel must not cancel the future itself, which would
                # hide a put still writing into our blocks from _settle_abandoned.
                result = await asyncio.shield(waiter.future)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and waiter.stop_delivery is not None:
                waiter.stop_delivery()  # (past a timeout, bytes on their way still land)
            late = await self._settle_abandoned(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            if late is None:
                raise missing(f"no key {key!r} arrived within {timeout_s:g}s") from None
            result = late
        finally:
            self.store.drop_waiter(key, waiter)
        if isinstance(result, _Delivered):
            return result.nbytes
        return await self._read_item_into(result, region, idx)

    async def _settle_abandoned(self, waiter: Waiter) -> _Delivered | None:
        """A get is leaving (timeout or cancel). If a put is writing into its blocks, wait
        for that copy so nothing lands after the reply; hand back an unread claim. A
        cancel during that wait (after a timeout) is raised once it is over."""
        cancelled = False
        if waiter.delivering and not waiter.future.done():
            cancelled = await wait_out(waiter.future, 60.0)
        late: _Delivered | None = None
        if not waiter.future.done() or waiter.future.cancelled():
            waiter.future.cancel()
        elif waiter.future.exception() is None:
            result = waiter.future.result()
            if isinstance(result, _Delivered):
                late = result
            else:
                self._unclaim(result)
        if cancelled:
            raise asyncio.CancelledError
        return late

    def _unclaim(self, item: Item) -> None:
        item.readers -= 1
        if item.consume_once and self.store.find(item.key) is None and item.removed:
            # Nobody read it: put it back for the next get rather than lose it.
            item.removed = False
            self._add_item(item)
        elif item.removed:
            item.release()

    async def put(
        self, session: int, key: str, region_id: int, blocks: IdArray, to: str,
        ttl_s: float | None, timeout_s: float,
    ) -> int:
        region, idx = self._source(session, region_id, blocks)
        self._check_wait(timeout_s)
        if to not in self.self_names:
            if self.remote is None:
                raise BadRequest(f"unknown destination {to!r}: this daemon has no peer plane")
            return await self.remote.push_blocks(key, region, idx, to, ttl_s, timeout_s)
        expires_at = self._ttl_deadline(ttl_s if ttl_s is not None else self.config.put_ttl_s)
        if self.store.exists(key):
            raise BadRequest(f"key {key!r} already exists")
        while (waiter := self.store.next_waiter(key)) is not None:
            problem = _unfit(key, region.layout, len(idx), waiter.region, waiter.idx)
            if problem is None:
                return await self._deliver(key, region, idx, waiter)
            waiter.future.set_exception(problem)  # that get was wrong; keep the data
        item = await self._fill_pool_item(
            key, region, idx, owner=None, expires_at=expires_at, consume_once=True
        )
        log.debug("put stored key=%s bytes=%d", key, item.nbytes)
        return item.nbytes

    async def _deliver(self, key: str, region: Region, idx: torch.Tensor, waiter: Waiter) -> int:
        """Put straight into the blocks of a waiting get: one copy, no pool."""
        waiter.delivering = True
        try:
            nbytes = await self._copy_blocks(
                [region, waiter.region], region.bytes_per_block * len(idx), region, idx,
                waiter.region.tensors, waiter.idx, waiter.blocks)
        except BaseException as exc:
            if not waiter.future.done():
                waiter.future.set_exception(
                    exc if isinstance(exc, Exception) else Cancelled("put was cancelled")
                )
            raise
        self.counters.bytes_out += nbytes
        self.counters.bytes_in += nbytes
        if not waiter.future.done():
            waiter.future.set_result(_Delivered(nbytes))
        return nbytes

    async def pull(
        self, session: int, key: str, src: str, region_id: int, blocks: IdArray,
        timeout_s: float, wait_for_key_s: float = 0.0,
    ) -> int:
        region, idx = self._destination(session, region_id, blocks, timeout_s)
        wait_for_key_s = min(wait_for_key_s, timeout_s)
        if src in self.self_names or (self.remote is not None and src == self.remote.address):
            return await self.get(session, 0, key, region_id, blocks, wait_for_key_s,
                                  missing=UnknownKey)
        if self.remote is None:
            raise BadRequest(f"unknown source {src!r}: this daemon has no peer plane")
        return await self.remote.pull(key, src, region, idx, timeout_s, wait_for_key_s)

    def publish(
        self, session: int, key: str, region_id: int, blocks: IdArray,
        ttl_s: float | None,
    ) -> int:
        return self._publish(session, key, region_id, blocks, ttl_s).nbytes

    def _publish(
        self, session: int, key: str, region_id: int, blocks: IdArray,
        ttl_s: float | None, consume_once: bool = False,
        on_free: Callable[[Item], None] | None = None,
    ) -> Item:
        """Store a slice of a region under ``key``, read in place."""
        region, idx = self._source(session, region_id, blocks)
        expires_at = self._ttl_deadline(ttl_s)
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
        self._add_item(item)
        return item

    async def lend(
        self, session: int, key: str, region_id: int, blocks: IdArray, ttl_s: float,
    ) -> int:
        """Publish for one reader; returns, once no copy reads the blocks any more, the
        bytes that reader took (0: nobody took them before the TTL or a cancel). Until then
        the owner must not reuse the blocks."""
        freed: asyncio.Future[int] = self._loop.create_future()

        def on_free(item: Item) -> None:
            if not freed.done():
                freed.set_result(item.bytes_read)

        item = self._publish(session, key, region_id, blocks, ttl_s, consume_once=True,
                             on_free=on_free)
        try:
            return await asyncio.shield(freed)
        except asyncio.CancelledError:
            # Withdrawn by the owner: a read in progress still finishes before we answer.
            self.store.remove(item)
            await wait_out(freed, 60.0)
            raise

    def unpublish(self, session: int, key: str) -> None:
        item = self._owned_item(session, key)
        if not item.published:
            raise BadRequest(f"key {key!r} is stored, not published; use delete")
        self.store.remove(item)

    def delete(self, session: int, key: str) -> None:
        item = self._owned_item(session, key, any_owner=True)
        if item.published:
            raise BadRequest(f"key {key!r} is published; use unpublish")
        self.store.remove(item)

    def _owned_item(self, session: int, key: str, any_owner: bool = False) -> Item:
        item = self.store.find(key)
        if item is None:
            raise UnknownKey(f"no key {key!r}")
        if item.owner != session and not (any_owner and item.owner is None):
            raise BadRequest(f"key {key!r} belongs to another client")
        return item

    # ------------------------------------------------------------ data from other daemons

    def arrival(self, key: str, layout: Layout, num_blocks: int, ttl_s: float | None,
                gpu: str | None = None) -> Arrival:
        """Where bytes for ``key`` from a peer go: the blocks of the oldest fitting get
        that waits for it, else new pool memory — GPU staging on ``gpu`` first when the
        bytes come over NCCL, then the host pool (``PoolExhausted`` if none: the sender
        is told BUSY). Gets that wait but cannot take it fail with the reason."""
        self._check_accepting()
        if self.store.exists(key):
            raise BadRequest(f"key {key!r} already exists on {self.config.node_id}")
        expires_at = self._ttl_deadline(ttl_s if ttl_s is not None else self.config.put_ttl_s)
        while (waiter := self.store.next_waiter(key)) is not None:
            problem = _unfit(key, layout, num_blocks, waiter.region, waiter.idx)
            if problem is None:
                waiter.delivering = True
                return Arrival(key, layout, num_blocks, expires_at, waiter.blocks,
                               waiter=waiter)
            waiter.future.set_exception(problem)
        _, packed = packed_offsets(layout, num_blocks)
        pool, block = self._staging_for(max(packed, 1), gpu)
        self.store.reserve(key)
        blocks = BlockSet.packed(pool.view(block), layout, num_blocks)
        return Arrival(key, layout, num_blocks, expires_at, blocks, pool_block=block,
                       pool=pool)

    def get_waits_for(self, key: str, layout: Layout, num_blocks: int) -> bool:
        """Whether a get waits for ``key`` in blocks that fit ``num_blocks`` of ``layout``:
        ``arrival`` puts such bytes there, whatever room the pools have."""
        return any(_unfit(key, layout, num_blocks, w.region, w.idx) is None
                   for w in self.store.waiters(key))

    def _staging_for(self, nbytes: int, gpu: str | None) -> tuple[HostPool, PoolBlock]:
        """GPU staging on ``gpu`` if it has room, else the host pool (spill)."""
        gpu_pool = self.gpu_pools.get(gpu) if gpu is not None else None
        if gpu_pool is not None:
            try:
                return gpu_pool, gpu_pool.alloc(nbytes)
            except PoolExhausted:
                self.counters.gpu_spills += 1
        return self.pool, self.pool.alloc(nbytes)

    def arrival_into(self, key: str, region: Region, blocks: BlockSet) -> Arrival:
        """Bytes a pull asked for go straight into the puller's blocks."""
        return Arrival(key, region.layout, len(blocks.ids), None, blocks, region=region)

    def arrived(self, arrival: Arrival, nbytes: int) -> None:
        self.counters.bytes_in += nbytes
        if arrival.waiter is not None:
            if not arrival.waiter.future.done():
                arrival.waiter.future.set_result(_Delivered(nbytes))
        elif arrival.pool_block is not None:
            _, packed = packed_offsets(arrival.layout, arrival.num_blocks)
            self._add_item(Item(
                key=arrival.key, layout=arrival.layout, num_blocks=arrival.num_blocks,
                nbytes=packed, owner=None, expires_at=arrival.expires_at, consume_once=True,
                pool_block=arrival.pool_block, pool=arrival.pool,
                on_free=self._free_pool_item))

    def arrival_failed(self, arrival: Arrival, error: KvdError) -> None:
        if arrival.waiter is not None:
            if not arrival.waiter.future.done():
                arrival.waiter.future.set_exception(error)
        elif arrival.pool_block is not None:
            self.store.unreserve(arrival.key)
            (arrival.pool or self.pool).free(arrival.pool_block)
            arrival.pool_block = None

    def prepare_gpu_blocks(self, blocks: BlockSet, layout: Layout) -> None:
        """What an NCCL transfer of GPU ``blocks`` needs of them, found ahead of it: the
        copy kernel's map (its upload is ~0.1-0.3 ms, on the critical path when made at
        the transfer's start) and the views a send or receive takes straight from or into
        them, for the usual chunk size."""
        device = blocks.tensors[0].device if blocks.tensors else None
        if device is None or device.type != "cuda":
            return
        direct = blocks.direct_chunks(plan_chunks(layout, len(blocks.ids),
                                                  self.config.nccl_chunk_bytes), device)
        if any(view is None for view in direct):  # some chunk goes through staging
            blocks.block_map(device)

    def source_blocks(self, item: Item) -> BlockSet:
        """The bytes of a stored or published item, wire order (the caller holds a read)."""
        if item.blocks is not None:
            return item.blocks
        assert item.pool_block is not None
        pool = item.pool or self.pool
        return BlockSet.packed(pool.view(item.pool_block), item.layout, item.num_blocks)

    def readable(self, key: str, layout: Layout, num_blocks: int) -> Item:
        """Claim a read of ``key`` for a peer that pulls it into blocks of ``layout``."""
        item = self.store.find(key)
        if item is None:
            raise UnknownKey(f"no key {key!r} on {self.config.node_id}")
        if item.layout != layout:
            raise LayoutMismatch(
                f"key {key!r} has layout {describe_layout(item.layout)}, the puller's "
                f"region has {describe_layout(layout)}")
        if item.num_blocks != num_blocks:
            raise BadRequest(f"key {key!r} holds {item.num_blocks} blocks, "
                             f"{num_blocks} asked for")
        self._claim(item)
        return item

    def hold_regions(self, regions: Sequence[Region], fut: asyncio.Future[Any]) -> None:
        """Keep ``regions`` mapped until ``fut`` settles: call it when a thread starts
        reading or writing their memory, before anything else can run on the loop."""
        for region in regions:
            self._region_copies.setdefault(region.region_id, set()).add(fut)

        def release(_fut: asyncio.Future[Any]) -> None:
            for region in regions:
                pending = self._region_copies.get(region.region_id)
                if pending is not None:
                    pending.discard(fut)
                    if not pending:
                        del self._region_copies[region.region_id]

        fut.add_done_callback(release)

    # ------------------------------------------------------------ sessions and stats

    async def drop_session(self, session: int, reason: str) -> None:
        """Release what a client owned."""
        for item in self.store.items():
            if item.owner != session:
                continue
            if item.published or item.expires_at is None:
                self.store.remove(item)
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
            "gpu_staging": gpu_staging,
            "gpu_spills": self.counters.gpu_spills,
            "busy_poll": self.busy_poll.stats(),
            "time": time.time(),
        }

