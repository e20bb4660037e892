"""Sending to a peer: a client's put, or a pull we serve, from OFFER to the receiver's answer.

``Sender.push`` offers the bytes and, once the receiver ACCEPTs, they go on the route the
ACCEPT names (``start_accepted``, called in message order); it ends with the receiver's
XFER_DONE or XFER_FAILED. BUSY makes it offer again with backoff until its deadline, then
fail with ``PoolExhausted``. Eager offers send first: host memory right behind the first
offer on the data connection, GPU memory on a live NCCL channel as the offer goes out
(when ``TransferMachine.may_send_eager_nccl`` allows). A cancel never contradicts the
receiver: a push cancelled once all its bytes went reports what the receiver answers to
its XFER_CANCEL (``_verdict``), and no byte is read from the client's blocks after it
returns (``_wait_started``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import torch

from kvd import timeline
from kvd.daemon.futures import on_loop, wait_out
from kvd.daemon.peer_link import CPU_DEVICE, PeerLink
from kvd.daemon.transfer.context import (
    BUSY_RETRY_S,
    Push,
    TransferPart,
    ended,
    log,
    new_id,
    uncancel,
)
from kvd.daemon.transfer.machine import Answer, Outgoing, channel_down
from kvd.daemon.transfer.routes import Moving, Source
from kvd.errors import (
    KvdError,
    KvdTimeout,
    PoolExhausted,
    ProtocolError,
    TransferFailed,
    error_from_code,
)
from kvd.memory.regions import Region
from kvd.protocol import (
    MAX_INLINE_BYTES,
    Accept,
    Busy,
    Offer,
    Refuse,
    XferCancel,
    XferDone,
    XferFailed,
)
from kvd.transport.chunks import BlockSet

MAX_BACKOFF_S = 1.0


class Sender(TransferPart):
    def start_accepted(self, link: PeerLink, tid: int, accept: Accept) -> None:
        """An ACCEPT starts the send at once, in message order (the pusher's coroutine
        would wake later): the receiver queued its side in that order."""
        push = self._pushes[tid]
        out = push.state
        try:
            route = self.routes.accepted_send(link, out.src_dev, accept, push.tcp)
            job = route.send(tid, push.source, push.deadline)
        except KvdError as err:
            if accept.channel:
                self.plane.send(link, channel_down(link, accept, err).message)
            out.accepted = False
            push.replies.put_nowait(err)
            return
        if accept.channel:
            push.nccl_job = job
        else:
            push.tcp_job = job
        self._send_started(push, job)
        push.replies.put_nowait(accept)

    def send_zeros(self, link: PeerLink, src_dev: str, accept: Accept, zeros: Source
                   ) -> None:
        """Still send (zeros) for an NCCL offer given up, so the receiver is not left
        waiting on its channel."""
        try:
            route = self.routes.accepted_send(link, src_dev, accept, None)
            route.send(accept.transfer_id, zeros,
                       self._loop.time() + self.routes.receive_timeout(0))
        except KvdError as err:
            self.plane.send(link, channel_down(link, accept, err).message)

    def _send_started(self, push: Push, job: Moving) -> None:
        """A send job now reads the client's regions: they stay mapped until it ends."""
        self.engine.copies.hold_regions(push.source.regions, ended(job.future))

    async def push_blocks(self, key: str, region: Region, idx: torch.Tensor, to: str,
                          ttl_s: float | None, timeout_s: float, first: int = 0) -> int:
        """A client's put to another daemon: ``idx``, the key's blocks from ``first`` on
        (its reader has the ones before)."""
        deadline = self._loop.time() + timeout_s
        link = await self.plane.link_to(to, timeout_s)
        source = Source(BlockSet(region.tensors, idx.numpy()), region.layout, len(idx),
                        [region])
        return await self.push(link, new_id(), key, source, ttl_s, deadline, first)

    async def push(self, link: PeerLink, tid: int, key: str, source: Source,
                   ttl_s: float | None, deadline: float, first: int = 0) -> int:
        self._check_gpu_route(link, source)
        nccl = self.nccl is not None and any(d.startswith("cuda") for d in link.devices)
        out = Outgoing(tid, key, link, source.layout, source.num_blocks,
                       from_gpu=source.gpu is not None, nccl=nccl,
                       src_dev=(source.gpu or self.plane.gpus[0]) if nccl else CPU_DEVICE)
        push = Push(out, source, deadline, first)
        self._pushes[tid] = push
        self.machine.send_begins(out)
        nbytes = source.nbytes
        outcome = "failed"
        requested = time.monotonic()
        try:
            nbytes = await self._push_bytes(push, ttl_s)
            outcome = "done"
            return nbytes
        except asyncio.CancelledError:
            outcome = "cancelled"
            if await self._kept_though_cancelled(push):
                outcome = "done"
                return nbytes
            raise
        except TimeoutError:
            outcome = "timeout"
            self._give_up(push)
            await self._wait_started(push)
            raise KvdTimeout(f"transfer {tid} of key {key!r} to {link.address} missed its "
                             "deadline") from None
        except KvdError as exc:
            log.info("transfer failed transfer_id=%d key=%s to=%s: [%s] %s", tid, key,
                     link.address, exc.code, exc.message)
            await self._wait_started(push)
            raise
        finally:
            self._push_ended(push, outcome, nbytes, requested)

    async def _push_bytes(self, push: Push, ttl_s: float | None) -> int:
        out, link = push.state, push.state.link
        # Small host memory to a peer that takes it over TCP: the bytes go in the offer,
        # and no data connection, thread or ACCEPT is in their way.
        inline = (push.source.gpu is None and not out.nccl
                  and out.nbytes <= MAX_INLINE_BYTES)
        if push.source.gpu is None and not inline:  # TCP may be chosen
            async with asyncio.timeout_at(push.deadline):
                push.tcp = self.routes.tcp_send(await self.plane.send_channel(link))
            out.tcp_ready = True
        answer = await self._offer_until_accepted(push, ttl_s, inline)
        if isinstance(answer, XferDone):  # the inline offer's bytes are stored
            return self._sent(push)
        job = push.nccl_job or push.tcp_job  # started when the ACCEPT came (_act)
        if job is None:
            raise ProtocolError(f"{link.address} accepted, but no transport started")
        try:  # (the regions are held since the job was queued: _send_started)
            await on_loop(job.future, cancels_job=False)
            timeline.mark("transfer.sent")
        except asyncio.CancelledError:
            if job.halt() and job.future.cancelled():
                raise  # not started: nothing was sent
            # On the wire: TCP stops at the next chunk, an NCCL transfer runs to its end
            # (the receiver waits for it); wait, so that no byte is read from the
            # client's blocks after we answer.
            afut = ended(job.future)
            await wait_out(afut, 60.0)
            if not afut.done() or afut.cancelled() or afut.exception() is not None:
                raise asyncio.CancelledError from None
            # Every byte had gone out before the stop was seen: the transfer completes,
            # and its result, not a cancellation, is the truth.
            uncancel()
        reply = await self._reply(push, "the receiver's confirmation")
        if isinstance(reply, XferFailed):
            raise error_from_code(reply.code, f"receiver {link.address}: {reply.message}")
        if not isinstance(reply, XferDone):
            raise ProtocolError(f"unexpected {type(reply).__name__} after the bytes")
        return self._sent(push)

    def _sent(self, push: Push) -> int:
        out, link = push.state, push.state.link
        self.counters.bytes_sent += out.nbytes
        log.debug("transfer done transfer_id=%d key=%s to=%s bytes=%d", out.transfer_id,
                  out.key, link.address, out.nbytes)
        return out.nbytes

    async def _kept_though_cancelled(self, push: Push) -> bool:
        """A cancelled push: True if the receiver kept every byte anyway (the push then
        completes); False to let the cancel through; TransferFailed if it never said."""
        out = push.state
        self._give_up(push)
        await self._wait_started(push)
        if not self.machine.may_have_arrived(out, _may_have_sent(push.tcp_job),
                                             _may_have_sent(push.eager_tcp),
                                             _may_have_sent(push.nccl_job)):
            return False
        # Every byte may have reached the receiver, which keeps them unless our
        # XFER_CANCEL came first: its answer, not the cancel, says what happened.
        kept = await self._verdict(push)
        if kept is False:
            return False
        uncancel()
        if kept is None:
            raise TransferFailed(
                f"transfer {out.transfer_id} of key {out.key!r} was cancelled after its "
                f"bytes went, and {out.link.address} did not say whether it kept them"
            ) from None
        self.counters.bytes_sent += out.nbytes
        log.info("transfer done though cancelled (the receiver had every byte) "
                 "transfer_id=%d key=%s to=%s bytes=%d", out.transfer_id, out.key,
                 out.link.address, out.nbytes)
        return True

    def _push_ended(self, push: Push, outcome: str, nbytes: int, requested: float) -> None:
        out = push.state
        self.counters.count(self.counters.sent, outcome)
        if self._pushes.get(out.transfer_id) is push:
            del self._pushes[out.transfer_id]
        for job in push.jobs():
            job.confirmed()
        if self.machine.send_ends(out):  # an ACCEPT may still come: remembered a while
            self._loop.call_later(max(60.0, self.config.peer_grace_s * 4),
                                  self.machine.forget_abandoned, out.transfer_id)
        moved = push.nccl_job or push.tcp_job or push.eager_tcp
        started = moved.started_at if moved is not None and moved.started_at else None
        self.engine.metrics.transfer(
            peer=out.link.address, direction="send",
            transport=(moved.transport if moved is not None
                       else "inline" if out.inline else "tcp"), outcome=outcome,
            nbytes=nbytes, queue_s=None if started is None else started - requested,
            wire_s=None if started is None else time.monotonic() - started)

    def _offer(self, push: Push, ttl_s: float | None) -> Offer:
        out = push.state
        return Offer(transfer_id=out.transfer_id, key=out.key, src_dev=out.src_dev,
                     dst_dev="any", nbytes=out.nbytes, num_blocks=out.num_blocks,
                     layout=list(out.layout), ttl_s=ttl_s, src_gpu=out.from_gpu,
                     one_run=out.from_gpu and push.source.blocks is not None
                     and push.source.blocks.one_run(), first=push.first)

    def _send_inline(self, push: Push, offer: Offer) -> None:
        """Send ``offer`` with the bytes in it, read from the client's blocks as it is
        encoded: one view (a run of blocks) goes to the encoder as it is, several are
        joined first. Nothing of the bytes is kept while the answer is awaited: 64 sends
        in flight would otherwise hold a copy each, of up to 64 KiB."""
        assert push.source.blocks is not None
        views = push.source.blocks.views()
        payload = views[0] if len(views) == 1 else memoryview(b"".join(views))
        self.plane.send(push.state.link, msgspec.structs.replace(offer, inline=payload))

    async def _offer_until_accepted(self, push: Push, ttl_s: float | None,
                                    inline: bool = False) -> Accept | XferDone:
        """Offer until the receiver takes the bytes: its ACCEPT, or, for an ``inline``
        offer, its XFER_DONE."""
        out, link = push.state, push.state.link
        backoff = BUSY_RETRY_S
        offer = self._offer(push, ttl_s)
        # Host memory to a peer that will take it over TCP anyway: the bytes go right
        # behind the first offer, and the ACCEPT round trip leaves the critical path.
        eager_tcp = push.tcp is not None and out.src_dev == CPU_DEVICE
        while True:
            chunk = self.config.nccl_chunk_bytes
            route = (None if eager_tcp or inline
                     or not self.machine.may_send_eager_nccl(out, chunk)
                     else self.routes.eager_send(link, out.src_dev))
            if inline:
                self._send_inline(push, offer)
                self.machine.offered(out, inline=True)
                timeline.mark("transfer.sent")
            elif route is not None:
                # Queued now, in OFFER order: the receiver queues its side when the OFFER
                # arrives, whatever it answers (see may_send_eager_nccl for why the
                # orders match).
                self.plane.send(link, msgspec.structs.replace(
                    offer, dst_dev=str(route.channel.device), channel=route.channel_id,
                    chunk_bytes=chunk))
                self.machine.offered(out, eager_channel=route.channel_id)
                self.counters.eager_nccl_sent += 1
                push.nccl_job = route.send(out.transfer_id, push.source, push.deadline)
                self._send_started(push, push.nccl_job)
            elif eager_tcp:
                assert push.tcp is not None
                self.plane.send(link, msgspec.structs.replace(offer, eager=True))
                self.machine.offered(out, eager_tcp=True)
                push.eager_tcp = push.tcp.send(out.transfer_id, push.source, push.deadline,
                                               eager=True)
                self._send_started(push, push.eager_tcp)
                eager_tcp = False  # a retry after BUSY waits for its ACCEPT
            else:
                self.plane.send(link, offer)
                self.machine.offered(out)
                blocks = push.source.blocks
                if push.source.gpu is not None and blocks is not None and not offer.one_run:
                    # The copy kernel's map of the blocks to gather, made while the offer
                    # is out instead of after the ACCEPT (see Engine.get for the receiver).
                    blocks.block_map(blocks.tensors[0].device)
            reply = await self._reply(push, "an answer to the offer")
            if isinstance(reply, Accept) or (inline and isinstance(reply, XferDone)):
                return reply
            if isinstance(reply, Refuse | XferFailed):
                raise error_from_code(reply.code, f"{link.address} refused: {reply.message}")
            if not isinstance(reply, Busy):
                raise ProtocolError(f"unexpected {type(reply).__name__} in answer to an offer")
            self.counters.busy_replies += 1
            if out.eager_channel:
                # The receiver drops the bytes already queued; offer again, without
                # sending first, once they are out (at once if it lacked the channel).
                await self._eager_send_ended(push)
                if reply.retry_after_s == 0:
                    continue
            wait = min(max(backoff, reply.retry_after_s), MAX_BACKOFF_S)
            if self._loop.time() + wait >= push.deadline:
                raise PoolExhausted(f"{link.address} had no room for {out.nbytes} bytes of "
                                    f"key {out.key!r} before the deadline")
            log.debug("receiver busy transfer_id=%d key=%s retry_in=%.2fs",
                      out.transfer_id, out.key, wait)
            await asyncio.sleep(wait)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _eager_send_ended(self, push: Push) -> None:
        """Wait for a send the receiver will drop (it answered BUSY), then forget it."""
        job = push.nccl_job
        if job is not None:
            left = max(1.0, push.deadline - self._loop.time()) + 1.0
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(on_loop(job.future)), left)
            job.confirmed()
        push.nccl_job = None
        self.machine.eager_nccl_dropped(push.state)

    async def _wait_started(self, push: Push) -> None:
        """A send the ACCEPT started must end before the pusher answers: no byte may be
        read from the client's blocks after that. TCP stops at the next chunk; NCCL runs
        to its end (or its deadline)."""
        for job in push.jobs():
            if job.future.done() or job.halt():
                continue
            await wait_out(ended(job.future), 60.0)

    def _give_up(self, push: Push) -> None:
        self.plane.send(push.state.link, XferCancel(transfer_id=push.state.transfer_id))

    async def _verdict(self, push: Push) -> bool | None:
        """Whether the receiver kept the bytes of a transfer we cancelled after they went:
        True (XFER_DONE), False (XFER_FAILED, or BUSY / REFUSE of the offer they went
        with), None (no answer in time, or the link went). The receiver answers at once
        (an ACCEPT first, if that was still to come); another cancel does not stop this
        bounded wait, as the answer decides what the transfer reports."""
        until = max(push.deadline, self._loop.time() + 2 * self.config.peer_grace_s)
        while True:
            try:
                async with asyncio.timeout_at(until):
                    reply = await push.replies.get()
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

    async def _reply(self, push: Push, what: str) -> Answer:
        out = push.state
        try:
            async with asyncio.timeout_at(push.deadline):
                reply = await push.replies.get()
        except TimeoutError:
            raise KvdTimeout(f"transfer {out.transfer_id} of key {out.key!r}: no {what} from "
                             f"{out.link.address} before the deadline") from None
        if isinstance(reply, KvdError):
            raise reply
        return reply


def _may_have_sent(job: Moving | None) -> bool | None:
    """None: no such job; else whether it may have sent every byte (ran to its end, or
    has not ended)."""
    if job is None:
        return None
    fut = job.future
    return not fut.done() or (not fut.cancelled() and fut.exception() is None)
