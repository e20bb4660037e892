"""The transfer machine: what each OFFER, ACCEPT, BUSY, REFUSE, DONE and FAILED means, sans I/O.

``TransferMachine`` holds the protocol state of every transfer with a peer — our sends
(``Outgoing``), our pulls (``PullState``), the receives in progress, the pulls we serve,
and the NCCL offers given up before their answer — and decides what each event means.
Events go in as method calls; what must happen comes out as actions (``Deliver``,
``StartSend``, ``SendZeros``, ``Tell``, ``FailPull``, ``StopEagerTcp``, ``Discard``, ``Count``)
that the driver (``transfers.PeerTransfers``) carries out. Nothing here awaits, sends, or
touches memory, so every interleaving the protocol allows is a unit test
(tests/test_transfer_machine.py).

The eager-ordering rule lives here (``may_send_eager_nccl``): GPU bytes queued on an NCCL
channel together with their OFFER must meet the receiver's matching receive in the same
place of that channel's order as on our side.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvd.errors import (
    BadRequest,
    Cancelled,
    KvdError,
    PoolExhausted,
    ProtocolError,
    error_from_code,
)
from kvd.memory.regions import Layout
from kvd.protocol import Accept, Busy, ChannelDown, Offer, Refuse, XferDone, XferFailed
from kvd.transport.views import wire_bytes

CPU_DEVICE = "cpu"
MIN_NCCL_CHUNK_BYTES, MAX_NCCL_CHUNK_BYTES = 2**20, 2**31  # an eager offer's, checked
# Pulls of one peer served at once (each a task pushing its key, holding a read of it until
# the push ends, up to max_wait_s; ~15 KiB): past it the peer's next pull is refused with
# the retriable PoolExhausted. As many as max_waiting_pulls by default, and never fewer
# than it: the pulls waiting for their keys are served together when the keys appear.
MAX_PULLS_SERVED_PER_LINK = 4096
# And all peers' together, in links at their most (~250 MiB): links are bounded too
# (MAX_LINKS), but 256 at their most would hold gigabytes.
_LINKS_AT_THEIR_MOST = 4

Answer = Accept | Busy | Refuse | XferDone | XferFailed


class Link(Protocol):
    """The machine's view of a peer link: who it is (its identity keys the transfers)."""

    address: str


L = TypeVar("L", bound=Link)


@dataclass(eq=False)
class Outgoing(Generic[L]):
    """The protocol state of one send (a client's put, or a pull we serve)."""

    transfer_id: int
    key: str
    link: L
    layout: Layout
    num_blocks: int
    from_gpu: bool  # the source blocks are GPU memory (they go only over NCCL)
    nccl: bool  # offered with our end of an NCCL channel (src_dev is a GPU)
    src_dev: str = CPU_DEVICE
    tcp_ready: bool = False  # our data connection to the peer is up: TCP may be chosen
    eager_tcp: bool = False  # bytes went behind the first offer on the data connection
    eager_answered: bool = False  # ... and that offer has its answer
    eager_channel: int = 0  # the NCCL channel the bytes were queued on with the offer
    no_eager: bool = False  # after a BUSY: offer again without sending first
    offer_pending: bool = False  # an offer is out and not answered yet
    accepted: bool = False  # the receiver ACCEPTed: it waits for the bytes (inline: has them)
    inline: bool = False  # the bytes went in the offer itself (Offer.inline)
    nbytes: int = field(init=False)  # read several times per send: summed once

    def __post_init__(self) -> None:
        self.nbytes = wire_bytes(self.layout, self.num_blocks)


@dataclass(eq=False)
class PullState(Generic[L]):
    """One of our pulls: the owner it asked, and whether its OFFER came."""

    key: str
    link: L
    layout: Layout
    num_blocks: int
    offered: bool = False  # bytes are (about to be) on their way


@dataclass(frozen=True)
class Abandoned(Generic[L]):
    """An NCCL offer given up before its answer: an ACCEPT may still come, and the receiver
    then waits for the bytes on its channel (we send zeros)."""

    link: L
    layout: Layout
    num_blocks: int
    src_dev: str


# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class Deliver:
    """Hand ``reply`` (a peer's answer, or an error) to the send ``transfer_id``."""

    transfer_id: int
    reply: Answer | KvdError


@dataclass(frozen=True)
class StartSend:
    """Queue the send's bytes on the route the ACCEPT chose, now, in message order; then
    deliver the ACCEPT (or, if the route cannot take them, tell the peer ``ChannelDown``
    for an NCCL one and deliver the error)."""

    transfer_id: int
    accept: Accept


@dataclass(frozen=True)
class EagerTcpAccepted:
    """The ACCEPT answers the eager offer: the bytes already on the data connection are
    the transfer's; deliver the ACCEPT."""

    transfer_id: int
    accept: Accept


@dataclass(frozen=True)
class SendZeros(Generic[L]):
    """An ACCEPT for an NCCL offer given up: send zeros, so the receiver is not left
    waiting on its channel."""

    gone: Abandoned[L]
    accept: Accept


@dataclass(frozen=True)
class StopEagerTcp:
    """The receiver dropped the eager bytes (BUSY / REFUSE): stop sending them."""

    transfer_id: int


@dataclass(frozen=True)
class Tell(Generic[L]):
    link: L
    message: ChannelDown | Refuse | Busy


@dataclass(frozen=True)
class FailPull:
    transfer_id: int
    error: KvdError


@dataclass(frozen=True)
class Discard:
    """A receive nobody wants any more: its bytes, if they come, are dropped."""

    transfer_id: int


@dataclass(frozen=True)
class Count:
    """A message the machine ignored, counted as a bad message of ``kind``."""

    kind: str
    transfer_id: int = 0


Action = (Deliver | StartSend | EagerTcpAccepted | SendZeros[L] | StopEagerTcp | Tell[L]
          | FailPull | Discard | Count)


@dataclass(frozen=True)
class Refusal:
    """Why an offer is refused: the error the REFUSE carries, the bad-message kind to count
    (None: a fair offer this daemon cannot serve), and whether the pull it answers fails
    (not for a duplicate id: bytes may be landing for that pull)."""

    error: KvdError
    bad: str | None = "bad_offer"
    fails_pull: bool = True


@dataclass
class OfferFacts:
    """What the daemon knows that decides whether an offer can be taken at all."""

    node_id: str
    has_nccl: bool
    pool_capacity_bytes: int
    get_waits: bool  # a get waits for the key (its blocks are the room)


def channel_down(link: L, accept: Accept, err: KvdError) -> Tell[L]:
    """What tells the receiver of an ACCEPT whose bytes cannot go that it should drop the
    channel it queued its receive on."""
    return Tell(link, ChannelDown(channel=accept.channel, reason=(
        f"the sender could not send transfer {accept.transfer_id}: {err.message}")[:4000]))


# ------------------------------------------------------------------ the machine


@dataclass
class TransferMachine(Generic[L]):
    has_nccl: bool
    max_waiting_pulls: int = 0
    outgoing: dict[int, Outgoing[L]] = field(default_factory=dict)
    pulls: dict[int, PullState[L]] = field(default_factory=dict)
    abandoned: dict[int, Abandoned[L]] = field(default_factory=dict)
    # Receives in progress and the pulls we serve, by (id(link), transfer id): a peer picks
    # its own ids, so two peers may use one.
    incoming: set[tuple[int, int]] = field(default_factory=set)
    serving: set[tuple[int, int]] = field(default_factory=set)
    served: dict[int, int] = field(default_factory=dict)  # id(link) -> pulls served now
    served_all: int = 0

    @property
    def max_served(self) -> int:
        return max(MAX_PULLS_SERVED_PER_LINK, self.max_waiting_pulls)

    @property
    def max_served_all(self) -> int:
        return _LINKS_AT_THEIR_MOST * self.max_served

    # -------------------------------------------------------------- sends

    def send_begins(self, out: Outgoing[L]) -> None:
        self.outgoing[out.transfer_id] = out

    def may_send_eager_nccl(self, out: Outgoing[L], chunk_bytes: int) -> bool:
        """Whether this GPU send may be queued on an NCCL channel together with its OFFER.

        Both ends must run a channel's jobs in the same order. Plain offers queue at the
        ACCEPT (the receiver when it sends it, we when it arrives), eager ones at the OFFER
        (we when we send it, the receiver when it arrives). Mixed freely the orders can
        differ: an eager offer sent after ACCEPT 0 arrived, while the receiver had already
        accepted a plain offer 2 on the same channel, queues 0, 1, 2 here and 0, 2, 1 there.
        So: eager only when no plain NCCL offer to this peer is unanswered (nor one given
        up whose answer may still come). Then every plain job answered earlier is queued
        before ours on both ends, and every later one after it."""
        if (not self.has_nccl or not out.from_gpu or out.no_eager
                or not MIN_NCCL_CHUNK_BYTES <= chunk_bytes <= MAX_NCCL_CHUNK_BYTES):
            return False
        link = out.link
        if any(o is not out and o.link is link and o.offer_pending and not o.eager_channel
               and o.nccl for o in self.outgoing.values()):
            return False
        return not any(gone.link is link for gone in self.abandoned.values())

    def offered(self, out: Outgoing[L], eager_channel: int = 0, eager_tcp: bool = False,
                inline: bool = False) -> None:
        """An OFFER went out (with its bytes queued on ``eager_channel`` / the data
        connection, if eager; in it, if ``inline``)."""
        out.offer_pending = True
        out.eager_channel = eager_channel
        out.inline = inline
        if eager_tcp:
            out.eager_tcp, out.eager_answered = True, False

    def eager_nccl_dropped(self, out: Outgoing[L]) -> None:
        """The receiver answered BUSY to an eager NCCL offer and drops its bytes: offer
        again without sending first."""
        out.eager_channel, out.no_eager = 0, True

    def send_ends(self, out: Outgoing[L]) -> bool:
        """The send is over. True if its NCCL offer is still unanswered: it is remembered
        (``abandoned``) until ``forget_abandoned``, as an ACCEPT may still come."""
        if self.outgoing.get(out.transfer_id) is out:
            del self.outgoing[out.transfer_id]
        if out.offer_pending and out.nccl and not out.eager_channel and not out.inline:
            self.abandoned[out.transfer_id] = Abandoned(out.link, out.layout, out.num_blocks,
                                                        out.src_dev)
            return True
        return False

    def forget_abandoned(self, transfer_id: int) -> None:
        self.abandoned.pop(transfer_id, None)

    def on_answer(self, link: L, msg: Answer) -> list[Action[L]]:
        """A peer's answer to one of our offers or pulls."""
        tid = msg.transfer_id
        pull = self.pull_of(link, tid)
        if pull is not None and isinstance(msg, Refuse):
            return [FailPull(tid, error_from_code(
                msg.code, f"{link.address} refused the pull: {msg.message}"))]
        out = self.outgoing_of(link, tid)
        actions: list[Action[L]] = []
        if out is not None and (out.inline or not isinstance(msg, XferDone | XferFailed)):
            out.offer_pending = False  # (an inline offer's answer is its XFER_DONE / FAILED)
            if out.inline:
                out.accepted = isinstance(msg, XferDone)
            if isinstance(msg, Busy | Refuse) and out.eager_tcp and not out.eager_answered:
                out.eager_answered = True  # the receiver drops those bytes: stop them
                actions.append(StopEagerTcp(tid))
        if out is None:
            gone = self.abandoned.pop(tid, None)
            if gone is not None and gone.link is not link:
                self.abandoned[tid] = gone  # another peer's id: not the answer it waits for
                gone = None
            if gone is not None:
                if isinstance(msg, Accept) and msg.channel:
                    actions.append(SendZeros(gone, msg))
                return actions
            return [Count("unknown_transfer", tid)]
        if isinstance(msg, Accept):
            actions.extend(self._accepted(link, out, msg))
        else:
            actions.append(Deliver(tid, msg))
        return actions

    def _accepted(self, link: L, out: Outgoing[L], msg: Accept) -> list[Action[L]]:
        tid = out.transfer_id
        if out.inline:
            return [Deliver(tid, ProtocolError(
                f"{link.address} accepted an offer that carried its bytes"))]
        if msg.channel == 0:  # over TCP
            if out.from_gpu or not out.tcp_ready:
                return [Deliver(tid, ProtocolError(
                    f"{link.address} accepted GPU blocks over TCP"))]
            out.accepted = True
            if out.eager_tcp and not out.eager_answered:
                out.eager_answered = True  # it answers the eager offer: the bytes are coming
                return [EagerTcpAccepted(tid, msg)]
            return [StartSend(tid, msg)]
        if out.eager_channel:  # the bytes were queued with the offer
            if msg.channel != out.eager_channel:
                return [Deliver(tid, ProtocolError(
                    f"{link.address} accepted on channel {msg.channel}, the bytes are on "
                    f"{out.eager_channel}"))]
            out.accepted = True
            return [Deliver(tid, msg)]
        if not self.has_nccl or not out.nccl:
            # The receiver queued its receive on that channel and would wait for bytes
            # that will not come until its deadline: it drops the channel now.
            err = ProtocolError("accepted over NCCL, which this transfer did not offer")
            return [channel_down(link, msg, err), Deliver(tid, err)]
        out.accepted = True
        return [StartSend(tid, msg)]

    def may_have_arrived(self, out: Outgoing[L], tcp_sent: bool | None,
                         eager_sent: bool | None, nccl_sent: bool | None) -> bool:
        """After a cancel, once its sends stopped or ended: could every byte have reached
        a receiver that keeps them? Each argument: None (no such job), else whether that
        job may have delivered every byte (ran to its end, or has not ended). Only a send
        for an offer the receiver accepted or has yet to answer counts."""
        maybe = [tcp_sent, out.inline and (out.offer_pending or out.accepted)]
        if not out.eager_answered:
            maybe.append(eager_sent)  # (once accepted, it is the TCP job)
        if out.accepted or out.offer_pending:
            maybe.append(nccl_sent)
        return any(m for m in maybe)

    # -------------------------------------------------------------- receives and pulls

    def pull_of(self, link: L, tid: int) -> PullState[L] | None:
        """Our pull with id ``tid``, if it went to ``link`` (only its owner answers it)."""
        pull = self.pulls.get(tid)
        return pull if pull is not None and pull.link is link else None

    def outgoing_of(self, link: L, tid: int) -> Outgoing[L] | None:
        out = self.outgoing.get(tid)
        return out if out is not None and out.link is link else None

    def in_use(self, link: L, tid: int, waiting: bool = False) -> bool:
        """Whether ``tid`` names a transfer still live with ``link``: ids are the peer's to
        choose, and must differ while live (its messages say which transfer they are
        about; a second transfer under one id would be mistaken for the first).
        ``waiting``: a pull of the peer's waits here for its key under that id."""
        key = (id(link), tid)
        return (key in self.incoming or key in self.serving or waiting
                or self.outgoing_of(link, tid) is not None)

    def check_offer(self, link: L, offer: Offer, facts: OfferFacts, waiting: bool = False
                    ) -> Refusal | None:
        """Why ``offer`` cannot be taken at all, or None."""
        tid = offer.transfer_id
        pull = self.pull_of(link, tid)
        if self.in_use(link, tid, waiting) or (pull is not None and pull.offered):
            return Refusal(ProtocolError(f"transfer id {tid} is already in use"),
                           "duplicate_transfer", fails_pull=False)
        layout = tuple(offer.layout)
        sender_nccl = offer.src_dev != CPU_DEVICE
        if offer.inline and (len(offer.inline) != offer.nbytes or offer.src_gpu
                             or offer.channel or offer.eager):
            return Refusal(ProtocolError(
                "an offer carrying its bytes must be of host memory, whole, and nothing "
                "else"))
        if offer.nbytes != wire_bytes(layout, offer.num_blocks):
            return Refusal(ProtocolError(
                f"offer of {offer.nbytes} bytes does not match {offer.num_blocks} blocks of "
                f"its layout ({wire_bytes(layout, offer.num_blocks)} bytes)"))
        if sender_nccl and not offer.src_dev.startswith("cuda:"):
            return Refusal(ProtocolError(f"bad device {offer.src_dev!r}"))
        if offer.src_gpu and (not facts.has_nccl or not sender_nccl):
            return Refusal(BadRequest(
                f"{link.address} offers GPU blocks, but {facts.node_id} has no GPU with NCCL "
                "(GPU memory does not go over TCP)"), None)
        if (offer.nbytes > facts.pool_capacity_bytes and pull is None and not offer.src_gpu
                and not facts.get_waits):
            # No room for it, ever: unless a get waits for it (its blocks are the room)
            # or a pull asked for it (the puller's are), or GPU staging may take it.
            return Refusal(PoolExhausted(
                f"offer of {offer.nbytes} bytes exceeds the whole pool "
                f"({facts.pool_capacity_bytes} bytes)"))
        if pull is not None and (offer.key != pull.key or layout != pull.layout
                                 or offer.num_blocks != pull.num_blocks or offer.first):
            return Refusal(ProtocolError("offer does not match the pull it answers"), None)
        return None

    def eager_offer_problem(self, offer: Offer, node_id: str) -> KvdError | None:
        """Why an OFFER naming an NCCL channel (its bytes queued on it) is malformed here."""
        if not self.has_nccl:
            return BadRequest(f"{node_id} has no NCCL")
        if not (offer.src_gpu and offer.src_dev.startswith("cuda:")):
            return ProtocolError("an offer with an NCCL channel must be of GPU blocks")
        if not MIN_NCCL_CHUNK_BYTES <= offer.chunk_bytes <= MAX_NCCL_CHUNK_BYTES:
            return ProtocolError(f"NCCL chunk size {offer.chunk_bytes} out of range")
        return None

    def pull_begins(self, tid: int, pull: PullState[L]) -> None:
        self.pulls[tid] = pull

    def pull_ends(self, tid: int) -> None:
        self.pulls.pop(tid, None)

    def receive_begins(self, link: L, tid: int) -> None:
        self.incoming.add((id(link), tid))
        pull = self.pull_of(link, tid)
        if pull is not None:
            pull.offered = True

    def receive_ends(self, link: L, tid: int) -> None:
        self.incoming.discard((id(link), tid))

    def receiving(self, link: L, tid: int) -> bool:
        return (id(link), tid) in self.incoming

    def on_cancel(self, link: L, tid: int) -> list[Action[L]]:
        """The peer gave up ``tid``: our receive of it drops its bytes; our send of it
        (a pull we serve) ends with ``Cancelled``."""
        actions: list[Action[L]] = []
        if self.receiving(link, tid):
            actions.append(Discard(tid))
        if self.outgoing_of(link, tid) is not None:
            actions.append(Deliver(tid, Cancelled(f"transfer {tid} cancelled by "
                                                  f"{link.address}")))
        return actions

    def on_link_lost(self, link: L, error: KvdError) -> list[Action[L]]:
        """Every send with the link fails; offers given up with it are forgotten."""
        for tid in [t for t, gone in self.abandoned.items() if gone.link is link]:
            del self.abandoned[tid]
        return [Deliver(out.transfer_id, error) for out in self.outgoing.values()
                if out.link is link]

    def pulls_not_offered(self) -> Iterator[int]:
        """Our pulls no owner has answered yet (draining fails them)."""
        return (tid for tid, pull in self.pulls.items() if not pull.offered)

    # -------------------------------------------------------------- pulls we serve

    def may_serve(self, link: L, tid: int, waiting: bool = False) -> str | None:
        """Why a peer's pull under ``tid`` cannot be served now: "duplicate" (a live id),
        "link" or "all" (the pulls served at once, the peer's or all peers'), or None."""
        if tid in self.outgoing or self.in_use(link, tid, waiting):
            # A send is known by its id alone until it ends: a second request under a
            # live id would take the first one's place, and leave that one to wait out
            # its deadline holding a read of its key.
            return "duplicate"
        if self.served.get(id(link), 0) >= self.max_served:
            return "link"
        if self.served_all >= self.max_served_all:
            return "all"
        return None

    def serving_begins(self, link: L, tid: int) -> None:
        self.serving.add((id(link), tid))
        self.served[id(link)] = self.served.get(id(link), 0) + 1
        self.served_all += 1

    def serving_ends(self, link: L, tid: int) -> None:
        self.serving.discard((id(link), tid))
        self.served_all -= 1
        left = self.served.pop(id(link), 0) - 1
        if left > 0:
            self.served[id(link)] = left
