"""Transfers between daemons: the driver of the transfer machine.

``PeerTransfers`` feeds ``machine.TransferMachine`` every input — a client's put or pull
and its cancel, a peer's message, a route's completion, a timer, a lost link — and carries
out the actions it returns, in order: messages to peers, jobs on routes (``routes``: our
data connection or an NCCL channel), the keys' side (``Arrivals``: where incoming bytes
land, what a peer may read), timers, and the answers to the requests waiting here. Where
carrying out an action finds something the machine must know (a route that cannot take
the bytes, where an offer's bytes go, whether a pulled key is here), it reports it back
as the machine's next input. It decides nothing: the protocol is the machine's.

Every job's end reaches the loop through ``call_soon`` (``call_soon_threadsafe`` from a
route's thread), never inside the action that stopped it: the machine is never fed while
a list of its actions is half carried out, except by reports those actions ask for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from kvd import timeline
from kvd.daemon.engine import Engine
from kvd.daemon.futures import TimedOut, keep_task, on_loop, settle_awaited, time_out, wait_out
from kvd.daemon.peer_link import CPU_DEVICE, PeerLink
from kvd.daemon.peers import PeerPlane
from kvd.daemon.store import Item
from kvd.daemon.transfer import machine as m
from kvd.daemon.transfer.arrivals import Arrival, Arrivals, NeverFits
from kvd.daemon.transfer.leasing import Leasing
from kvd.daemon.transfer.machine import Job, Offering, TransferMachine, new_id
from kvd.daemon.transfer.nccl_links import NcclLinks
from kvd.daemon.transfer.routes import Moving, Routes, Source, TcpSendRoute
from kvd.errors import BadRequest, Cancelled, KvdError, KvdTimeout, PoolExhausted, TransferFailed
from kvd.memory.regions import Region
from kvd.protocol import (
    ALL,
    ChannelDown,
    ChannelWarm,
    LeaseAnswer,
    LeaseRelease,
    LeaseRenew,
    Offer,
    PeerMessage,
    PullRequest,
    Share,
)
from kvd.transport.chunks import BlockSet

log = logging.getLogger("kvd.daemon.transfer.transfers")


@dataclass(eq=False)
class Outbound:
    """What one send moves: its source and offer, its jobs, and its answer."""

    link: PeerLink
    source: Source
    offer: Offer  # as first offered; eager and inline offers are variants of it
    deadline: float  # loop time
    future: asyncio.Future[int]  # settled at m.Finish: what the requester gets
    wake: asyncio.Future[int]  # what the requester awaits (a cancel cancels only this)
    requested: float = field(default_factory=time.monotonic)
    tcp: TcpSendRoute | None = None
    jobs: dict[Job, Moving] = field(default_factory=dict)
    inline: bool = False  # its bytes went in the offer


@dataclass(eq=False)
class Inbound:
    """A receive in progress: where its bytes land, and its job."""

    arrival: Arrival
    job: Moving
    nbytes: int
    offered: float = field(default_factory=time.monotonic)

    @property
    def regions(self) -> list[Region]:
        """The client regions the bytes land in (a pull's, or a waiting get's)."""
        waiter = self.arrival.waiter
        return [r for r in (self.arrival.region, waiter.region if waiter else None)
                if r is not None]


@dataclass(eq=False)
class Pulling:
    """One of our pulls: where its bytes go, and its answer (``future``, settled once;
    ``wake``, what its task awaits)."""

    region: Region
    blocks: BlockSet
    future: asyncio.Future[int]
    wake: asyncio.Future[int]


class PeerTransfers:
    def __init__(self, engine: Engine, plane: PeerPlane, nccl: NcclLinks | None = None
                 ) -> None:
        config = engine.config
        self.engine, self.config, self.plane, self.nccl = engine, config, plane, nccl
        self._loop = asyncio.get_running_loop()
        self.arrivals = Arrivals(engine)
        self.routes = Routes(nccl, engine.busy_poll, config.nccl_chunk_bytes,
                             config.peer_grace_s, list(plane.gpus), config.node_id)
        self.machine: TransferMachine[PeerLink] = TransferMachine(
            config.node_id, has_nccl=nccl is not None,
            nccl_chunk_bytes=config.nccl_chunk_bytes,
            max_waiting_pulls=config.max_waiting_pulls, max_wait_s=config.max_wait_s,
            peer_grace_s=config.peer_grace_s)
        self._out: dict[int, Outbound] = {}
        self._in: dict[tuple[PeerLink, int], Inbound] = {}
        self._pulls: dict[int, Pulling] = {}
        self._reads: dict[int, Item] = {}  # the served pulls' reads of their keys
        self._timers: dict[m.TimerKey, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.leasing = Leasing(plane, engine.leases)
        engine.leases.remote = self.leasing
        engine.key_listeners.append(
            lambda key: self._act(self.machine.key_appeared(key)))
        engine.leases.gone_listeners.append(self._key_went)

    @property
    def address(self) -> str:
        return self.plane.address

    # ============================================================== a client's requests

    async def push_blocks(self, key: str, region: Region, idx: torch.Tensor, to: str,
                          ttl_s: float | None, timeout_s: float, first: int = 0) -> int:
        """A client's put to another daemon (``idx``: the key's blocks from ``first`` on;
        its reader has the ones before)."""
        deadline = self._loop.time() + timeout_s
        link = await self.plane.link_to(to, timeout_s)
        source = Source(BlockSet(region.tensors, idx.numpy()), region.layout, len(idx),
                        [region])
        self.routes.check_gpu(link, source)
        tid = new_id()
        run = self._outbound(link, tid, key, source, ttl_s, deadline, first)
        self._act(self.machine.send(self._send_of(run), self._loop.time()))
        try:
            return await run.wake
        except asyncio.CancelledError:
            # The machine ends it (its timers bound every wait); a second cancel does not
            # cut this short: what the receiver kept, not the cancel, is the answer.
            self._act(self.machine.cancel_send(tid, self._loop.time()))
            await wait_out(run.future, m.JOBS_GRACE_S + 4 * self.config.peer_grace_s)
            if not run.future.done() or isinstance(run.future.exception(), Cancelled):
                raise
            _uncancel()
            return run.future.result()  # (kept though cancelled, or why it failed)

    async def pull(self, key: str, src: str, region: Region, idx: torch.Tensor,
                   timeout_s: float, wait_for_key_s: float = 0.0, share: Share = ALL,
                   ) -> int:
        link = await self.plane.link_to(src, timeout_s)
        if self.engine.draining:  # (it may have begun while we linked) nothing waits
            wait_for_key_s = 0.0
        tid = new_id()
        future = self._loop.create_future()
        run = Pulling(region, BlockSet(region.tensors, idx.numpy()), future,
                      self._loop.create_future())
        self._pulls[tid] = run
        try:
            self._act(self.machine.pull(tid, link, key, region.layout, len(idx),
                                        wait_for_key_s, share))
            # While the request is out (a round trip, and the owner's work): what the
            # receive needs of the destination, so that it is not made once bytes come.
            self.engine.prepare_gpu_blocks(run.blocks, region.layout)
            timer = time_out(run.wake, timeout_s)
            try:
                return await run.wake
            except TimedOut:
                raise KvdTimeout(f"pull {tid} of key {key!r} from {src} did not complete "
                                 f"within {timeout_s:g}s") from None
            finally:
                timer.cancel()
        except BaseException:
            # No bytes land in the blocks after we return: those not yet arriving are
            # dropped; those arriving now are waited for.
            self._act(self.machine.cancel_pull(tid))
            await wait_out(run.future, m.JOBS_GRACE_S)
            raise
        finally:
            self._pulls.pop(tid, None)

    def refuse_waiting_pulls(self, err: KvdError) -> int:
        """Draining: the peers' pulls waiting here for a key, and our pulls no owner has
        answered yet, fail now, as gets waiting for a key do. Returns how many."""
        actions, refused = self.machine.drain(err)
        self._act(actions)
        return refused

    # ============================================================== a peer's messages

    def on_message(self, link: PeerLink, msg: PeerMessage) -> None:
        self.engine.busy_poll.touch()
        if isinstance(msg, ChannelDown):
            if self.nccl is not None:
                self.nccl.on_channel_down(link, msg)
        elif isinstance(msg, ChannelWarm):
            if self.nccl is not None:
                self.nccl.on_channel_warm(link, msg)
            else:
                self.plane.send(link, ChannelDown(channel=msg.channel, reason=(
                    f"{self.config.node_id} has no NCCL")))
        elif isinstance(msg, LeaseRenew | LeaseRelease | LeaseAnswer):
            self.leasing.on_message(link, msg)
        else:
            self._act(self.machine.message(link, msg, self._loop.time()))

    def busy_links(self) -> set[PeerLink]:
        return self.machine.busy_links() | {link for link, _ in self._in}

    def on_link_up(self, link: PeerLink) -> None:
        if self.nccl is not None:
            self.nccl.warm_up(link)

    def on_link_lost(self, link: PeerLink, error: KvdError) -> None:
        """Everything of the link ends with it: its sends fail (waiting for their jobs),
        its receives fail as their channels are aborted, its waiting pulls are dropped."""
        self._act(self.machine.link_lost(link, error, self._loop.time()))
        if self.nccl is not None:
            self.nccl.on_link_lost(link, error)

    def _key_went(self, key: str) -> None:
        if self.machine.waits_for(key):
            self._act(self.machine.key_went(key, self.engine.store.missing(key)))

    # ============================================================== actions

    def _act(self, actions: list[m.Action[PeerLink]]) -> None:
        """Carry out what the machine decided, in its order."""
        for action in actions:
            match action:
                case m.Tell(link, message, soon):
                    if soon:
                        self._loop.call_soon(self.plane.send, link, message)
                    else:
                        self.plane.send(link, message)
                case m.SendOffer(tid, how):
                    self._send_offer(tid, how)
                case m.StartSend(tid, accept):
                    run = self._out.get(tid)
                    if run is None:
                        continue
                    try:
                        route = self.routes.accepted_send(run.link, run.offer.src_dev,
                                                          accept, run.tcp)
                        job = route.send(tid, run.source, run.deadline)
                    except KvdError as err:
                        self._act(self.machine.start_failed(tid, accept, err))
                        continue
                    self._job_started(tid, run, Job.NCCL if accept.channel else Job.TCP, job)
                case m.Halt(tid, job_name):
                    run = self._out.get(tid)
                    if run is not None and job_name in run.jobs:
                        run.jobs[job_name].halt()
                case m.Finish(tid, result, label):
                    self._finish(tid, result, label)
                case m.Take(link, offer, pull):
                    self._act(self.machine.took(link, offer, self._take(link, offer, pull)))
                case m.EndReceive(link, tid, result):
                    self._end_receive(link, tid, result)
                case m.Discard(link, tid):
                    if (inbound := self._in.get((link, tid))) is not None:
                        inbound.job.discard()
                case m.DropEager(link, offer):
                    self.routes.drop_eager(link, offer)
                case m.SettlePull(tid, result):
                    if (pulling := self._pulls.get(tid)) is not None:
                        settle_awaited(pulling.future, pulling.wake, result)
                case m.Serve(link, req, until):
                    self._serve(link, req, until)
                case m.EndRead(tid, nbytes):
                    if (item := self._reads.pop(tid, None)) is not None:
                        item.bytes_read += nbytes
                        item.end_read()
                case m.PrepareTcp(tid):
                    self._prepare_tcp(tid)
                case m.SendZeros(gone, accept):
                    try:
                        self.routes.send_zeros(gone.link, gone.src_dev, gone.layout,
                                               gone.num_blocks, accept)
                    except KvdError as err:
                        self.plane.send(gone.link, ChannelDown(channel=accept.channel,
                                                               reason=err.message[:4000]))
                case m.Timer(key, at):
                    if (old := self._timers.pop(key, None)) is not None:
                        old.cancel()
                    self._timers[key] = self._loop.call_at(at, self._timer, key)
                case m.CancelTimer(key):
                    if (handle := self._timers.pop(key, None)) is not None:
                        handle.cancel()
                case m.Count(kind, note):
                    self.plane.bad_input.note(kind, note)

    def _timer(self, key: m.TimerKey) -> None:
        self._timers.pop(key, None)
        self._act(self.machine.timer(key, self._loop.time()))

    # -------------------------------------------------------------- sends

    def _outbound(self, link: PeerLink, tid: int, key: str, source: Source,
                  ttl_s: float | None, deadline: float, first: int = 0) -> Outbound:
        nccl = self.nccl is not None and any(d.startswith("cuda") for d in link.devices)
        gpu = source.gpu is not None
        offer = Offer(transfer_id=tid, key=key,
                      src_dev=(source.gpu or self.plane.gpus[0]) if nccl else CPU_DEVICE,
                      dst_dev="any", nbytes=source.nbytes, num_blocks=source.num_blocks,
                      layout=list(source.layout), ttl_s=ttl_s, src_gpu=gpu,
                      one_run=gpu and source.blocks is not None and source.blocks.one_run(),
                      first=first)
        run = self._out[tid] = Outbound(link, source, offer, deadline,
                                        self._loop.create_future(),
                                        self._loop.create_future())
        return run

    def _send_of(self, run: Outbound) -> m.Send[PeerLink]:
        """The machine's record of a send, from its first offer."""
        o, source = run.offer, run.source
        return m.Send(o.transfer_id, run.link, o.key, source.layout, source.num_blocks,
                      source.nbytes, run.deadline, o.src_gpu, o.src_dev != CPU_DEVICE,
                      o.src_dev)

    def _prepare_tcp(self, tid: int) -> None:
        run = self._out[tid]
        channel = run.link.send_channel
        if channel is not None:
            run.tcp = self.routes.tcp_send(channel)
            self._act(self.machine.tcp_ready(tid, None))
            return

        async def connect() -> None:
            try:
                async with asyncio.timeout_at(run.deadline):
                    run.tcp = self.routes.tcp_send(await self.plane.send_channel(run.link))
            except TimeoutError:
                return  # (the machine's deadline ends the send)
            except KvdError as err:
                self._act(self.machine.tcp_ready(tid, err))
                return
            self._act(self.machine.tcp_ready(tid, None))

        keep_task(self._tasks, connect())

    def _send_offer(self, tid: int, how: Offering) -> None:
        run = self._out.get(tid)
        if run is None:
            return
        link, offer, source = run.link, run.offer, run.source
        if how is Offering.INLINE:
            # The bytes read from the client's blocks as the offer is encoded: nothing of
            # them is kept while the answer is awaited.
            assert source.blocks is not None
            views = source.blocks.views()
            payload = views[0] if len(views) == 1 else memoryview(b"".join(views))
            run.inline = True
            self.plane.send(link, msgspec.structs.replace(offer, inline=payload))
            timeline.mark("transfer.sent")
            return
        if how is Offering.EAGER_NCCL:
            route = self.routes.eager_send(link, offer.src_dev)
            if route is not None:
                # Queued now, in OFFER order: the receiver queues its side when the OFFER
                # arrives, whatever it answers (machine.may_send_eager_nccl: why the
                # orders match).
                chunk = self.config.nccl_chunk_bytes
                self.plane.send(link, msgspec.structs.replace(
                    offer, dst_dev=str(route.channel.device), channel=route.channel_id,
                    chunk_bytes=chunk))
                if self._out.get(tid) is run:  # (not ended by a link lost in that send)
                    self.machine.offered_eager(tid, route.channel_id)
                    self._job_started(tid, run, Job.EAGER_NCCL,
                                      route.send(tid, source, run.deadline))
                return
        if how is Offering.EAGER_TCP:
            assert run.tcp is not None
            self.plane.send(link, msgspec.structs.replace(offer, eager=True))
            if self._out.get(tid) is run:
                self._job_started(tid, run, Job.EAGER_TCP,
                                  run.tcp.send(tid, source, run.deadline, eager=True))
            return
        self.plane.send(link, offer)
        blocks = source.blocks
        if source.gpu is not None and blocks is not None and not offer.one_run:
            # The copy kernel's map of the blocks to gather, made while the offer is out
            # instead of after the ACCEPT (see Engine.get for the receiver).
            blocks.block_map(blocks.tensors[0].device)

    def _job_started(self, tid: int, run: Outbound, name: Job, job: Moving) -> None:
        """A send job now reads the client's regions: they stay mapped until it ends."""
        run.jobs[name] = job
        self._watch(job, run.source.regions, lambda result: self._act(
            self.machine.sent(tid, name, result, self._loop.time())), f"transfer {tid}")

    def _finish(self, tid: int, result: int | KvdError, label: str) -> None:
        run = self._out.pop(tid, None)
        for kind in ("deadline", "grace", "retry", "verdict"):
            if (handle := self._timers.pop((kind, None, tid), None)) is not None:
                handle.cancel()
        if run is None:
            return
        for job in run.jobs.values():
            job.confirmed()
        moved = next((run.jobs[j] for j in (Job.NCCL, Job.EAGER_NCCL, Job.TCP, Job.EAGER_TCP)
                      if j in run.jobs), None)
        self._record(run.link, "send", moved, "inline" if run.inline else "tcp", label,
                     run.source.nbytes, run.requested)
        if isinstance(result, KvdError) and not isinstance(result, Cancelled):
            log.info("transfer failed transfer_id=%d key=%s to=%s: [%s] %s", tid,
                     run.offer.key, run.link.address, result.code, result.message)
        settle_awaited(run.future, run.wake, result)

    # -------------------------------------------------------------- receives

    def _take(self, link: PeerLink, offer: Offer, pull: bool) -> m.TakeResult:
        """Where ``offer``'s bytes go; their receive queued (or, in the offer, copied)."""
        tid = offer.transfer_id
        eager = None
        if offer.channel:
            eager = self.routes.eager_receive(link, offer)
            if eager is None:
                return m.NoChannel()
        pulling = self._pulls.get(tid) if pull else None
        try:
            arrival = self.arrivals.place(
                offer, None if pulling is None else (pulling.region, pulling.blocks),
                str(eager.channel.device) if eager is not None else None)
        except NeverFits as err:
            return err
        except PoolExhausted:
            return m.NoRoom()
        except KvdError as err:
            return err
        if offer.inline:
            return self._land_inline(link, offer, arrival)
        try:
            route, accept = self.routes.for_receive(link, offer, arrival, eager)
            job = route.receive(offer, arrival)
        except KvdError as err:
            self.arrivals.arrival_failed(arrival, err)
            return err
        inbound = self._in[(link, tid)] = Inbound(arrival, job, offer.nbytes)
        # The job may start writing before its end is seen: hold the regions from now on.
        self._watch(job, inbound.regions, lambda result: self._act(
            self.machine.received(link, tid, result)), f"transfer {tid}")
        if arrival.waiter is not None:  # a cancelled get drops the rest (Engine.get)
            arrival.waiter.stop_delivery = job.discard
        return m.Receiving(accept, arrival.waiter is not None)

    def _land_inline(self, link: PeerLink, offer: Offer, arrival: Arrival) -> m.TakeResult:
        """An offer carrying its bytes: copied now, on the loop (at most
        MAX_INLINE_BYTES of host memory)."""
        if arrival.device.type != "cpu":
            err = BadRequest(f"the destination blocks are on {arrival.device}, and "
                             f"{link.address} sent host memory without NCCL")
            self.arrivals.arrival_failed(arrival, err)
            return err
        offered = time.monotonic()
        self.arrivals.land(arrival, offer.inline)
        timeline.mark("transfer.received")
        self.engine.metrics.transfer(
            peer=link.address, direction="recv", transport="inline", outcome="done",
            nbytes=offer.nbytes, queue_s=None, wire_s=time.monotonic() - offered)
        return m.Landed(offer.nbytes, arrival.waiter is not None)

    def _end_receive(self, link: PeerLink, tid: int, result: int | KvdError) -> None:
        inbound = self._in.pop((link, tid), None)
        if inbound is None:
            return
        if isinstance(result, KvdError):
            self.arrivals.arrival_failed(inbound.arrival, result)
            log.info("receive failed transfer_id=%d key=%s from=%s: [%s] %s", tid,
                     inbound.arrival.key, link.address, result.code, result.message)
            outcome = "cancelled" if isinstance(result, Cancelled) else "failed"
        else:
            timeline.mark("transfer.received")
            self.arrivals.arrived(inbound.arrival, result)
            outcome = "done"
        self._record(link, "recv", inbound.job, "", outcome, inbound.nbytes, inbound.offered)

    def _record(self, link: PeerLink, direction: str, job: Moving | None, transport: str,
                outcome: str, nbytes: int, asked: float) -> None:
        """A transfer's end in the metrics: its wait from ``asked`` to its job's start, and
        its job's time (``transport`` where it had no job)."""
        started = job.started_at if job is not None and job.started_at else None
        self.engine.metrics.transfer(
            peer=link.address, direction=direction,
            transport=job.transport if job is not None else transport, outcome=outcome,
            nbytes=nbytes, queue_s=None if started is None else started - asked,
            wire_s=None if started is None else time.monotonic() - started)

    # -------------------------------------------------------------- pulls we serve

    def _serve(self, link: PeerLink, req: PullRequest, until: float | None) -> None:
        """Claim a read of what a peer's pull asks for, and tell the machine."""
        now, item = self._loop.time(), None
        try:
            item = self.arrivals.readable(req.key, tuple(req.layout), req.num_blocks,
                                          req.share)
            source = Source(self.arrivals.source_blocks(item, req.share), tuple(req.layout),
                            req.num_blocks, [item.region] if item.region is not None else [])
            self.routes.check_gpu(link, source)  # (GPU bytes for a puller without NCCL)
        except KvdError as err:
            if item is not None:
                item.end_read()
            self._act(self.machine.claimed(link, req, err, now, until))
            return
        tid = req.transfer_id
        run = self._outbound(link, tid, req.key, source, None, now + self.config.max_wait_s)
        self._reads[tid] = item
        self._act(self.machine.claimed(link, req, self._send_of(run), now, until))

    # -------------------------------------------------------------- status

    def _watch(self, job: Moving, regions: Sequence[Region],
               then: Callable[[int | KvdError], None], what: str) -> None:
        """``then(what the job moved, or why not)`` on the loop once ``job`` ends, in a
        later turn; ``regions`` stay mapped until then."""
        ended = on_loop(job.future, cancels_job=False)
        self.engine.copies.hold_regions(regions, ended)

        def settled(fut: asyncio.Future[int]) -> None:
            if fut.cancelled():
                then(Cancelled(f"{what} stopped"))
            elif (exc := fut.exception()) is not None:
                then(exc if isinstance(exc, KvdError) else TransferFailed(f"{what}: {exc!r}"))
            else:
                then(fut.result())

        ended.add_done_callback(settled)

    @property
    def waiting_pulls(self) -> int:
        return len(self.machine.waiting)

    def in_flight(self) -> dict[str, tuple[int, int]]:
        """Transfers with peers in progress, by direction: how many, how many bytes."""
        return {"send": (len(self._out), sum(r.source.nbytes for r in self._out.values())),
                "recv": (len(self._in), sum(r.nbytes for r in self._in.values()))}

    def pending_tasks(self) -> list[asyncio.Task[Any]]:
        return [t for t in self._tasks if not t.done()]

    def stats(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.machine.counters), "in_flight_out": len(self._out),
                "in_flight_in": len(self._in), "pulls_waiting_for_key": self.waiting_pulls,
                "nccl": self.nccl.stats() if self.nccl is not None else None}


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11
        task.uncancel()
