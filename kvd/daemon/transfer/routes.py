"""Routes: the one interface transfers move bytes through, over TCP or over NCCL.

A route is one direction of one channel to a peer: our data connection (``TcpSendRoute``,
``TcpReceiveRoute``, over ``transport.tcp``) or an NCCL channel (``NcclRoute``, over
``transport.nccl_channel``). ``send`` and ``receive`` queue a transfer's job on the route's
worker thread, in call order — the order the peer queues the matching jobs — and return
it as a ``Moving``: its future, and what the transfer code may ask of it whatever the
transport (``halt``, ``discard``, ``confirmed``). ``Routes`` picks the route for a
transfer: the ACCEPT's choice for a send, the destination's memory for a receive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvd.daemon.busy_poll import BusyPoll
from kvd.daemon.peer_link import CPU_DEVICE, PeerLink
from kvd.daemon.transfer.arrivals import Arrival
from kvd.daemon.transfer.nccl_links import NcclLinks
from kvd.errors import BadRequest, ProtocolError
from kvd.memory.regions import Layout, Region
from kvd.protocol import Accept, Offer
from kvd.transport.chunks import BlockSet
from kvd.transport.nccl_channel import NcclChannel
from kvd.transport.nccl_job import NcclJob
from kvd.transport.tcp import RecvChannel, RecvJob, SendChannel, SendJob
from kvd.transport.views import wire_bytes


@dataclass(eq=False)
class Source:
    """The memory a send reads: blocks in wire order, on the host or a GPU (None: zeros,
    for a receiver whose sender gave up)."""

    blocks: BlockSet | None
    layout: Layout
    num_blocks: int
    regions: Sequence[Region] = ()  # the client regions read (their writes go first)
    gpu: str | None = field(init=False)  # the GPU the blocks are on ("cuda:N"), or None
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        # Found once: read several times per transfer, and str(device) is not free.
        device = self.blocks.tensors[0].device if self.blocks is not None else None
        self.gpu = str(device) if device is not None and device.type == "cuda" else None
        self.nbytes = wire_bytes(self.layout, self.num_blocks)


class Moving(Protocol):
    """One transfer's job on a route."""

    transport: str  # "tcp" or "nccl", for metrics

    @property
    def future(self) -> concurrent.futures.Future[int]:
        """Settles with the bytes moved once the job is over (no byte moves after)."""

    @property
    def started_at(self) -> float:
        """time.monotonic() of its start; 0 if it has not started."""

    def halt(self) -> bool:
        """Sender: stop where the transport can. True if the job never started (nothing
        went); else it ends soon (TCP: at the next chunk) or runs to its end (NCCL: the
        receiver waits for it, and a channel cannot stop half way)."""

    def discard(self) -> None:
        """Receiver: nobody wants the bytes any more; they are dropped as they come."""

    def confirmed(self) -> None:
        """Sender: the receiver answered; the channel may be evicted again."""


class _Job(Protocol):
    future: concurrent.futures.Future[int]
    started_at: float


@dataclass(eq=False)
class _OnRoute:
    """A transport's job as a ``Moving``: by default it neither stops nor drops."""

    job: _Job
    transport: str

    @property
    def future(self) -> concurrent.futures.Future[int]:
        return self.job.future

    @property
    def started_at(self) -> float:
        return self.job.started_at

    def halt(self) -> bool:
        return False

    def discard(self) -> None:
        pass

    def confirmed(self) -> None:
        pass


@dataclass(eq=False)
class _TcpSending(_OnRoute):
    job: SendJob
    transport: str = "tcp"

    def halt(self) -> bool:
        if self.job.future.cancel():
            return True
        self.job.stop.set()  # a CANCELLED chunk ends it at the next chunk
        return False


@dataclass(eq=False)
class _TcpReceiving(_OnRoute):
    job: RecvJob
    channel: RecvChannel | None = None
    transport: str = "tcp"

    def discard(self) -> None:
        if self.channel is not None:
            self.channel.forget(self.job.transfer_id)


@dataclass(eq=False)
class _NcclMoving(_OnRoute):
    job: NcclJob
    until_confirmed: Callable[[], None] | None = None
    transport: str = "nccl"

    def discard(self) -> None:
        # Not started: it receives into staging only; started: it finishes.
        self.job.abandoned = True

    def confirmed(self) -> None:
        if self.until_confirmed is not None:
            self.until_confirmed()


class SendRoute(Protocol):
    channel_id: int  # an NCCL channel's id; 0 for TCP

    def send(self, tid: int, source: Source, deadline: float, eager: bool = False) -> Moving:
        """Queue the bytes of ``source`` (``deadline``: loop time; ``eager``: with the
        offer, before any answer)."""


class ReceiveRoute(Protocol):
    channel_id: int

    def receive(self, offer: Offer, arrival: Arrival | None) -> Moving:
        """Queue the receive of ``offer``'s bytes into ``arrival`` (None: dropped)."""


@dataclass(eq=False)
class TcpSendRoute:
    channel: SendChannel
    busy_poll: BusyPoll
    channel_id: int = 0

    def send(self, tid: int, source: Source, deadline: float, eager: bool = False) -> Moving:
        assert source.blocks is not None
        job = SendJob(tid, source.blocks.views(), eager=eager)
        self.busy_poll.thread_work(self.channel.submit(job))  # its thread sends it
        return _TcpSending(job)


@dataclass(eq=False)
class TcpReceiveRoute:
    channel: RecvChannel
    busy_poll: BusyPoll
    channel_id: int = 0

    def receive(self, offer: Offer, arrival: Arrival | None) -> Moving:
        if arrival is None:  # an eager transfer's bytes we did not accept
            self.channel.drop(offer.transfer_id, offer.nbytes)
            job = RecvJob(offer.transfer_id, [], offer.nbytes, abandoned=True)
            job.future.cancel()  # (nothing waits for it: the channel reads and drops)
            return _TcpReceiving(job)
        job = RecvJob(offer.transfer_id, arrival.wire_views(), offer.nbytes, eager=offer.eager)
        self.busy_poll.thread_work(self.channel.expect(job))  # its thread receives it
        return _TcpReceiving(job, channel=self.channel)


@dataclass(eq=False)
class NcclRoute:
    channel: NcclChannel
    channel_id: int
    chunk_bytes: int  # as the ACCEPT says: both ends cut the bytes alike
    busy_poll: BusyPoll
    receive_timeout: Callable[[int], float]
    loop: asyncio.AbstractEventLoop
    unique_id: bytes = b""

    def send(self, tid: int, source: Source, deadline: float, eager: bool = False) -> Moving:
        """Queued now, in message order: the receiver queued its side in the same order.
        Kept from eviction until the receiver answers (``NcclChannel.until_confirmed``)."""
        job = NcclJob(tid, source.blocks, source.layout, source.num_blocks,
                      time.monotonic() + max(0.0, deadline - self.loop.time()),
                      source.nbytes, self.chunk_bytes,
                      ready_events=[e for r in source.regions for e in r.ready_events])
        self._submit(job)
        confirmed = self.channel.until_confirmed()
        if source.blocks is not None:  # the send ends when the receiver has answered
            return _NcclMoving(job, until_confirmed=confirmed)
        loop = self.loop  # zeros for a receiver that gave up: no confirmation comes

        def sent(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone at shutdown
                loop.call_soon_threadsafe(confirmed)

        job.future.add_done_callback(sent)
        return _NcclMoving(job)

    def receive(self, offer: Offer, arrival: Arrival | None) -> Moving:
        """Into the arrival's blocks, or, with None (an eager offer we decline), into
        staging and dropped, so that the channel's two ends stay in step."""
        job = NcclJob(offer.transfer_id, arrival.blocks if arrival is not None else None,
                      tuple(offer.layout), offer.num_blocks,
                      time.monotonic() + self.receive_timeout(offer.nbytes), offer.nbytes,
                      self.chunk_bytes, abandoned=arrival is None)
        self._submit(job)
        return _NcclMoving(job)

    def _submit(self, job: NcclJob) -> None:
        self.channel.submit(job)
        self.busy_poll.thread_work(job.future)  # its channel's worker runs it


class Routes:
    """Which route a transfer takes."""

    def __init__(self, nccl: NcclLinks | None, busy_poll: BusyPoll, nccl_chunk_bytes: int,
                 peer_grace_s: float, gpus: list[str], node_id: str) -> None:
        self.nccl = nccl
        self.node_id = node_id  # None: this daemon moves bytes over TCP only
        self.busy_poll = busy_poll
        self.nccl_chunk_bytes = nccl_chunk_bytes
        self.peer_grace_s = peer_grace_s
        self.gpus = gpus
        self.loop = asyncio.get_running_loop()

    def check_gpu(self, link: PeerLink, source: Source) -> None:
        """GPU blocks leave only over NCCL: BadRequest if it is missing here or there."""
        if source.gpu is None:
            return
        if self.nccl is None:
            raise BadRequest(f"blocks on {source.gpu} need NCCL to leave this daemon, and "
                             f"{self.node_id} runs without it")
        if not any(d.startswith("cuda") for d in link.devices):
            raise BadRequest(f"blocks on {source.gpu} cannot go to {link.address}: it has "
                             "no GPU with NCCL (GPU memory does not go over TCP)")

    def receive_timeout(self, nbytes: int) -> float:
        """How long a receive may take once queued: the peer's grace (it may be slow to
        start) plus the bytes at a pessimistic 1 GB/s."""
        return max(10.0, 2 * self.peer_grace_s) + nbytes / 1e9

    def tcp_send(self, channel: SendChannel) -> TcpSendRoute:
        return TcpSendRoute(channel, self.busy_poll)

    def _nccl(self, channel: NcclChannel, channel_id: int, chunk_bytes: int,
              unique_id: bytes = b"") -> NcclRoute:
        return NcclRoute(channel, channel_id, chunk_bytes, self.busy_poll,
                         self.receive_timeout, self.loop, unique_id)

    def eager_send(self, link: PeerLink, src_dev: str) -> NcclRoute | None:
        """The NCCL channel to queue a GPU send on together with its OFFER, if one is live."""
        entry = self.nccl.for_eager_send(link, src_dev) if self.nccl is not None else None
        if entry is None:
            return None
        return self._nccl(entry.channel, entry.channel_id, self.nccl_chunk_bytes)

    def accepted_send(self, link: PeerLink, src_dev: str, accept: Accept,
                      tcp: TcpSendRoute | None) -> SendRoute:
        """The route an ACCEPT chose: our data connection ``tcp``, or the NCCL channel it
        names (made or joined now)."""
        if accept.channel == 0:
            if tcp is None:
                raise ProtocolError(f"{link.address} accepted over TCP, which this transfer "
                                    "did not offer")
            return tcp
        if self.nccl is None:
            raise ProtocolError("accepted over NCCL, which this transfer did not offer")
        if accept.chunk_bytes <= 0:
            raise ProtocolError("an NCCL accept must say its chunk size")
        entry = self.nccl.for_send(link, src_dev, accept.dst_dev, accept.channel,
                                   accept.nccl_uid)
        return self._nccl(entry.channel, entry.channel_id, accept.chunk_bytes)

    def eager_receive(self, link: PeerLink, offer: Offer) -> NcclRoute | None:
        """The live receive channel an eager OFFER's bytes are queued on, if we have it."""
        entry = (self.nccl.for_eager_receive(link, offer.channel, offer.src_dev)
                 if self.nccl is not None else None)
        if entry is None:
            return None
        return self._nccl(entry.channel, entry.channel_id, offer.chunk_bytes)

    def drop_eager(self, link: PeerLink, offer: Offer) -> None:
        """Read the bytes of an eager offer we declined into nothing (NCCL: into staging),
        so that both ends of its route stay in step."""
        route: ReceiveRoute | None
        if offer.channel:
            route = self.eager_receive(link, offer)
        else:
            channel = link.recv_channel
            route = TcpReceiveRoute(channel, self.busy_poll) if channel is not None else None
        if route is not None:
            route.receive(offer, None)

    def send_zeros(self, link: PeerLink, src_dev: str, layout: Layout, num_blocks: int,
                   accept: Accept) -> None:
        """Zeros on the channel an ACCEPT names, for an NCCL offer given up: its receiver
        waits there for bytes."""
        self.accepted_send(link, src_dev, accept, None).send(
            accept.transfer_id, Source(None, layout, num_blocks),
            self.loop.time() + self.receive_timeout(0))

    def for_receive(self, link: PeerLink, offer: Offer, arrival: Arrival,
                    eager: NcclRoute | None = None) -> tuple[ReceiveRoute, Accept]:
        """The route a receive takes, and the ACCEPT that tells the sender: NCCL when GPU
        memory is on either end (and both have it), TCP otherwise; the eager offer's
        channel if it named one."""
        tid = offer.transfer_id
        if eager is not None:
            return eager, Accept(transfer_id=tid, dst_dev=str(eager.channel.device),
                                 channel=eager.channel_id, chunk_bytes=eager.chunk_bytes)
        dest = arrival.device
        if not (offer.src_gpu or dest.type == "cuda"):
            assert link.recv_channel is not None
            return TcpReceiveRoute(link.recv_channel, self.busy_poll), Accept(transfer_id=tid)
        if self.nccl is None or offer.src_dev == CPU_DEVICE:
            raise BadRequest(f"the destination blocks are on {dest}, and {link.address} has "
                             "no NCCL to send there (GPU memory does not go over TCP)")
        local_dev = str(dest) if dest.type == "cuda" else self.gpus[0]
        entry = self.nccl.for_receive(link, local_dev, offer.src_dev)
        chunk = self._chunk_bytes(offer, arrival)
        route = self._nccl(entry.channel, entry.channel_id, chunk, entry.unique_id)
        return route, Accept(transfer_id=tid, dst_dev=local_dev, channel=entry.channel_id,
                             nccl_uid=entry.unique_id, chunk_bytes=chunk)

    def _chunk_bytes(self, offer: Offer, arrival: Arrival) -> int:
        """``nccl_chunk_bytes``, or, when both ends hold each tensor's blocks as one run
        at least that large, one message per tensor: no staging, fewest messages."""
        configured = self.nccl_chunk_bytes
        run = max(e.bytes_per_block for e in offer.layout) * offer.num_blocks
        if (offer.one_run and run >= configured and arrival.device.type == "cuda"
                and arrival.blocks.one_run()
                and all(e.bytes_per_block * offer.num_blocks == run for e in offer.layout)):
            return run
        return configured
