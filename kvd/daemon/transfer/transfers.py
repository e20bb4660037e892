"""Transfers between daemons: the driver around the transfer machine.

``PeerTransfers`` is the driver of ``machine.TransferMachine``: it feeds it the peer's
messages and the transfers' events, carries out the actions it returns (hand a reply to a
send, queue bytes on a route, tell the peer), and runs our pulls. Its parts run the other
coroutines a transfer lives in: ``sending.Sender`` (a push), ``receiving.Receiver`` (an
offer and its bytes), ``serving.PullServer`` (a peer's pull); ``context`` holds what they
share. Bytes move on routes
(``routes``): our data connection or an NCCL channel, chosen by the ACCEPT for a send and
by the destination's memory for a receive.

The exchange. Sender: ``push`` offers the bytes (key, layout, block count, size). The
receiver picks the destination (``Arrivals``: a waiting get's blocks, else pool memory,
else BUSY), queues the receive on its route, and ACCEPTs. The sender then queues the bytes
on the route the ACCEPT names; the receiver answers XFER_DONE once they are in place (or
XFER_FAILED). BUSY makes the sender retry with backoff until its deadline, then fail with
``PoolExhausted``.

Eager sends skip the wait for the ACCEPT: host memory goes right behind its first offer on
the data connection; GPU memory, when an NCCL channel to the peer is live (and
``TransferMachine.may_send_eager_nccl`` allows), is queued on it as the OFFER (naming the
channel) goes out, and the receiver queues the matching receive when the OFFER arrives
whatever it answers: into the destination if it ACCEPTs, into staging and dropped if not.

Pull: the puller sends PULL_REQUEST with a transfer id; the owner claims a read of the key
and pushes it with that id; the puller recognises its id and takes the bytes into the
blocks it asked for. The pulls an owner serves at once are bounded, per peer and for all:
past that it refuses with the retriable PoolExhausted.

Every log line carries the transfer id and key. A lost link fails every transfer with that
peer (``PeerUnreachable``); late bytes never land in memory that was given back: discarded
receives drop their bytes, and a cancelled send waits for its bytes. A cancel never
contradicts the receiver: a push cancelled once all its bytes went reports what the
receiver answers to its XFER_CANCEL (``_verdict``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch

from kvd.daemon.engine import Engine
from kvd.daemon.futures import wait_out
from kvd.daemon.peer_link import CPU_DEVICE, PeerLink
from kvd.daemon.peers import PeerPlane
from kvd.daemon.transfer.context import (
    Pull,
    TransferContext,
    TransferPart,
    log,
    new_id,
)
from kvd.daemon.transfer.leasing import Leasing
from kvd.daemon.transfer.machine import (
    Action,
    Answer,
    Count,
    Deliver,
    Discard,
    EagerTcpAccepted,
    FailPull,
    PullState,
    SendZeros,
    StartSend,
    StopEagerTcp,
    Tell,
)
from kvd.daemon.transfer.nccl_links import NcclLinks
from kvd.daemon.transfer.receiving import Receiver
from kvd.daemon.transfer.routes import Source
from kvd.daemon.transfer.sending import Sender
from kvd.daemon.transfer.serving import PullServer
from kvd.errors import KvdError, KvdTimeout
from kvd.memory.regions import Region
from kvd.protocol import (
    ALL,
    Accept,
    Busy,
    ChannelDown,
    ChannelWarm,
    LeaseAnswer,
    LeaseRelease,
    LeaseRenew,
    Offer,
    PeerMessage,
    PullRequest,
    Refuse,
    Share,
    XferCancel,
    XferDone,
    XferFailed,
)
from kvd.transport.chunks import BlockSet


class PeerTransfers(TransferPart):
    def __init__(self, engine: Engine, plane: PeerPlane, nccl: NcclLinks | None = None
                 ) -> None:
        super().__init__(TransferContext(engine, plane, nccl))
        self.sender = Sender(self.ctx)
        self.receiver = Receiver(self.ctx)
        self.server = PullServer(self.ctx, self.sender)
        engine.key_listeners.append(self.server.key_appeared)
        self.leasing = Leasing(self.ctx, engine.leases)
        engine.leases.remote = self.leasing
        engine.leases.gone_listeners.append(self.server.key_went)

    @property
    def address(self) -> str:
        return self.plane.address

    async def push_blocks(self, key: str, region: Region, idx: torch.Tensor, to: str,
                          ttl_s: float | None, timeout_s: float, first: int = 0) -> int:
        """A client's put to another daemon (``idx``: the key's blocks from ``first`` on)."""
        return await self.sender.push_blocks(key, region, idx, to, ttl_s, timeout_s, first)

    # ------------------------------------------------------------ actions

    def _act(self, link: PeerLink, actions: list[Action[PeerLink]]) -> None:
        """Carry out what the machine decided, in its order."""
        for action in actions:
            match action:
                case Deliver(tid, reply):
                    self._deliver(tid, reply)
                case StartSend(tid, accept):
                    self.sender.start_accepted(link, tid, accept)
                case EagerTcpAccepted(tid, accept):
                    push = self._pushes[tid]
                    push.tcp_job = push.eager_tcp
                    push.replies.put_nowait(accept)
                case SendZeros(gone, accept):
                    self.sender.send_zeros(gone.link, gone.src_dev, accept, Source(
                        None, gone.layout, gone.num_blocks))
                case StopEagerTcp(tid):
                    push = self._pushes[tid]
                    if push.eager_tcp is not None:
                        push.eager_tcp.halt()
                case Tell(to, message):
                    self.plane.send(to, message)
                case FailPull(tid, error):
                    self._fail_pull(tid, error)
                case Discard(tid):
                    receive = self._receives.get((id(link), tid))
                    if receive is not None:
                        receive.job.discard()
                case Count(kind, tid):
                    self._count_bad(kind)
                    log.info("message for unknown transfer_id=%d from %s ignored", tid,
                             link.address)

    def _deliver(self, tid: int, reply: Answer | KvdError) -> None:
        push = self._pushes.get(tid)
        if push is not None:
            push.replies.put_nowait(reply)

    # ------------------------------------------------------------ pulling

    async def pull(self, key: str, src: str, region: Region, idx: torch.Tensor,
                   timeout_s: float, wait_for_key_s: float = 0.0, share: Share = ALL,
                   ) -> int:
        link = await self.plane.link_to(src, timeout_s)
        if self.engine.draining:  # (it may have begun while we linked) nothing waits
            wait_for_key_s = 0.0
        tid = new_id()
        pull = Pull(PullState(key, link, region.layout, len(idx)), region,
                    self._loop.create_future(), BlockSet(region.tensors, idx.numpy()))
        self._pulls[tid] = pull
        self.machine.pull_begins(tid, pull.state)
        try:
            self.plane.send(link, PullRequest(transfer_id=tid, key=key, dst_dev=CPU_DEVICE,
                                              num_blocks=len(idx), layout=list(region.layout),
                                              wait_for_key_s=wait_for_key_s, share=share))
            # While the request is out (a round trip, and the owner's work): what the
            # receive needs of the destination, so that it is not made once bytes come.
            self.engine.prepare_gpu_blocks(pull.blocks, region.layout)

            def lost(_link: PeerLink, err: KvdError) -> None:
                pull.settle(err)

            link.on_lost.append(lost)
            try:
                async with asyncio.timeout(timeout_s):
                    return await pull.wake
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
            receive = self._receives.get((id(link), tid))
            if receive is not None:
                receive.job.discard()
                await wait_out(pull.future, 60.0)
            raise
        finally:
            self._pulls.pop(tid, None)
            self.machine.pull_ends(tid)

    # ------------------------------------------------------------ messages

    def on_message(self, link: PeerLink, msg: PeerMessage) -> None:
        self.engine.busy_poll.touch()
        if isinstance(msg, Offer):
            self.receiver.on_offer(link, msg)
        elif isinstance(msg, PullRequest):
            self.server.on_pull_request(link, msg)
        elif isinstance(msg, XferCancel):
            self._waiting_pulls.drop(link, msg.transfer_id)
            self._act(link, self.machine.on_cancel(link, msg.transfer_id))
        elif isinstance(msg, ChannelDown):
            if self.nccl is not None:
                self.nccl.on_channel_down(link, msg)
        elif isinstance(msg, ChannelWarm):
            if self.nccl is not None:
                self.nccl.on_channel_warm(link, msg)
            else:
                self.plane.send(link, ChannelDown(channel=msg.channel, reason=(
                    f"{self.config.node_id} has no NCCL")))
        elif isinstance(msg, Accept | Busy | Refuse | XferDone | XferFailed):
            self._act(link, self.machine.on_answer(link, msg))
        elif isinstance(msg, LeaseRenew | LeaseRelease | LeaseAnswer):
            self.leasing.on_message(link, msg)

    def on_link_up(self, link: PeerLink) -> None:
        if self.nccl is not None:
            self.nccl.warm_up(link)

    def on_link_lost(self, link: PeerLink, error: KvdError) -> None:
        """Everything of the link ends with it: its waiting pulls are dropped, its sends
        fail (their tasks end, releasing their reads), its receives fail as their channels
        are aborted, and offers given up are forgotten."""
        self._waiting_pulls.drop_link(link)
        self._act(link, self.machine.on_link_lost(link, error))
        if self.nccl is not None:
            self.nccl.on_link_lost(link, error)

    def refuse_waiting_pulls(self, err: KvdError) -> int:
        """Draining: the pulls our clients made that no owner has answered yet (they may
        be waiting there for their key), and the peers' pulls waiting here for a key, fail
        now, as gets waiting for a key do. Returns how many."""
        refused = self.server.refuse_waiting(err)
        for tid in list(self.machine.pulls_not_offered()):
            pull = self._pulls.get(tid)
            if pull is not None and not pull.future.done():
                pull.settle(err)  # (its task tells the owner: XferCancel)
                refused += 1
        return refused

    # ------------------------------------------------------------ status

    @property
    def waiting_pulls(self) -> int:
        return len(self._waiting_pulls)

    def in_flight(self) -> dict[str, tuple[int, int]]:
        """Transfers with peers in progress, by direction: how many, how many bytes."""
        return {"send": (len(self._pushes),
                         sum(p.state.nbytes for p in self._pushes.values())),
                "recv": (len(self._receives),
                         sum(r.nbytes for r in self._receives.values()))}

    def pending_tasks(self) -> list[asyncio.Task[Any]]:
        return [t for t in self.ctx.tasks if not t.done()]

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"sent": dict(c.sent), "received": dict(c.received),
                "bytes_sent": c.bytes_sent, "bytes_received": c.bytes_received,
                "busy_replies": c.busy_replies, "in_flight_out": len(self._pushes),
                "pulls_waiting_for_key": self.waiting_pulls,
                "eager_nccl_sent": c.eager_nccl_sent,
                "eager_nccl_dropped": c.eager_nccl_dropped,
                "in_flight_in": len(self._receives),
                "nccl": self.nccl.stats() if self.nccl is not None else None}
