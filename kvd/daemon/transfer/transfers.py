"""Transfers between daemons: the OFFER / ACCEPT | BUSY | REFUSE / DONE | FAILED machine.

Sender: ``push`` offers the bytes (key, layout, block count, size). The receiver picks the
destination (``Engine.arrival``: a waiting get's blocks, else pool memory, else BUSY),
registers a receive job for the transfer id on its channel, and ACCEPTs. The sender then
queues the bytes on its send channel; the receiver answers XFER_DONE once they are in place
(or XFER_FAILED). BUSY makes the sender retry with backoff until its deadline, then fail
with ``PoolExhausted``.

Eager sends skip the wait for the ACCEPT: host memory goes right behind its first offer on
the TCP data connection; GPU memory, when an NCCL channel to the peer already exists
(``nccl_eager``), is queued on it as the OFFER (naming the channel) goes out, and the
receiver queues the matching receive when the OFFER arrives whatever it answers — into the
destination if it ACCEPTs, into staging and dropped if not. ``_eager_nccl_entry`` says when
that keeps both ends of a channel in step.

Pull: the puller sends PULL_REQUEST with a transfer id; the owner claims a read of the key
and pushes it with that id; the puller recognises its id and takes the bytes into the
blocks it asked for. The pulls an owner serves at once are bounded, per peer and for all
(``MAX_PULLS_SERVED_PER_LINK``): past that it refuses with the retriable PoolExhausted.

Every log line carries the transfer id and key. A lost link fails every transfer with that
peer (``PeerUnreachable``); late bytes never land in memory that was given back: cancelled
receive jobs are discarded by the channel, and a cancelled send waits for its bytes. A
cancel never contradicts the receiver: a push cancelled once all its bytes went reports
what the receiver answers to its XFER_CANCEL (``_verdict``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from kvd import timeline
from kvd.daemon.accepting import Throttled
from kvd.daemon.engine import Engine
from kvd.daemon.futures import on_loop, wait_out
from kvd.daemon.peer_link import CPU_DEVICE, PeerLink
from kvd.daemon.peers import PeerPlane
from kvd.daemon.transfer.arrivals import Arrival, Arrivals
from kvd.daemon.transfer.nccl_links import NcclLinks
from kvd.daemon.transfer.waiting_pulls import WaitingPull, WaitingPulls
from kvd.errors import (
    BadRequest,
    Cancelled,
    KvdError,
    KvdTimeout,
    PoolExhausted,
    ProtocolError,
    TransferFailed,
    UnknownKey,
    error_from_code,
)
from kvd.memory.regions import Layout, Region
from kvd.protocol import (
    Accept,
    Busy,
    ChannelDown,
    ChannelWarm,
    Offer,
    PeerMessage,
    PullRequest,
    Refuse,
    XferCancel,
    XferDone,
    XferFailed,
)
from kvd.transport.chunks import BlockSet
from kvd.transport.nccl_channel import NcclChannel
from kvd.transport.nccl_job import NcclJob
from kvd.transport.tcp import RecvJob, SendChannel, SendJob
from kvd.transport.views import wire_bytes

log = logging.getLogger(__name__)

BUSY_RETRY_S = 0.05
MAX_BACKOFF_S = 1.0
MIN_NCCL_CHUNK_BYTES, MAX_NCCL_CHUNK_BYTES = 2**20, 2**31  # an eager offer's, checked
# Pulls of one peer served at once (each a task pushing its key, holding a read of it until
# the push ends, up to max_wait_s; ~15 KiB): past it the peer's next pull is refused with
# the retriable PoolExhausted. As many as max_waiting_pulls by default, and never fewer
# than it: the pulls waiting here for their keys are served together when the keys appear.
MAX_PULLS_SERVED_PER_LINK = 4096
# And all peers' together, in links at their most (~250 MiB): links are bounded too
# (MAX_LINKS), but 256 at their most would hold gigabytes.
_LINKS_AT_THEIR_MOST = 4


@dataclass(eq=False)
class _Source:
    """The memory a transfer reads: blocks in wire order, on the host or a GPU."""

    blocks: BlockSet
    gpu: str | None = field(init=False)  # the GPU the blocks are on ("cuda:N"), or None

    def __post_init__(self) -> None:
        # Found once: read several times per transfer, and str(device) is not free.
        device = self.blocks.tensors[0].device
        self.gpu = str(device) if device.type == "cuda" else None

    def views(self) -> list[memoryview]:
        return self.blocks.views()


@dataclass(eq=False)
class _Outgoing:
    transfer_id: int
    key: str
    link: PeerLink
    source: _Source
    layout: Layout
    num_blocks: int
    deadline: float  # loop time
    nbytes: int = 0
    src_dev: str = CPU_DEVICE  # our end of an NCCL channel ("cpu": none)
    one_run: bool = False  # told in the offer: see Offer.one_run
    regions: Sequence[Region] = ()  # the client regions read (held while a send runs)
    tcp_channel: SendChannel | None = None  # our data connection, if TCP may be chosen
    nccl_job: NcclJob | None = None  # set when an ACCEPT chose NCCL
    tcp_job: SendJob | None = None  # or TCP
    eager_job: SendJob | None = None  # bytes sent with the first offer (TCP only)
    eager_answered: bool = False
    eager_channel: int = 0  # the NCCL channel nccl_job was queued on with the offer
    no_eager: bool = False  # after a BUSY: offer again without sending first
    offer_pending: bool = False  # an offer is out and not answered yet
    accepted: bool = False  # the receiver ACCEPTed an offer: it waits for the bytes
    replies: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


@dataclass(eq=False)
class _Incoming:
    transfer_id: int
    key: str
    link: PeerLink
    arrival: Arrival
    job: RecvJob | NcclJob

    @property
    def transport(self) -> str:
        return "nccl" if isinstance(self.job, NcclJob) else "tcp"

    @property
    def regions(self) -> list[Region]:
        """The client regions the bytes land in (a pull's, or a waiting get's)."""
        waiter = self.arrival.waiter
        return [r for r in (self.arrival.region, waiter.region if waiter else None)
                if r is not None]


@dataclass(eq=False)
class _PullWait:
    key: str
    region: Region
    idx: torch.Tensor
    future: asyncio.Future[int]
    blocks: BlockSet  # the destination, prepared while the request is out
    offered: bool = False  # the owner's OFFER came: bytes are (about to be) on their way
    link: PeerLink | None = None  # where the request went: only that peer answers it


@dataclass
class TransferCounters:
    sent: dict[str, int] = field(default_factory=dict)  # outcome -> count
    received: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    busy_replies: int = 0
    eager_nccl_sent: int = 0  # sends queued on an NCCL channel with their offer
    eager_nccl_dropped: int = 0  # such offers we did not accept: received, dropped

    def count(self, table: dict[str, int], outcome: str) -> None:
        table[outcome] = table.get(outcome, 0) + 1


class PeerTransfers:
    def __init__(self, engine: Engine, plane: PeerPlane, nccl: NcclLinks | None = None
                 ) -> None:
        self.engine = engine
        self.arrivals = Arrivals(engine)  # where incoming bytes go, what peers may read
        self.plane = plane
        self.nccl = nccl  # None: this daemon moves bytes over TCP only
        # Offers that went out for NCCL and were given up before their answer: an ACCEPT
        # may still come, and the receiver then waits for the bytes (id -> layout, blocks).
        self._abandoned: dict[int, tuple[PeerLink, Layout, int, str]] = {}
        self.counters = TransferCounters()
        self._outgoing: dict[int, _Outgoing] = {}
        # Pulls we serve, from their request on: (id(link), transfer id). Their _push
        # enters _outgoing only once its task runs, and requests that came in one read
        # are all handled before that.
        self._serving: set[tuple[int, int]] = set()
        self._incoming: dict[tuple[int, int], _Incoming] = {}  # (id(link), transfer id)
        self._pulls: dict[int, _PullWait] = {}
        # Per outgoing transfer, its NCCL sends' channels, kept from eviction until the
        # receiver answers (NcclChannel.until_confirmed).
        self._unconfirmed: dict[int, list[Callable[[], None]]] = {}
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        # Peers' pulls of keys we do not hold yet, held until they appear (or time out).
        self._waiting_pulls = WaitingPulls(self._loop, engine.config.max_waiting_pulls,
                                           self._waited_in_vain)
        # Peers' pulls being served, per link and in all (see MAX_PULLS_SERVED_PER_LINK).
        self._served: dict[PeerLink, int] = {}
        self._served_all = 0
        self._max_served = max(MAX_PULLS_SERVED_PER_LINK, engine.config.max_waiting_pulls)
        self._max_served_all = _LINKS_AT_THEIR_MOST * self._max_served
        self._refusing_pulls = Throttled(log)
        engine.key_listeners.append(self._key_appeared)

    @property
    def address(self) -> str:
        return self.plane.address

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------ sending

    async def push_blocks(self, key: str, region: Region, idx: torch.Tensor, to: str,
                          ttl_s: float | None, timeout_s: float) -> int:
        """A client's put to another daemon."""
        deadline = self._loop.time() + timeout_s
        link = await self.plane.link_to(to, timeout_s)
        source = _Source(BlockSet(region.tensors, idx.numpy()))
        return await self._push(link, _new_id(), key, source, region.layout, len(idx), ttl_s,
                                deadline, [region])

    def _check_gpu_route(self, link: PeerLink, source: _Source) -> None:
        if source.gpu is None:
            return
        if self.nccl is None:
            raise BadRequest(f"blocks on {source.gpu} need NCCL to leave this daemon, and "
                             f"{self.engine.config.node_id} runs without it")
        if not any(d.startswith("cuda") for d in link.devices):
            raise BadRequest(f"blocks on {source.gpu} cannot go to {link.address}: it has "
                             "no GPU with NCCL (GPU memory does not go over TCP)")

    async def _push(self, link: PeerLink, tid: int, key: str, source: _Source,
                    layout: Layout, num_blocks: int, ttl_s: float | None, deadline: float,
                    regions: Sequence[Region]) -> int:
        nbytes = wire_bytes(layout, num_blocks)
        self._check_gpu_route(link, source)
        src_dev = CPU_DEVICE
        if self.nccl is not None and any(d.startswith("cuda") for d in link.devices):
            src_dev = source.gpu or self.plane.gpus[0]
        out = _Outgoing(tid, key, link, source, layout, num_blocks, deadline, nbytes, src_dev,
                        one_run=source.gpu is not None and source.blocks.one_run(),
                        regions=regions)
        self._outgoing[tid] = out
        outcome = "failed"
        requested = time.monotonic()
        job: SendJob | NcclJob | None = None
        try:
            if source.gpu is None:  # TCP may be chosen
                async with asyncio.timeout_at(deadline):
                    out.tcp_channel = await self.plane.send_channel(link)
            await self._offer_until_accepted(out, layout, num_blocks, nbytes, ttl_s, deadline)
            job = out.nccl_job or out.tcp_job  # started when the ACCEPT came (_on_accept)
            if job is None:
                raise ProtocolError(f"{link.address} accepted, but no transport started")
            afut = on_loop(job.future)
            # the regions are held since the job was queued (_send_started)
            try:
                await asyncio.shield(afut)
                timeline.mark("transfer.sent")
            except asyncio.CancelledError:
                if isinstance(job, SendJob) and job.future.cancel():
                    raise  # not started: nothing was sent
                # On the wire: stop at the next chunk (TCP; an NCCL transfer runs to
                # its end, the receiver waits for it), and wait so that no byte is
                # read from the client's blocks after we answer.
                if isinstance(job, SendJob):
                    job.stop.set()
                await wait_out(afut, 60.0)
                if not afut.done() or afut.cancelled() or afut.exception() is not None:
                    raise asyncio.CancelledError from None
                # Every byte had gone out before the stop was seen: the transfer
                # completes, and its result, not a cancellation, is the truth.
                _uncancel()
            reply = await self._reply(out, deadline, "the receiver's confirmation")
            if isinstance(reply, XferFailed):
                raise error_from_code(reply.code, f"receiver {link.address}: {reply.message}")
            if not isinstance(reply, XferDone):
                raise ProtocolError(f"unexpected {type(reply).__name__} after the bytes")
            outcome = "done"
            self.counters.bytes_sent += nbytes
            log.debug("transfer done transfer_id=%d key=%s to=%s bytes=%d", tid, key,
                      link.address, nbytes)
            return nbytes
        except asyncio.CancelledError:
            outcome = "cancelled"
            self._give_up(out)
            await self._wait_started(out)
            if not self._may_have_arrived(out):
                raise
            # Every byte may have reached the receiver, which keeps them unless our
            # XFER_CANCEL came first: its answer, not the cancel, says what happened.
            kept = await self._verdict(out)
            if kept is False:
                raise
            _uncancel()
            if kept is None:
                raise TransferFailed(
                    f"transfer {tid} of key {key!r} was cancelled after its bytes went, and "
                    f"{link.address} did not say whether it kept them") from None
            outcome = "done"
            self.counters.bytes_sent += nbytes
            log.info("transfer done though cancelled (the receiver had every byte) "
                     "transfer_id=%d key=%s to=%s bytes=%d", tid, key, link.address, nbytes)
            return nbytes
        except TimeoutError:
            outcome = "timeout"
            self._give_up(out)
            await self._wait_started(out)
            raise KvdTimeout(f"transfer {tid} of key {key!r} to {link.address} missed its "
                             "deadline") from None
        except KvdError as exc:
            log.info("transfer failed transfer_id=%d key=%s to=%s: [%s] %s", tid, key,
                     link.address, exc.code, exc.message)
            await self._wait_started(out)
            raise
        finally:
            self.counters.count(self.counters.sent, outcome)
            if self._outgoing.get(tid) is out:
                del self._outgoing[tid]
            for confirmed in self._unconfirmed.pop(tid, ()):
                confirmed()
            if out.offer_pending and out.src_dev != CPU_DEVICE and not out.eager_channel:
                self._remember_abandoned(out)
            started = job.started_at if job is not None and job.started_at else None
            self.engine.metrics.transfer(
                peer=link.address, direction="send",
                transport="nccl" if out.nccl_job is not None else "tcp", outcome=outcome,
                nbytes=nbytes, queue_s=None if started is None else started - requested,
                wire_s=None if started is None else time.monotonic() - started)

    async def _offer_until_accepted(self, out: _Outgoing, layout: Layout, num_blocks: int,
                                    nbytes: int, ttl_s: float | None, deadline: float) -> None:
        backoff = BUSY_RETRY_S
        offer = Offer(transfer_id=out.transfer_id, key=out.key, src_dev=out.src_dev,
                      dst_dev="any", nbytes=nbytes, num_blocks=num_blocks,
                      layout=list(layout), ttl_s=ttl_s, src_gpu=out.source.gpu is not None,
                      one_run=out.one_run)
        # Host memory to a peer that will take it over TCP anyway: the bytes go right
        # behind the first offer, and the ACCEPT round trip leaves the critical path.
        eager = out.tcp_channel is not None and out.src_dev == CPU_DEVICE
        while True:
            out.offer_pending = True
            entry = None if eager else self._eager_nccl_entry(out)
            if entry is not None:
                # Queued now, in OFFER order: the receiver queues its side when the OFFER
                # arrives, whatever it answers (see _eager_nccl_entry for why the orders match).
                chunk = self.engine.config.nccl_chunk_bytes
                self.plane.send(out.link, msgspec.structs.replace(
                    offer, dst_dev=entry.key[2], channel=entry.channel_id, chunk_bytes=chunk))
                out.eager_channel = entry.channel_id
                self.counters.eager_nccl_sent += 1
                out.nccl_job = self._queue_nccl_send(
                    entry.channel, out.transfer_id, out.source.blocks, layout, num_blocks,
                    out.deadline, chunk, [e for r in out.regions for e in r.ready_events])
                self._send_started(out, out.nccl_job.future)
            elif eager:
                self.plane.send(out.link, msgspec.structs.replace(offer, eager=True))
                assert out.tcp_channel is not None
                out.eager_job = SendJob(out.transfer_id, out.source.views(), eager=True)
                self._send_started(out, self._tcp_send(out.tcp_channel, out.eager_job))
                eager = False  # a retry after BUSY waits for its ACCEPT
            else:
                self.plane.send(out.link, offer)
                if out.source.gpu is not None and not out.one_run:
                    # The copy kernel's map of the blocks to gather, made while the offer
                    # is out instead of after the ACCEPT (see Engine.get for the receiver).
                    out.source.blocks.block_map(out.source.blocks.tensors[0].device)
            reply = await self._reply(out, deadline, "an answer to the offer")
            if isinstance(reply, Accept):
                return
            if isinstance(reply, Refuse):
                raise error_from_code(reply.code, f"{out.link.address} refused: {reply.message}")
            if isinstance(reply, Busy):
                self.counters.busy_replies += 1
                if out.eager_channel:
                    # The receiver drops the bytes already queued; offer again, without
                    # sending first, once they are out (at once if it lacked the channel).
                    await self._eager_send_ended(out)
                    if reply.retry_after_s == 0:
                        continue
                wait = min(max(backoff, reply.retry_after_s), MAX_BACKOFF_S)
                if self._loop.time() + wait >= deadline:
                    raise PoolExhausted(
                        f"{out.link.address} had no room for {nbytes} bytes of key "
                        f"{out.key!r} before the deadline")
                log.debug("receiver busy transfer_id=%d key=%s retry_in=%.2fs",
                          out.transfer_id, out.key, wait)
                await asyncio.sleep(wait)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            raise ProtocolError(f"unexpected {type(reply).__name__} in answer to an offer")

    def _eager_nccl_entry(self, out: _Outgoing) -> Any:
        """The NCCL channel to queue this GPU send on together with its OFFER, or None.

        Both ends must run a channel's jobs in the same order. Plain offers queue at the
        ACCEPT (the receiver when it sends it, we when it arrives), eager ones at the OFFER
        (we when we send it, the receiver when it arrives). Mixed freely the orders can
        differ: an eager offer sent after ACCEPT 0 arrived, while the receiver had already
        accepted a plain offer 2 on the same channel, queues 0, 1, 2 here and 0, 2, 1 there.
        So: eager only when no plain NCCL offer to this peer is unanswered (nor one given
        up whose answer may still come). Then every plain job answered earlier is queued
        before ours on both ends, and every later one after it."""
        chunk = self.engine.config.nccl_chunk_bytes
        if (self.nccl is None or out.source.gpu is None or out.no_eager
                or not MIN_NCCL_CHUNK_BYTES <= chunk <= MAX_NCCL_CHUNK_BYTES):
            return None
        link = out.link
        if any(o is not out and o.link is link and o.offer_pending and not o.eager_channel
               and o.src_dev != CPU_DEVICE for o in self._outgoing.values()):
            return None
        if any(gone[0] is link for gone in self._abandoned.values()):
            return None
        return self.nccl.for_eager_send(link, out.src_dev)

    async def _eager_send_ended(self, out: _Outgoing) -> None:
        """Wait for a send the receiver will drop (it answered BUSY), then forget it."""
        job = out.nccl_job
        if job is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(on_loop(job.future)),
                                       max(1.0, out.deadline - self._loop.time()) + 1.0)
        out.nccl_job, out.eager_channel, out.no_eager = None, 0, True

    def _tcp_send(self, channel: SendChannel, job: SendJob) -> concurrent.futures.Future[int]:
        fut = channel.submit(job)
        self.engine.busy_poll.thread_work(fut)  # the data connection's thread sends it
        return fut

    def _send_started(self, out: _Outgoing, fut: concurrent.futures.Future[int]) -> None:
        """A send job now reads the client's regions: they stay mapped until it ends."""
        self.engine.copies.hold_regions(out.regions, _ended(fut))

    async def _wait_started(self, out: _Outgoing) -> None:
        """A send the ACCEPT started must end before the pusher answers: no byte may be
        read from the client's blocks after that. TCP stops at the next chunk; NCCL runs
        to its end (or its deadline)."""
        for job in (out.eager_job, out.tcp_job, out.nccl_job):
            if job is None or job.future.done():
                continue
            if isinstance(job, SendJob):
                if job.future.cancel():
                    continue
                job.stop.set()
            await wait_out(_ended(job.future), 60.0)

    def _give_up(self, out: _Outgoing) -> None:
        self.plane.send(out.link, XferCancel(transfer_id=out.transfer_id))

    def _may_have_arrived(self, out: _Outgoing) -> bool:
        """After a cancel, once its sends stopped or ended: could every byte have reached
        a receiver that keeps them? Only if a send ran to its end (or did not end in time)
        for an offer the receiver accepted or has yet to answer. A send stopped half way
        (a CANCELLED chunk), or never started, delivers nothing."""
        jobs: list[SendJob | NcclJob] = [j for j in (out.tcp_job,) if j is not None]
        if out.eager_job is not None and not out.eager_answered:
            jobs.append(out.eager_job)  # (once accepted, it is out.tcp_job)
        if out.nccl_job is not None and (out.accepted or out.offer_pending):
            jobs.append(out.nccl_job)
        return any(not job.future.done()
                   or (not job.future.cancelled() and job.future.exception() is None)
                   for job in jobs)

    async def _verdict(self, out: _Outgoing) -> bool | None:
        """Whether the receiver kept the bytes of a transfer we cancelled after they went:
        True (XFER_DONE), False (XFER_FAILED, or BUSY / REFUSE of the offer they went
        with), None (no answer in time, or the link went). The receiver answers at once
        (an ACCEPT first, if that was still to come); another cancel does not stop this
        bounded wait, as the answer decides what the transfer reports."""
        until = max(out.deadline, self._loop.time() + 2 * self.engine.config.peer_grace_s)
        while True:
            try:
                async with asyncio.timeout_at(until):
                    reply = await out.replies.get()
            except TimeoutError:
                return None
            except asyncio.CancelledError:
                if self._loop.time() >= until:
                    return None
                continue
            if isinstance(reply, XferDone):
                return True
            if isinstance(reply, XferFailed | Busy | Refuse):
                return False
            if isinstance(reply, KvdError):
                return None

    def _remember_abandoned(self, out: _Outgoing) -> None:
        tid = out.transfer_id
        self._abandoned[tid] = (out.link, out.layout, out.num_blocks, out.src_dev)
        self._loop.call_later(max(60.0, self.engine.config.peer_grace_s * 4),
                              self._abandoned.pop, tid, None)

    def _start_nccl_send(self, link: PeerLink, accept: Accept, blocks: BlockSet | None,
                         layout: Layout, num_blocks: int, src_dev: str,
                         deadline: float, ready_events: list[Any] | None = None) -> NcclJob:
        """Queue the bytes on the channel the ACCEPT names, now, in message order: the
        receiver queued its side in the same order."""
        assert self.nccl is not None
        entry = self.nccl.for_send(link, src_dev, accept.dst_dev, accept.channel,
                                   accept.nccl_uid)
        if accept.chunk_bytes <= 0:
            raise ProtocolError("an NCCL accept must say its chunk size")
        return self._queue_nccl_send(entry.channel, accept.transfer_id, blocks, layout,
                                     num_blocks, deadline, accept.chunk_bytes, ready_events)

    def _queue_nccl_send(self, channel: NcclChannel, tid: int, blocks: BlockSet | None,
                         layout: Layout, num_blocks: int, deadline: float, chunk_bytes: int,
                         ready_events: list[Any] | None) -> NcclJob:
        job = NcclJob(tid, blocks, layout, num_blocks,
                      time.monotonic() + max(0.0, deadline - self._loop.time()),
                      wire_bytes(layout, num_blocks), chunk_bytes,
                      ready_events=ready_events or [])
        self._submit_nccl(channel, job)
        confirmed = channel.until_confirmed()
        if blocks is None:  # zeros for a receiver that gave up: no confirmation comes
            def sent(_: object) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is gone at shutdown
                    self._loop.call_soon_threadsafe(confirmed)

            job.future.add_done_callback(sent)
        else:  # _push ends when the receiver has answered (or the transfer failed)
            self._unconfirmed.setdefault(tid, []).append(confirmed)
        return job

    def _on_accept(self, link: PeerLink, msg: Accept, out: _Outgoing | None) -> Any:
        """An ACCEPT starts the send at once, in message order (the pusher's coroutine
        would wake later); returns what the pusher gets."""
        if msg.channel == 0:
            if out is None:
                return None
            if out.source.gpu is not None or out.tcp_channel is None:
                return ProtocolError(f"{link.address} accepted GPU blocks over TCP")
            if out.eager_job is not None and not out.eager_answered:
                out.eager_answered = True  # it answers the eager offer: the bytes are coming
                out.tcp_job = out.eager_job
                return msg
            out.tcp_job = SendJob(msg.transfer_id, out.source.views())
            self._send_started(out, self._tcp_send(out.tcp_channel, out.tcp_job))
            return msg
        if out is not None and out.eager_channel:  # the bytes were queued with the offer
            if msg.channel != out.eager_channel:
                return ProtocolError(f"{link.address} accepted on channel {msg.channel}, "
                                     f"the bytes are on {out.eager_channel}")
            return msg
        try:
            if self.nccl is None or (out is not None and out.src_dev == CPU_DEVICE):
                raise ProtocolError("accepted over NCCL, which this transfer did not offer")
            if out is None:  # given up: still send (zeros), so the receiver is not left waiting
                _, layout, num_blocks, src_dev = self._abandoned.pop(msg.transfer_id)
                self._start_nccl_send(link, msg, None, layout, num_blocks, src_dev,
                                      self._loop.time() + self._receive_timeout(0))
                return None
            out.nccl_job = self._start_nccl_send(link, msg, out.source.blocks, out.layout,
                                                 out.num_blocks, out.src_dev, out.deadline,
                                                 [e for r in out.regions
                                                  for e in r.ready_events])
            self._send_started(out, out.nccl_job.future)
            return msg
        except KvdError as err:
            # The receiver has queued its receive on that channel and would wait for bytes
            # that will not come until its deadline: tell it to drop the channel now.
            self.plane.send(link, ChannelDown(channel=msg.channel, reason=(
                f"the sender could not send transfer {msg.transfer_id}: {err.message}")[:4000]))
            return err

    async def _reply(self, out: _Outgoing, deadline: float, what: str) -> Any:
        try:
            async with asyncio.timeout_at(deadline):
                reply = await out.replies.get()
        except TimeoutError:
            raise KvdTimeout(f"transfer {out.transfer_id} of key {out.key!r}: no {what} from "
                             f"{out.link.address} before the deadline") from None
        if isinstance(reply, KvdError):
            raise reply
        return reply

    # ------------------------------------------------------------ pulling

    async def pull(self, key: str, src: str, region: Region, idx: torch.Tensor,
                   timeout_s: float, wait_for_key_s: float = 0.0) -> int:
        link = await self.plane.link_to(src, timeout_s)
        if self.engine.draining:  # (it may have begun while we linked) nothing waits
            wait_for_key_s = 0.0
        tid = _new_id()
        wait = _PullWait(key, region, idx, self._loop.create_future(),
                         BlockSet(region.tensors, idx.numpy()), link=link)
        # Settled by whatever ends the pull (its bytes, a refusal, the link's loss), maybe
        # once nothing awaits it (cancelled, timed out): its error is the pull's to report,
        # not "never retrieved".
        wait.future.add_done_callback(_retrieved)
        self._pulls[tid] = wait
        try:
            self.plane.send(link, PullRequest(transfer_id=tid, key=key, dst_dev=CPU_DEVICE,
                                              num_blocks=len(idx), layout=list(region.layout),
                                              wait_for_key_s=wait_for_key_s))
            # While the request is out (a round trip, and the owner's work): what the
            # receive needs of the destination, so that it is not made once bytes come.
            self.engine.prepare_gpu_blocks(wait.blocks, region.layout)
            def lost(_link: PeerLink, err: KvdError) -> None:
                if not wait.future.done():
                    wait.future.set_exception(err)

            link.on_lost.append(lost)
            try:
                async with asyncio.timeout(timeout_s):
                    return await asyncio.shield(wait.future)
            except TimeoutError:
                raise KvdTimeout(f"pull {tid} of key {key!r} from {src} did not complete "
                                 f"within {timeout_s:g}s") from None
            finally:
                with contextlib.suppress(ValueError):
                    link.on_lost.remove(lost)
        except BaseException:
            # Stop the owner, and make sure no bytes land in the blocks after we return:
            # bytes not yet arriving are discarded; bytes arriving now are waited for.
            self.plane.send(link, XferCancel(transfer_id=tid))
            incoming = self._incoming.get((id(link), tid))
            if incoming is not None:
                self._forget(incoming)
                await wait_out(wait.future, 60.0)
            raise
        finally:
            self._pulls.pop(tid, None)

    # ------------------------------------------------------------ messages

    def on_message(self, link: PeerLink, msg: PeerMessage) -> None:
        self.engine.busy_poll.touch()
        if isinstance(msg, Offer):
            self._on_offer(link, msg)
        elif isinstance(msg, PullRequest):
            self._on_pull_request(link, msg)
        elif isinstance(msg, XferCancel):
            self._on_cancel(link, msg.transfer_id)
        elif isinstance(msg, ChannelDown):
            if self.nccl is not None:
                self.nccl.on_channel_down(link, msg)
        elif isinstance(msg, ChannelWarm):
            if self.nccl is not None:
                self.nccl.on_channel_warm(link, msg)
            else:
                self.plane.send(link, ChannelDown(channel=msg.channel, reason=(
                    f"{self.engine.config.node_id} has no NCCL")))
        elif isinstance(msg, Accept | Busy | Refuse | XferDone | XferFailed):
            pull = self._pull_of(link, msg.transfer_id)
            if pull is not None and isinstance(msg, Refuse):
                if not pull.future.done():
                    pull.future.set_exception(error_from_code(
                        msg.code, f"{link.address} refused the pull: {msg.message}"))
                return
            out = self._outgoing.get(msg.transfer_id)
            if out is not None and out.link is not link:
                out = None
            if out is not None and not isinstance(msg, XferDone | XferFailed):
                out.offer_pending = False
                if (isinstance(msg, Busy | Refuse) and out.eager_job is not None
                        and not out.eager_answered):
                    out.eager_answered = True  # the receiver drops those bytes: stop them
                    out.eager_job.stop.set()
            if out is None and msg.transfer_id in self._abandoned:
                if isinstance(msg, Accept):
                    self._on_accept(link, msg, None)
                else:
                    self._abandoned.pop(msg.transfer_id, None)
                return
            if isinstance(msg, Accept) and out is not None:
                answer = self._on_accept(link, msg, out)
                out.accepted = answer is msg
                out.replies.put_nowait(answer)
                return
            if out is None:
                self.plane.bad_messages["unknown_transfer"] = (
                    self.plane.bad_messages.get("unknown_transfer", 0) + 1)
                log.info("message for unknown transfer_id=%d from %s ignored",
                         msg.transfer_id, link.address)
                return
            out.replies.put_nowait(msg)

    def on_link_up(self, link: PeerLink) -> None:
        if self.nccl is not None:
            self.nccl.warm_up(link)

    def on_link_lost(self, link: PeerLink, error: KvdError) -> None:
        """Everything of the link ends with it: its waiting pulls are dropped, its sends
        fail (their tasks end, releasing their reads), its receives fail as their channels
        are aborted, and offers given up are forgotten."""
        self._waiting_pulls.drop_link(link)
        for out in list(self._outgoing.values()):
            if out.link is link:
                out.replies.put_nowait(error)
        for tid in [t for t, gone in self._abandoned.items() if gone[0] is link]:
            del self._abandoned[tid]
        if self.nccl is not None:
            self.nccl.on_link_lost(link, error)

    def _pull_of(self, link: PeerLink, tid: int) -> _PullWait | None:
        """Our pull with id ``tid``, if it went to ``link`` (only its owner answers it)."""
        pull = self._pulls.get(tid)
        return pull if pull is not None and pull.link is link else None

    def _fail_pull(self, pull: _PullWait | None, err: KvdError) -> None:
        """We refused the offer that answers ``pull`` (no bytes of it land): the pull
        fails now, not at its timeout."""
        if pull is not None and not pull.future.done():
            pull.future.set_exception(err)

    def _in_use(self, link: PeerLink, tid: int) -> bool:
        """Whether ``tid`` names a transfer still live with ``link``: ids are the peer's to
        choose, and must differ while live (its messages say which transfer they are
        about; a second transfer under one id would be mistaken for the first)."""
        out = self._outgoing.get(tid)
        return ((id(link), tid) in self._incoming or (id(link), tid) in self._serving
                or self._waiting_pulls.holds(link, tid)
                or (out is not None and out.link is link))

    def _refuse(self, link: PeerLink, tid: int, err: KvdError, bad: str | None = None) -> None:
        if bad is not None:
            self.plane.bad_messages[bad] = self.plane.bad_messages.get(bad, 0) + 1
        log.info("transfer refused transfer_id=%d from=%s: [%s] %s", tid, link.address,
                 err.code, err.message)
        self.plane.send(link, Refuse(transfer_id=tid, code=err.code, message=err.message))

    def _on_offer(self, link: PeerLink, offer: Offer) -> None:
        duplicate = (id(link), offer.transfer_id) in self._incoming
        eager_nccl = None
        if offer.channel:
            eager_nccl = self._eager_channel(link, offer)
            if eager_nccl is None:
                return  # answered: CHANNEL_DOWN and BUSY / REFUSE
        accepted = self._answer_offer(link, offer, eager_nccl)
        if not accepted and eager_nccl is not None:
            self.counters.eager_nccl_dropped += 1
            # The sender queued the bytes with its offer (even under a duplicate id): take
            # them into staging and drop them, so the channel's two ends stay in step.
            self._queue_nccl_receive(eager_nccl, offer, None, offer.chunk_bytes)
        if not accepted and offer.eager and not duplicate and link.recv_channel is not None:
            # Its bytes are on their way without waiting for our answer: drop them.
            link.recv_channel.drop(offer.transfer_id, offer.nbytes)

    def _eager_channel(self, link: PeerLink, offer: Offer) -> NcclChannel | None:
        """The receive channel an eager OFFER's bytes are queued on. If we cannot take
        them there, say so — CHANNEL_DOWN, so the sender aborts its end (and the send
        waiting on it), then BUSY to offer again without a channel, or REFUSE — and
        return None."""
        tid, channel = offer.transfer_id, offer.channel
        problem: KvdError | None = None
        if self.nccl is None:
            problem = BadRequest(f"{self.engine.config.node_id} has no NCCL")
        elif not (offer.src_gpu and offer.src_dev.startswith("cuda:")):
            problem = ProtocolError("an offer with an NCCL channel must be of GPU blocks")
        elif not MIN_NCCL_CHUNK_BYTES <= offer.chunk_bytes <= MAX_NCCL_CHUNK_BYTES:
            problem = ProtocolError(f"NCCL chunk size {offer.chunk_bytes} out of range")
        else:
            entry = self.nccl.for_eager_receive(link, channel, offer.src_dev)
            if entry is not None:
                return entry.channel
        reason = problem.message if problem else f"no live receive channel {channel}"
        self.plane.send(link, ChannelDown(channel=channel, reason=reason[:4000]))
        if problem is None:
            self.plane.send(link, Busy(transfer_id=tid, retry_after_s=0.0))
        else:
            self._refuse(link, tid, problem, "bad_offer")
            if not self._in_use(link, tid):
                self._fail_pull(self._pull_of(link, tid), problem)
        return None

    def _queue_nccl_receive(self, channel: NcclChannel, offer: Offer,
                            blocks: BlockSet | None, chunk_bytes: int) -> NcclJob:
        """Queue the receive matching an offer's send: into ``blocks``, or, with None
        (an eager offer we decline), into staging and dropped."""
        job = NcclJob(offer.transfer_id, blocks, tuple(offer.layout), offer.num_blocks,
                      time.monotonic() + self._receive_timeout(offer.nbytes), offer.nbytes,
                      chunk_bytes, abandoned=blocks is None)
        self._submit_nccl(channel, job)
        return job

    def _submit_nccl(self, channel: NcclChannel, job: NcclJob) -> None:
        channel.submit(job)
        if not job.inline:  # the channel's thread runs it
            self.engine.busy_poll.thread_work(job.future)

    def _answer_offer(self, link: PeerLink, offer: Offer,
                      eager_nccl: NcclChannel | None = None) -> bool:
        """ACCEPT (True), or BUSY / REFUSE (False). ``eager_nccl``: the channel the bytes
        are already queued on (the receive goes there)."""
        tid = offer.transfer_id
        layout = tuple(offer.layout)
        pull = self._pull_of(link, tid)
        if self._in_use(link, tid) or (pull is not None and pull.offered):
            self._refuse(link, tid, ProtocolError(f"transfer id {tid} is already in use"),
                         "duplicate_transfer")
            return False  # (a pull it answers goes on: bytes may be landing for it)
        problem: KvdError | None = None
        bad: str | None = "bad_offer"
        sender_nccl = offer.src_dev != CPU_DEVICE
        if offer.nbytes != wire_bytes(layout, offer.num_blocks):
            problem = ProtocolError(
                f"offer of {offer.nbytes} bytes does not match {offer.num_blocks} blocks of "
                f"its layout ({wire_bytes(layout, offer.num_blocks)} bytes)")
        elif sender_nccl and not offer.src_dev.startswith("cuda:"):
            problem = ProtocolError(f"bad device {offer.src_dev!r}")
        elif offer.src_gpu and (self.nccl is None or not sender_nccl):
            problem, bad = BadRequest(
                f"{link.address} offers GPU blocks, but {self.engine.config.node_id} has no "
                "GPU with NCCL (GPU memory does not go over TCP)"), None
        elif (offer.nbytes > self.engine.pool.capacity_bytes and pull is None
              and not offer.src_gpu
              and not self.arrivals.get_waits_for(offer.key, layout, offer.num_blocks)):
            # No room for it, ever: unless a get waits for it (its blocks are the room)
            # or a pull asked for it (the puller's are), or GPU staging may take it.
            problem = PoolExhausted(
                f"offer of {offer.nbytes} bytes exceeds the whole pool "
                f"({self.engine.pool.capacity_bytes} bytes)")
        if problem is not None:
            self._refuse(link, tid, problem, bad)
            self._fail_pull(pull, problem)
            return False
        try:
            if pull is not None:
                if offer.key != pull.key or layout != pull.region.layout or (
                        offer.num_blocks != len(pull.idx)):
                    raise ProtocolError("offer does not match the pull it answers")
                arrival = self.arrivals.arrival_into(pull.key, pull.region, pull.blocks)
                pull.offered = True
            else:
                # Bytes already queued on a channel land next to it, if anywhere on a GPU.
                staging = (str(eager_nccl.device) if eager_nccl is not None
                           else self._staging_gpu() if offer.src_gpu else None)
                arrival = self.arrivals.arrival(offer.key, layout, offer.num_blocks,
                                              offer.ttl_s, gpu=staging)
        except PoolExhausted:
            self.counters.busy_replies += 1
            self.plane.send(link, Busy(transfer_id=tid, retry_after_s=BUSY_RETRY_S))
            return False
        except KvdError as err:
            self._refuse(link, tid, err)
            if pull is not None and not pull.future.done():
                pull.future.set_exception(err)
            return False
        try:
            job, accept = self._receive_job(link, offer, arrival, eager_nccl)
        except KvdError as err:
            self.arrivals.arrival_failed(arrival, err)
            self._refuse(link, tid, err)
            if pull is not None and not pull.future.done():
                pull.future.set_exception(err)
            return False
        incoming = _Incoming(tid, offer.key, link, arrival, job)
        # The job may start writing before _receive runs: hold the regions from now on.
        self.engine.copies.hold_regions(incoming.regions, _ended(job.future))
        if arrival.waiter is not None:  # a cancelled get drops the rest (Engine.get)
            arrival.waiter.stop_delivery = lambda: self._forget(incoming)
        self._incoming[(id(link), tid)] = incoming
        self.plane.send(link, accept)
        self._spawn(self._receive(incoming, pull))
        return True

    def _staging_gpu(self) -> str | None:
        """The GPU whose staging has the most room (arrivals nobody waits for yet)."""
        pools = self.engine.gpu_pools
        return max(pools, key=lambda d: pools[d].largest_free_bytes) if pools else None

    def _receive_job(self, link: PeerLink, offer: Offer, arrival: Arrival,
                     eager_nccl: NcclChannel | None = None,
                     ) -> tuple[RecvJob | NcclJob, Accept]:
        """Queue the receive on the right channel: NCCL when GPU memory is on either end
        (and both have it), TCP otherwise; the eager offer's channel if it named one."""
        tid = offer.transfer_id
        dest = arrival.device
        sender_nccl = offer.src_dev != CPU_DEVICE
        if eager_nccl is not None:
            job = self._queue_nccl_receive(eager_nccl, offer, arrival.blocks,
                                           offer.chunk_bytes)
            return job, Accept(transfer_id=tid, dst_dev=str(eager_nccl.device),
                               channel=offer.channel, chunk_bytes=offer.chunk_bytes)
        if not (offer.src_gpu or dest.type == "cuda"):
            assert link.recv_channel is not None
            tcp_job = RecvJob(tid, arrival.wire_views(), offer.nbytes, eager=offer.eager)
            link.recv_channel.expect(tcp_job)
            self.engine.busy_poll.thread_work(tcp_job.future)
            return tcp_job, Accept(transfer_id=tid)
        if self.nccl is None or not sender_nccl:
            raise BadRequest(f"the destination blocks are on {dest}, and {link.address} has "
                             "no NCCL to send there (GPU memory does not go over TCP)")
        local_dev = str(dest) if dest.type == "cuda" else self.plane.gpus[0]
        entry = self.nccl.for_receive(link, local_dev, offer.src_dev)
        chunk = self._chunk_bytes(offer, arrival)
        job = self._queue_nccl_receive(entry.channel, offer, arrival.blocks, chunk)
        return job, Accept(transfer_id=tid, dst_dev=local_dev, channel=entry.channel_id,
                           nccl_uid=entry.unique_id, chunk_bytes=chunk)

    def _chunk_bytes(self, offer: Offer, arrival: Arrival) -> int:
        """``nccl_chunk_bytes``, or, when both ends hold each tensor's blocks as one run
        at least that large, one message per tensor: no staging, fewest messages."""
        configured = self.engine.config.nccl_chunk_bytes
        run = max(e.bytes_per_block for e in offer.layout) * offer.num_blocks
        if (offer.one_run and run >= configured and arrival.device.type == "cuda"
                and arrival.blocks.one_run()
                and all(e.bytes_per_block * offer.num_blocks == run for e in offer.layout)):
            return run
        return configured

    def _receive_timeout(self, nbytes: int) -> float:
        """How long a receive may take once queued: the peer's grace (it may be slow to
        start) plus the bytes at a pessimistic 1 GB/s."""
        return max(10.0, 2 * self.engine.config.peer_grace_s) + nbytes / 1e9

    async def _receive(self, incoming: _Incoming, pull: _PullWait | None) -> None:
        tid, link = incoming.transfer_id, incoming.link
        offered = time.monotonic()
        afut = on_loop(incoming.job.future)
        outcome = "failed"
        try:
            nbytes = await asyncio.shield(afut)  # regions held since the job was queued
            timeline.mark("transfer.received")
        except (asyncio.CancelledError, Exception) as exc:
            err = _as_kvd_error(exc, f"transfer {tid}")
            outcome = "cancelled" if isinstance(err, Cancelled) else "failed"
            self.arrivals.arrival_failed(incoming.arrival, err)
            log.info("receive failed transfer_id=%d key=%s from=%s: [%s] %s", tid,
                     incoming.key, link.address, err.code, err.message)
            self.plane.send(link, XferFailed(transfer_id=tid, code=err.code,
                                             message=err.message))
            if pull is not None and not pull.future.done():
                pull.future.set_exception(err)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            outcome = "done"
            self.counters.bytes_received += nbytes
            self.arrivals.arrived(incoming.arrival, nbytes)
            if pull is not None and not pull.future.done():
                pull.future.set_result(nbytes)
            try:
                if incoming.arrival.waiter is not None:
                    # The get these bytes answer replies first: its client is what a
                    # decode step waits for, and each send on a local socket costs its
                    # receiver's wake-up (~30-40 us on the CI machine); the sender's
                    # confirmation follows two turns of the loop later, as the get awaits
                    # its waiter through asyncio.shield (Engine.get: a cancel must not
                    # reach the waiter). (A pull's reply would need two turns too:
                    # measured on the CI machine, no gain that stood out of its noise.)
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
            finally:
                self.plane.send(link, XferDone(transfer_id=tid, nbytes=nbytes))
            log.debug("received transfer_id=%d key=%s from=%s bytes=%d", tid, incoming.key,
                      link.address, nbytes)
        finally:
            self.counters.count(self.counters.received, outcome)
            self._incoming.pop((id(link), tid), None)
            started = incoming.job.started_at or None
            self.engine.metrics.transfer(
                peer=link.address, direction="recv", transport=incoming.transport,
                outcome=outcome,
                nbytes=incoming.job.nbytes,
                queue_s=None if started is None else started - offered,
                wire_s=None if started is None else time.monotonic() - started)

    def _forget(self, incoming: _Incoming) -> None:
        """Drop the bytes of a receive nobody wants: a TCP job's go to scratch; an NCCL
        job that has not started receives into staging only, one that runs finishes."""
        if isinstance(incoming.job, NcclJob):
            incoming.job.abandoned = True
        elif incoming.link.recv_channel is not None:
            incoming.link.recv_channel.forget(incoming.transfer_id)

    def _on_cancel(self, link: PeerLink, tid: int) -> None:
        self._waiting_pulls.drop(link, tid)
        incoming = self._incoming.get((id(link), tid))
        if incoming is not None:
            self._forget(incoming)  # its bytes, if any come, are discarded
        out = self._outgoing.get(tid)
        if out is not None and out.link is link:  # the puller gave up
            out.replies.put_nowait(Cancelled(f"transfer {tid} cancelled by {link.address}"))

    def _on_pull_request(self, link: PeerLink, req: PullRequest,
                         wait_until: float | None = None) -> None:
        tid = req.transfer_id
        if tid in self._outgoing or self._in_use(link, tid):
            # A send is known by its id alone until it ends: a second request under a
            # live id would take the first one's place, and leave that one to wait out
            # its deadline holding a read of its key.
            self._refuse(link, tid, ProtocolError(f"transfer id {tid} is already in use"),
                         "duplicate_transfer")
            return
        if (self._served.get(link, 0) >= self._max_served
                or self._served_all >= self._max_served_all):
            # (before the read is claimed: a claim takes a lent key out of the store)
            self._refuse_pull_over_limit(link, req)
            return
        try:
            item = self.arrivals.readable(req.key, tuple(req.layout), req.num_blocks)
        except UnknownKey as err:
            if wait_until is None:  # a new request: its wait starts now
                wait_until = self._loop.time() + min(req.wait_for_key_s,
                                                     self.engine.config.max_wait_s)
            if not self._waiting_pulls.hold(link, req, wait_until):  # (no wait: refused)
                self._refuse(link, tid, err)
            return
        except KvdError as err:
            self._refuse(link, tid, err)
            return
        source = _Source(self.arrivals.source_blocks(item))
        try:  # GPU bytes for a puller without NCCL: tell it now, not at its timeout
            self._check_gpu_route(link, source)
        except KvdError as err:
            item.end_read()
            self._refuse(link, tid, err)
            return
        regions = [item.region] if item.region is not None else []
        deadline = self._loop.time() + self.engine.config.max_wait_s

        async def serve() -> None:
            if not link.alive:  # lost before this ran (on_link_lost did not see it)
                return
            with contextlib.suppress(KvdError):  # logged in _push; the puller has its own
                item.bytes_read += await self._push(link, tid, req.key, source, item.layout,
                                                    item.num_blocks, None, deadline, regions)

        def ended(_task: asyncio.Task[None]) -> None:
            # (a callback, not a finally: a task cancelled before it first ran, at
            # shutdown, runs no finally, and the read would never end)
            item.end_read()
            self._serving.discard((id(link), tid))
            self._pull_ended(link)

        self._serving.add((id(link), tid))
        self._served[link] = self._served.get(link, 0) + 1
        self._served_all += 1
        self._spawn(serve()).add_done_callback(ended)

    def _pull_ended(self, link: PeerLink) -> None:
        self._served_all -= 1
        left = self._served.pop(link) - 1
        if left:
            self._served[link] = left

    def _refuse_pull_over_limit(self, link: PeerLink, req: PullRequest) -> None:
        """A pull past the pulls served at once, the peer's or all peers': refused with a
        retriable error, counted (``pull_limit``), and logged at most every few seconds."""
        node = self.engine.config.node_id
        served = self._served.get(link, 0)
        if served >= self._max_served:
            whose = f"{served} of its pulls are"
            message = f"{node} serves {served} pulls for {link.address} already"
        else:
            whose = f"{self._served_all} pulls of all peers are"
            message = f"{node} serves {self._served_all} pulls for its peers already"
        self.plane.bad_messages["pull_limit"] = self.plane.bad_messages.get("pull_limit", 0) + 1
        self._refusing_pulls.warning(
            "pull refused transfer_id=%d key=%s from=%s: %s being served already (the most "
            "at once)", req.transfer_id, req.key, link.address, whose)
        err = PoolExhausted(f"{message} (the most at once): ask again")
        self.plane.send(link, Refuse(transfer_id=req.transfer_id, code=err.code,
                                     message=err.message))

    def _key_appeared(self, key: str) -> None:
        """The engine stored, published or lent ``key``: serve the pulls waiting for it, in
        the order they came (one, if it is lent; the others wait on, to their deadline)."""
        for pull in self._waiting_pulls.take(key):
            self._on_pull_request(pull.link, pull.req, wait_until=pull.deadline)

    def refuse_waiting_pulls(self, err: KvdError) -> int:
        """Draining: the pulls our clients made that no owner has answered yet (they may
        be waiting there for their key), and the peers' pulls waiting here for a key, fail
        now, as gets waiting for a key do. Returns how many."""
        refused = 0
        for pull in self._waiting_pulls.take_all():
            self._refuse(pull.link, pull.req.transfer_id, err)
            refused += 1
        for wait in self._pulls.values():
            if not wait.offered and not wait.future.done():
                wait.future.set_exception(err)  # (its task tells the owner: XferCancel)
                refused += 1
        return refused

    def _waited_in_vain(self, pull: WaitingPull) -> None:
        self._refuse(pull.link, pull.req.transfer_id, UnknownKey(
            f"no key {pull.req.key!r} on {self.engine.config.node_id} within "
            f"{pull.req.wait_for_key_s:g}s"))

    @property
    def waiting_pulls(self) -> int:
        return len(self._waiting_pulls)

    def in_flight(self) -> dict[str, tuple[int, int]]:
        """Transfers with peers in progress, by direction: how many, how many bytes."""
        return {"send": (len(self._outgoing), sum(o.nbytes for o in self._outgoing.values())),
                "recv": (len(self._incoming),
                         sum(i.job.nbytes for i in self._incoming.values()))}

    def pending_tasks(self) -> list[asyncio.Task[Any]]:
        return [t for t in self._tasks if not t.done()]

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"sent": dict(c.sent), "received": dict(c.received),
                "bytes_sent": c.bytes_sent, "bytes_received": c.bytes_received,
                "busy_replies": c.busy_replies, "in_flight_out": len(self._outgoing),
                "pulls_waiting_for_key": self.waiting_pulls,
                "eager_nccl_sent": c.eager_nccl_sent,
                "eager_nccl_dropped": c.eager_nccl_dropped,
                "in_flight_in": len(self._incoming),
                "nccl": self.nccl.stats() if self.nccl is not None else None}


def _as_kvd_error(exc: BaseException, what: str) -> KvdError:
    if isinstance(exc, KvdError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        return Cancelled(f"{what} cancelled")
    return TransferFailed(f"{what}: {exc!r}")


def _ended(cfut: concurrent.futures.Future[Any]) -> asyncio.Future[Any]:
    """A loop future that settles when ``cfut`` does, for what waits only for the end
    (regions held while a job runs). Whoever awaits the job reports its error: here it is
    marked retrieved, so that dropping this future logs no "exception never retrieved"."""
    afut = on_loop(cfut)
    afut.add_done_callback(_retrieved)
    return afut


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11
        task.uncancel()


# Transfer ids only have to differ (a peer is authenticated before it sends any): a
# generator seeded once from the OS, not an os.urandom call per transfer (~7 us each in a
# daemon on the GPU host).
_id_source = random.Random(secrets.randbits(128))


def _new_id() -> int:
    return _id_source.getrandbits(62) + 1
