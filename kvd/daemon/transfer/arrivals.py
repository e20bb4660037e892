"""The keys' side of transfers with other daemons (``transfers.PeerTransfers``).

Where the bytes of an incoming transfer go (``arrival``): the blocks of the oldest get
that waits for their key and fits them, else new pool memory, GPU staging first for NCCL
arrivals; what happens when they are in (``arrived``: a waiting get is answered, pool bytes
become the key) or not (``arrival_failed``); and what a peer may read (``readable``,
``source_blocks``). The engine keeps the keys; this is the interface the transfers use
to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvd.daemon.engine import Delivered, Engine, uncut, unfit
from kvd.daemon.store import Item, Waiter
from kvd.errors import (
    BadRequest,
    KvdError,
    LayoutMismatch,
    PoolExhausted,
)
from kvd.memory.pool import HostPool, PoolBlock
from kvd.memory.regions import (
    Layout,
    Region,
    describe_layout,
    packed_offsets,
    part_layout,
    part_of_blocks,
)
from kvd.protocol import ALL, Offer, Share
from kvd.transport.chunks import BlockSet


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
    first: int = 0  # the key's block the bytes begin with (Offer.first)

    @property
    def device(self) -> torch.device:
        """Where the bytes land (the first tensor's device)."""
        return self.blocks.tensors[0].device

    def wire_views(self) -> list[memoryview]:
        """The destination as memoryviews, for a socket (host memory only)."""
        return self.blocks.views()



class NeverFits(PoolExhausted):
    """An offer larger than the whole pool, which no get waits for: refused, not BUSY."""


class Arrivals:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def place(self, offer: Offer, into: tuple[Region, BlockSet] | None,
              channel_gpu: str | None) -> Arrival:
        """Where ``offer``'s bytes go: ``into`` (a pull's region and blocks), else as
        ``arrival`` finds (GPU staging next to ``channel_gpu``, the channel an eager
        offer's bytes are queued on, or the emptiest for GPU bytes)."""
        if into is not None:
            return self.arrival_into(offer.key, *into)
        layout, capacity = tuple(offer.layout), self.engine.pool.capacity_bytes
        if (offer.nbytes > capacity and not offer.src_gpu
                and not self.get_waits_for(offer.key, layout, offer.num_blocks, offer.first)):
            # No room for it, ever: unless a get waits for it (its blocks are the room),
            # or GPU staging may take it.
            raise NeverFits(f"offer of {offer.nbytes} bytes exceeds the whole pool "
                            f"({capacity} bytes)")
        pools = self.engine.gpu_pools
        staging = channel_gpu or (max(pools, key=lambda d: pools[d].largest_free_bytes)
                                  if offer.src_gpu and pools else None)
        return self.arrival(offer.key, layout, offer.num_blocks, offer.ttl_s, gpu=staging,
                            first=offer.first)

    def land(self, arrival: Arrival, data: bytes | memoryview) -> None:
        """Bytes that came in their offer, copied into place (host memory, on the loop)."""
        at = 0
        for view in arrival.wire_views():
            view[:] = data[at:at + len(view)]
            at += len(view)
        self.arrived(arrival, len(data))

    def arrival(self, key: str, layout: Layout, num_blocks: int, ttl_s: float | None,
                gpu: str | None = None, first: int = 0) -> Arrival:
        """Where bytes for ``key`` from a peer go (its blocks from ``first`` on): the
        blocks of the oldest fitting get that waits for just those, else new pool memory
        — GPU staging on ``gpu`` first when the bytes come over NCCL, then the host pool
        (``PoolExhausted`` if none: the sender is told BUSY). Gets that wait for them but
        cannot take them fail with the reason."""
        self.engine.check_accepting()
        if self.engine.leases.released(key):  # its reader will not come for it
            raise self.engine.store.missing(key, f" on {self.engine.config.node_id}")
        if self.engine.store.exists(key):
            raise BadRequest(f"key {key!r} already exists on {self.engine.config.node_id}")
        config = self.engine.config
        expires_at = self.engine.ttl_deadline(ttl_s if ttl_s is not None else config.put_ttl_s)
        # A get that takes the key from ``first`` on, whole blocks, takes these bytes as
        # they are (the vLLM connector's decode, past its prefix hit).
        takes = Share(skip=first)
        while (waiter := self.engine.store.next_waiter(key, takes)) is not None:
            problem = unfit(key, layout, num_blocks, waiter.region, waiter.idx, takes, first)
            if problem is None:
                waiter.delivering = True
                return Arrival(key, layout, num_blocks, expires_at, waiter.blocks,
                               waiter=waiter, first=first)
            waiter.settle(problem)
        _, packed = packed_offsets(layout, num_blocks)
        pool, block = self._staging_for(max(packed, 1), gpu)
        self.engine.store.reserve(key)
        blocks = BlockSet.packed(pool.view(block), layout, num_blocks)
        return Arrival(key, layout, num_blocks, expires_at, blocks, pool_block=block,
                       pool=pool, first=first)

    def get_waits_for(self, key: str, layout: Layout, num_blocks: int, first: int = 0
                      ) -> bool:
        """Whether a get waits for ``key`` in blocks that fit ``num_blocks`` of ``layout``
        (its blocks from ``first`` on): ``arrival`` puts such bytes there, whatever room
        the pools have."""
        takes = Share(skip=first)
        return any(unfit(key, layout, num_blocks, w.region, w.idx, takes, first) is None
                   for w in self.engine.store.waiters(key, takes))

    def _staging_for(self, nbytes: int, gpu: str | None) -> tuple[HostPool, PoolBlock]:
        """GPU staging on ``gpu`` if it has room, else the host pool (spill)."""
        gpu_pool = self.engine.gpu_pools.get(gpu) if gpu is not None else None
        if gpu_pool is not None:
            try:
                return gpu_pool, gpu_pool.alloc(nbytes)
            except PoolExhausted:
                self.engine.counters.gpu_spills += 1
        return self.engine.pool, self.engine.pool.alloc(nbytes)

    def arrival_into(self, key: str, region: Region, blocks: BlockSet) -> Arrival:
        """Bytes a pull asked for go straight into the puller's blocks."""
        return Arrival(key, region.layout, len(blocks.ids), None, blocks, region=region)

    def arrived(self, arrival: Arrival, nbytes: int) -> None:
        self.engine.counters.bytes_in += nbytes
        if arrival.waiter is not None:
            if not arrival.waiter.future.done():
                arrival.waiter.settle(Delivered(nbytes))
        elif arrival.pool_block is not None:
            _, packed = packed_offsets(arrival.layout, arrival.num_blocks)
            self.engine.add_item(Item(
                key=arrival.key, layout=arrival.layout, num_blocks=arrival.num_blocks,
                nbytes=packed, owner=None, expires_at=arrival.expires_at, consume_once=True,
                pool_block=arrival.pool_block, pool=arrival.pool,
                on_free=self.engine.free_pool_item, first=arrival.first))

    def arrival_failed(self, arrival: Arrival, error: KvdError) -> None:
        if arrival.waiter is not None:
            if not arrival.waiter.future.done():
                arrival.waiter.settle(error)
        elif arrival.pool_block is not None:
            self.engine.store.unreserve(arrival.key)
            (arrival.pool or self.engine.pool).free(arrival.pool_block)
            arrival.pool_block = None

    def source_blocks(self, item: Item, share: Share = ALL) -> BlockSet:
        """``share`` of the bytes of a stored or published item, wire order (the caller
        holds a read)."""
        share = item.held(share)
        if share == ALL and item.blocks is not None:
            return item.blocks
        if item.region is not None:
            assert item.region_idx is not None
            return BlockSet(item.region.part(share.part).tensors,
                            item.region_idx[share.skip:].numpy())
        assert item.pool_block is not None
        pool = item.pool or self.engine.pool
        packed = BlockSet.packed(pool.view(item.pool_block), item.layout, item.num_blocks)
        if share == ALL:
            return packed
        tensors, _ = part_of_blocks(packed.tensors, item.layout, share.part,
                                    f"key {item.key!r}")
        return BlockSet(tensors, packed.ids[share.skip:])

    def readable(self, key: str, layout: Layout, num_blocks: int, share: Share = ALL,
                 ) -> Item:
        """Claim a read of ``share`` of ``key`` for a peer that pulls it into blocks of
        ``layout``."""
        item = self.engine.store.find(key)
        if item is None:
            raise self.engine.store.missing(key, f" on {self.engine.config.node_id}")
        if share.skip < item.first or share.skip >= item.first + item.num_blocks:
            raise BadRequest(f"key {key!r} holds its blocks from {item.first} to "
                             f"{item.first + item.num_blocks}: a read cannot skip "
                             f"{share.skip} of them")
        taken = part_layout(item.layout, share.part)
        if taken != layout:
            cut = f", cut in {share.part.count}," if share.part.count > 1 else ""
            raise LayoutMismatch(
                f"key {key!r}{cut} has layout {describe_layout(taken or item.layout)}, the "
                f"puller's region has {describe_layout(layout)}")
        if item.first + item.num_blocks - share.skip != num_blocks:
            raise BadRequest(f"key {key!r} holds {item.num_blocks} blocks, "
                             f"{num_blocks} asked for (after {share.skip} skipped)")
        if problem := uncut(item, share):
            raise problem
        self.engine.claim(item, share)
        return item

