"""Receiving from a peer: an OFFER answered, and its bytes taken in.

``Receiver.on_offer`` checks the offer (``TransferMachine.check_offer``), picks the
destination (``Arrivals``: the blocks of our pull it answers, a waiting get's, else pool
or GPU staging memory, else BUSY), queues the receive on its route
(``Routes.for_receive``) and ACCEPTs; ``_receive`` then waits for the bytes and answers
XFER_DONE or XFER_FAILED. An eager offer's bytes come whatever we answer: an NCCL one's are
received into staging and dropped, a TCP one's read and dropped, so that both ends of the
route stay in step.
"""

from __future__ import annotations

import asyncio
import time

from kvd import timeline
from kvd.daemon.futures import on_loop
from kvd.daemon.peer_link import PeerLink
from kvd.daemon.transfer.arrivals import Arrival
from kvd.daemon.transfer.context import (
    BUSY_RETRY_S,
    Pull,
    Receive,
    TransferPart,
    as_kvd_error,
    ended,
    log,
)
from kvd.daemon.transfer.machine import OfferFacts
from kvd.daemon.transfer.routes import NcclRoute
from kvd.errors import BadRequest, Cancelled, KvdError, PoolExhausted
from kvd.protocol import Busy, ChannelDown, Offer, XferDone, XferFailed


class Receiver(TransferPart):
    def on_offer(self, link: PeerLink, offer: Offer) -> None:
        if offer.inline:
            self._take_inline(link, offer)
            return
        duplicate = self.machine.receiving(link, offer.transfer_id)
        eager_nccl = None
        if offer.channel:
            eager_nccl = self._eager_route(link, offer)
            if eager_nccl is None:
                return  # answered: CHANNEL_DOWN and BUSY / REFUSE
        if self._answer_offer(link, offer, eager_nccl):
            return
        if eager_nccl is not None:
            self.counters.eager_nccl_dropped += 1
            # The sender queued the bytes with its offer (even under a duplicate id): take
            # them into staging and drop them, so the channel's two ends stay in step.
            eager_nccl.receive(offer, None)
        elif offer.eager and not duplicate:
            # Its bytes are on their way without waiting for our answer: drop them.
            route = self.routes.dropped_eager_tcp(link)
            if route is not None:
                route.receive(offer, None)

    def _eager_route(self, link: PeerLink, offer: Offer) -> NcclRoute | None:
        """The receive channel an eager OFFER's bytes are queued on. If we cannot take
        them there, say so — CHANNEL_DOWN, so the sender aborts its end (and the send
        waiting on it), then BUSY to offer again without a channel, or REFUSE — and
        return None."""
        tid = offer.transfer_id
        problem = self.machine.eager_offer_problem(offer, self.config.node_id)
        route = self.routes.eager_receive(link, offer) if problem is None else None
        if route is not None:
            return route
        reason = problem.message if problem else f"no live receive channel {offer.channel}"
        self.plane.send(link, ChannelDown(channel=offer.channel, reason=reason[:4000]))
        if problem is None:
            self.plane.send(link, Busy(transfer_id=tid, retry_after_s=0.0))
        else:
            self._refuse(link, tid, problem, "bad_offer")
            if (not self.machine.in_use(link, tid, self._waiting_pulls.holds(link, tid))
                    and self.machine.pull_of(link, tid) is not None):
                self._fail_pull(tid, problem)
        return None

    def _answer_offer(self, link: PeerLink, offer: Offer,
                      eager_nccl: NcclRoute | None = None) -> bool:
        """ACCEPT (True), or BUSY / REFUSE (False). ``eager_nccl``: the channel the bytes
        are already queued on (the receive goes there)."""
        tid = offer.transfer_id
        pull = self._pulls.get(tid) if self.machine.pull_of(link, tid) else None
        arrival = self._arrival(link, offer, pull, eager_nccl)
        if arrival is None:
            return False
        try:
            route, accept = self.routes.for_receive(link, offer, arrival, eager_nccl)
            job = route.receive(offer, arrival)
        except KvdError as err:
            self._refuse_offer(link, tid, err, pull, arrival)
            return False
        receive = Receive(tid, offer.key, link, arrival, job, offer.nbytes)
        # The job may start writing before _receive runs: hold the regions from now on.
        self.engine.copies.hold_regions(receive.regions, ended(job.future))
        if arrival.waiter is not None:  # a cancelled get drops the rest (Engine.get)
            arrival.waiter.stop_delivery = job.discard
        self._receives[(id(link), tid)] = receive
        self.machine.receive_begins(link, tid)
        self.plane.send(link, accept)
        self._spawn(self._receive(receive, pull))
        return True

    def _take_inline(self, link: PeerLink, offer: Offer) -> None:
        """An offer carrying its bytes: stored now, on the loop (at most MAX_INLINE_BYTES
        of host memory), and answered XFER_DONE, after the get they answer has replied."""
        tid = offer.transfer_id
        offered = time.monotonic()
        pull = self._pulls.get(tid) if self.machine.pull_of(link, tid) else None
        arrival = self._arrival(link, offer, pull)
        if arrival is None:
            return
        if arrival.device.type != "cpu":
            self._refuse_offer(link, tid, BadRequest(
                f"the destination blocks are on {arrival.device}, and {link.address} sent "
                "host memory without NCCL"), pull, arrival)
            return
        self.machine.receive_begins(link, tid)  # (a second offer for our pull: a duplicate)
        data, at = offer.inline, 0
        for view in arrival.wire_views():
            view[:] = data[at:at + len(view)]
            at += len(view)
        self.machine.receive_ends(link, tid)
        timeline.mark("transfer.received")
        self.counters.bytes_received += offer.nbytes
        self.arrivals.arrived(arrival, offer.nbytes)
        if pull is not None:
            pull.settle(offer.nbytes)
        # (call_soon: the get's task, woken by arrived, replies first; see _receive)
        self._loop.call_soon(self.plane.send, link,
                             XferDone(transfer_id=tid, nbytes=offer.nbytes))
        self.counters.count(self.counters.received, "done")
        self.engine.metrics.transfer(
            peer=link.address, direction="recv", transport="inline", outcome="done",
            nbytes=offer.nbytes, queue_s=None, wire_s=time.monotonic() - offered)

    def _arrival(self, link: PeerLink, offer: Offer, pull: Pull | None,
                 eager_nccl: NcclRoute | None = None) -> Arrival | None:
        """Where the offer's bytes go, or None once it is answered BUSY or REFUSE."""
        tid = offer.transfer_id
        layout = tuple(offer.layout)
        facts = OfferFacts(
            self.config.node_id, self.nccl is not None, self.engine.pool.capacity_bytes,
            get_waits=(offer.nbytes > self.engine.pool.capacity_bytes
                       and self.arrivals.get_waits_for(offer.key, layout, offer.num_blocks,
                                                       offer.first)))
        refusal = self.machine.check_offer(link, offer, facts,
                                           self._waiting_pulls.holds(link, tid))
        if refusal is not None:
            self._refuse(link, tid, refusal.error, refusal.bad)
            if refusal.fails_pull and pull is not None:
                self._fail_pull(tid, refusal.error)
            return None
        try:
            if pull is not None:
                arrival = self.arrivals.arrival_into(pull.state.key, pull.region, pull.blocks)
            else:
                # Bytes already queued on a channel land next to it, if anywhere on a GPU.
                staging = (str(eager_nccl.channel.device) if eager_nccl is not None
                           else self._staging_gpu() if offer.src_gpu else None)
                arrival = self.arrivals.arrival(offer.key, layout, offer.num_blocks,
                                                offer.ttl_s, gpu=staging, first=offer.first)
        except PoolExhausted:
            self.counters.busy_replies += 1
            self.plane.send(link, Busy(transfer_id=tid, retry_after_s=BUSY_RETRY_S))
            return None
        except KvdError as err:
            self._refuse_offer(link, tid, err, pull)
            return None
        return arrival

    def _refuse_offer(self, link: PeerLink, tid: int, err: KvdError, pull: Pull | None,
                      arrival: Arrival | None = None) -> None:
        """REFUSE an offer: the place made for its bytes (if any) is given back, and the
        pull of ours it answers fails."""
        if arrival is not None:
            self.arrivals.arrival_failed(arrival, err)
        self._refuse(link, tid, err)
        if pull is not None:
            self._fail_pull(tid, err)

    def _staging_gpu(self) -> str | None:
        """The GPU whose staging has the most room (arrivals nobody waits for yet)."""
        pools = self.engine.gpu_pools
        return max(pools, key=lambda d: pools[d].largest_free_bytes) if pools else None

    async def _receive(self, receive: Receive, pull: Pull | None) -> None:
        tid, link = receive.transfer_id, receive.link
        offered = time.monotonic()
        outcome = "failed"
        try:  # (a cancel leaves the job be: the regions are held until it ends)
            nbytes = await on_loop(receive.job.future, cancels_job=False)
            timeline.mark("transfer.received")
        except (asyncio.CancelledError, Exception) as exc:
            err = as_kvd_error(exc, f"transfer {tid}")
            outcome = "cancelled" if isinstance(err, Cancelled) else "failed"
            self.arrivals.arrival_failed(receive.arrival, err)
            log.info("receive failed transfer_id=%d key=%s from=%s: [%s] %s", tid,
                     receive.key, link.address, err.code, err.message)
            self.plane.send(link, XferFailed(transfer_id=tid, code=err.code,
                                             message=err.message))
            if pull is not None:
                pull.settle(err)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            outcome = "done"
            self.counters.bytes_received += nbytes
            self.arrivals.arrived(receive.arrival, nbytes)
            if pull is not None:
                pull.settle(nbytes)
            try:
                if receive.arrival.waiter is not None:
                    # The get these bytes answer replies first: its client is what a
                    # decode step waits for, and each send on a local socket costs its
                    # receiver's wake-up (~30-40 us on the CI machine); the sender's
                    # confirmation follows one turn of the loop later, as the get's task
                    # wakes at the next turn (Waiter.wake). (A pull's reply would need
                    # two turns: measured on the CI machine, no gain that stood out of
                    # its noise.)
                    await asyncio.sleep(0)
            finally:
                self.plane.send(link, XferDone(transfer_id=tid, nbytes=nbytes))
            log.debug("received transfer_id=%d key=%s from=%s bytes=%d", tid, receive.key,
                      link.address, nbytes)
        finally:
            self.counters.count(self.counters.received, outcome)
            self._receives.pop((id(link), tid), None)
            self.machine.receive_ends(link, tid)
            started = receive.job.started_at or None
            self.engine.metrics.transfer(
                peer=link.address, direction="recv", transport=receive.job.transport,
                outcome=outcome, nbytes=receive.nbytes,
                queue_s=None if started is None else started - offered,
                wire_s=None if started is None else time.monotonic() - started)
