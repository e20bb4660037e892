"""The transfer protocol between daemons, sans I/O: every transfer's state, and what each
input means.

``TransferMachine`` holds every transfer with the peers: our sends (a client's put, or a
peer's pull we serve), our pulls, the receives in progress, the peers' pulls waiting for
their key, and NCCL offers given up before their answer. One method per input, each
returning the actions to take, in order:

- a client's request: ``send``, ``pull``, ``cancel``; the daemon's ``drain``;
- a peer's message: ``message``;
- what the driver found carrying out an action: ``tcp_ready`` (``PrepareTcp``),
  ``offered_eager`` (an ``Offer`` that found a live NCCL channel), ``start_failed``
  (``StartSend``), ``took`` (``Take``), ``claimed`` (``Serve``);
- a key's coming or going: ``key_appeared``, ``key_went``;
- a route's completion: ``sent`` (a send job), ``received`` (a receive job);
- a timer: ``timer``;
- a lost link: ``link_lost``.

The driver (``transfers.PeerTransfers``) carries the actions out and decides nothing. This
module imports only ``protocol`` and ``errors``: nothing here awaits, sends or touches
memory, so every interleaving is a unit test (tests/test_transfer_machine.py).

A send. It offers the bytes (``Offer``: in the offer itself if small host memory, right
behind it on the data connection if host memory, queued on a live NCCL channel with it if
``may_send_eager_nccl`` allows, else plain). ACCEPT starts the bytes on the route it names
(at once, in message order: the receiver queued its side in that order); XFER_DONE, once
the bytes are out, ends it. BUSY offers again after a backoff, until the deadline. A send
never finishes while a job of it may still read the client's blocks: a failure halts its
jobs and waits (``ENDING``). A cancel never contradicts the receiver: a send cancelled
once every byte may have gone reports what the receiver answers to its XFER_CANCEL
(``VERDICT``).

A receive. An OFFER is checked, then taken (``Take``: the driver finds where the bytes go
and queues their receive) and ACCEPTed, or answered BUSY or REFUSE; an eager offer's bytes
come whatever we answer, and are dropped (``DropEager``) so that both ends of the route
stay in step. Its job's end answers XFER_DONE or XFER_FAILED.

A pull. Ours sends PULL_REQUEST; the owner's OFFER under our id brings the bytes into the
pull's blocks. A peer's is served (``Serve``: the driver claims a read of the key) as a
send under the peer's id; a pull of a key not here yet waits for it up to its
``wait_for_key_s``. The pulls served at once are bounded, per peer and for all: past that
the request is refused with the retriable ``PoolExhausted``.
"""

from __future__ import annotations

import os
import random
import secrets
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Generic, Protocol, TypeVar

from kvd.errors import (
    BadRequest,
    Cancelled,
    KeyGone,
    KvdError,
    KvdTimeout,
    PoolExhausted,
    ProtocolError,
    TransferFailed,
    UnknownKey,
    error_from_code,
)
from kvd.protocol import (
    MAX_INLINE_BYTES,
    Accept,
    Busy,
    ChannelDown,
    LayoutEntry,
    Offer,
    PeerMessage,
    PullRequest,
    Refuse,
    Share,
    XferCancel,
    XferDone,
    XferFailed,
)

CPU_DEVICE = "cpu"
# Transfer ids only have to differ (a peer is authenticated before it sends any): a
# generator seeded once from the OS, not an os.urandom call per transfer (~7 us each in a
# daemon on the GPU host), and seeded again in a forked child: daemons forked from one
# process (a prefork launcher; tests/serve_forks.py, benchmarks/mesh.py) drew the same ids,
# which collided at their peers (duplicate_transfer) and left transfers to their deadline.
_id_source = random.Random(secrets.randbits(128))
os.register_at_fork(after_in_child=lambda: _id_source.seed(secrets.randbits(128)))
MIN_NCCL_CHUNK_BYTES, MAX_NCCL_CHUNK_BYTES = 2**20, 2**31  # an eager offer's, checked
BUSY_RETRY_S = 0.05  # a BUSY's retry_after_s, and a sender's first backoff after one
MAX_BACKOFF_S = 1.0
JOBS_GRACE_S = 60.0  # the longest a send waits for its jobs to stop before it answers
# Pulls of one peer served at once (each a send of its key, holding a read of it until
# the send ends, up to max_wait_s; ~15 KiB): past it the peer's next pull is refused with
# the retriable PoolExhausted. As many as max_waiting_pulls by default, and never fewer
# than it: the pulls waiting for their keys are served together when the keys appear.
MAX_PULLS_SERVED_PER_LINK = 4096
# And all peers' together, in links at their most (~250 MiB): links are bounded too
# (max_peer_links), but 1,024 at their most would hold gigabytes.
_LINKS_AT_THEIR_MOST = 4

Layout = tuple[LayoutEntry, ...]
# What a timer is for: (kind, the peer's link for a waiting pull else None, transfer id).
TimerKey = tuple[str, Hashable, int]
Answer = Accept | Busy | Refuse | XferDone | XferFailed


class Link(Hashable, Protocol):
    """The machine's view of a peer link: who it is (its identity keys the transfers)."""

    address: str


L = TypeVar("L", bound=Link)


class Job(Enum):
    """A send's jobs on its routes (at most one of each)."""

    EAGER_TCP = auto()  # host bytes right behind the first offer, before any answer
    EAGER_NCCL = auto()  # GPU bytes queued on a live NCCL channel with the offer
    TCP = auto()  # the bytes an ACCEPT took over the data connection
    NCCL = auto()  # ... or over the NCCL channel it names


class Offering(Enum):
    """How an offer goes out."""

    PLAIN = auto()  # the ACCEPT decides the route; the bytes go after it
    INLINE = auto()  # the bytes in the offer itself (small host memory)
    EAGER_TCP = auto()  # the bytes right behind it on our data connection
    EAGER_NCCL = auto()  # queued on a live NCCL channel with it, if there is one (else PLAIN)


class Step(Enum):
    """Where a send is."""

    LINKING = auto()  # our data connection to the peer is being made
    OFFERED = auto()  # an offer is out, its answer awaited
    RETRYING = auto()  # BUSY: the next offer waits for a backoff (or the dropped eager bytes)
    MOVING = auto()  # ACCEPTed: the bytes go; their end and XFER_DONE awaited
    ENDING = auto()  # the outcome is known; the jobs reading the source must stop first
    CANCELLING = auto()  # the client cancelled: its jobs stop, then ``_may_have_arrived``
    VERDICT = auto()  # cancelled after every byte may have gone: the receiver's answer decides


# ------------------------------------------------------------------ records


@dataclass(eq=False)
class Send(Generic[L]):
    """One send: a client's put, or a peer's pull we serve (``served``)."""

    tid: int
    link: L
    key: str
    layout: Layout
    num_blocks: int
    nbytes: int
    deadline: float  # loop time
    from_gpu: bool  # the source blocks are GPU memory (they go only over NCCL)
    nccl: bool  # offered with our end of an NCCL channel (src_dev is a GPU)
    src_dev: str
    served: bool = False
    step: Step = Step.OFFERED
    offering: Offering = Offering.PLAIN  # how the offer out (or last out) went
    offer_out: bool = False  # an offer is out and not answered yet
    accepted: bool = False  # the receiver ACCEPTed (inline: said XFER_DONE)
    tcp_ready: bool = False  # our data connection is up: TCP may be chosen
    eager_tcp_left: bool = False  # the next offer sends its bytes behind it (once)
    no_eager: bool = False  # after BUSY to an eager NCCL offer: offer without sending first
    channel: int = 0  # the NCCL channel of an eager offer's bytes
    jobs: dict[Job, bool | None] = field(default_factory=dict)  # None: running; else sent all
    dropped: set[Job] = field(default_factory=set)  # jobs whose bytes the receiver drops
    mover: Job | None = None  # the job whose bytes the ACCEPT took
    done_nbytes: int | None = None  # the receiver's XFER_DONE came
    late: bool = False  # the deadline passed while the bytes moved
    outcome: int | KvdError | None = None  # ENDING: what it answers once its jobs stop
    label: str = "failed"  # the outcome, for counters and metrics
    retry_after: float = 0.0  # RETRYING after an eager NCCL BUSY: its retry_after_s
    backoff: float = BUSY_RETRY_S

    @property
    def inline(self) -> bool:
        return not self.from_gpu and not self.nccl and self.nbytes <= MAX_INLINE_BYTES

    def gone(self) -> Abandoned[L]:
        """What is kept of it once given up with its NCCL offer unanswered."""
        return Abandoned(self.link, self.layout, self.num_blocks, self.src_dev)

    def running(self) -> list[Job]:
        return [j for j, sent in self.jobs.items() if sent is None]


@dataclass(eq=False)
class OurPull(Generic[L]):
    link: L
    key: str
    layout: Layout
    num_blocks: int
    receiving: bool = False  # its OFFER came: bytes are (about to be) on their way


@dataclass(eq=False)
class Incoming:
    """A receive in progress (its job queued)."""

    pull: bool  # it answers our pull of this id
    to_waiter: bool  # a get waits for these bytes: its reply goes before XFER_DONE


@dataclass(eq=False)
class Waiting(Generic[L]):
    """A peer's pull waiting here for its key."""

    link: L
    req: PullRequest
    until: float  # loop time


@dataclass(frozen=True)
class Abandoned(Generic[L]):
    """A plain NCCL offer given up before its answer: an ACCEPT may still come, and the
    receiver then waits for the bytes on its channel (we send zeros)."""

    link: L
    layout: Layout
    num_blocks: int
    src_dev: str


# ------------------------------------------------------------------ what the driver reports


@dataclass(frozen=True)
class Receiving:
    """``Take``: the receive is queued; ``accept`` tells the sender its route."""

    accept: Accept
    to_waiter: bool


@dataclass(frozen=True)
class Landed:
    """``Take`` of an offer carrying its bytes: they are in place."""

    nbytes: int
    to_waiter: bool


@dataclass(frozen=True)
class NoRoom:
    """``Take``: no room now (BUSY)."""


@dataclass(frozen=True)
class NoChannel:
    """``Take`` of an eager NCCL offer: we have no live receive channel it names."""


TakeResult = Receiving | Landed | NoRoom | NoChannel | KvdError


# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class Tell(Generic[L]):
    """Send ``message`` to the peer (``soon``: one turn of the loop later, after the get
    the bytes answer has replied)."""

    link: L
    message: PeerMessage
    soon: bool = False


@dataclass(frozen=True)
class PrepareTcp:
    """Make (or find) our data connection for send ``tid``; report ``tcp_ready``."""

    tid: int


@dataclass(frozen=True)
class SendOffer:
    """Offer send ``tid``'s bytes, as ``how`` says (EAGER_NCCL: on a live channel if
    there is one, reported by ``offered_eager``; else plain)."""

    tid: int
    how: Offering


@dataclass(frozen=True)
class StartSend:
    """Queue send ``tid``'s bytes on the route ``accept`` chose, now, in message order;
    report ``start_failed`` if the route cannot take them."""

    tid: int
    accept: Accept


@dataclass(frozen=True)
class SendZeros(Generic[L]):
    """An ACCEPT for an NCCL offer given up: send zeros on its channel, so the receiver
    is not left waiting there."""

    gone: Abandoned[L]
    accept: Accept


@dataclass(frozen=True)
class Halt:
    """Stop send ``tid``'s ``job`` where its transport can (TCP at its next chunk)."""

    tid: int
    job: Job


@dataclass(frozen=True)
class Finish:
    """Send ``tid`` is over: its requester gets ``result`` (bytes sent, or the error)."""

    tid: int
    result: int | KvdError
    label: str  # done, failed, timeout, cancelled


@dataclass(frozen=True)
class Take(Generic[L]):
    """Find where ``offer``'s bytes go (``pull``: our pull's blocks), queue their receive
    (or copy them, if in the offer), and report ``took``."""

    link: L
    offer: Offer
    pull: bool


@dataclass(frozen=True)
class DropEager(Generic[L]):
    """The bytes of an eager offer we did not take come anyway: read and drop them."""

    link: L
    offer: Offer


@dataclass(frozen=True)
class Discard(Generic[L]):
    """A receive nobody wants any more: its bytes, if they come, are dropped."""

    link: L
    tid: int


@dataclass(frozen=True)
class EndReceive(Generic[L]):
    """A receive's job ended: its destination takes the bytes (a waiting get is answered,
    pool bytes become the key) or is given back."""

    link: L
    tid: int
    result: int | KvdError


@dataclass(frozen=True)
class SettlePull:
    """Our pull ``tid`` gets its answer."""

    tid: int
    result: int | KvdError


@dataclass(frozen=True)
class Serve(Generic[L]):
    """Claim a read of what a peer's pull asks for; report ``claimed``."""

    link: L
    req: PullRequest
    until: float | None = None  # a pull that waited for its key: the end of its wait


@dataclass(frozen=True)
class EndRead:
    """A served pull's send is over: its read of the key ends."""

    tid: int
    nbytes: int


@dataclass(frozen=True)
class Timer:
    """Call ``timer(key)`` at ``at`` (loop time), unless cancelled."""

    key: TimerKey
    at: float


@dataclass(frozen=True)
class CancelTimer:
    key: TimerKey


@dataclass(frozen=True)
class Count:
    """A message the machine ignored or refused, counted as a bad message of ``kind``
    and logged (``note``)."""

    kind: str
    note: str


Action = (Tell[L] | PrepareTcp | SendOffer | StartSend | SendZeros[L] | Halt | Finish
          | Take[L] | DropEager[L] | Discard[L] | EndReceive[L] | SettlePull | Serve[L]
          | EndRead | Timer | CancelTimer | Count)


@dataclass
class Counters:
    sent: dict[str, int] = field(default_factory=dict)  # outcome -> count
    received: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    busy_replies: int = 0
    eager_nccl_sent: int = 0  # sends queued on an NCCL channel with their offer
    eager_nccl_dropped: int = 0  # such offers we did not accept: received, dropped


def new_id() -> int:
    return _id_source.getrandbits(62) + 1


def _bump(table: dict[str, int], outcome: str) -> None:
    table[outcome] = table.get(outcome, 0) + 1


def channel_down(link: L, accept: Accept, err: KvdError) -> Tell[L]:
    """What tells the receiver of an ACCEPT whose bytes cannot go that it should drop the
    channel it queued its receive on."""
    return Tell(link, ChannelDown(channel=accept.channel, reason=(
        f"the sender could not send transfer {accept.transfer_id}: {err.message}")[:4000]))


def refuse(link: L, tid: int, err: KvdError) -> Tell[L]:
    return Tell(link, Refuse(transfer_id=tid, code=err.code, message=err.message))


# ------------------------------------------------------------------ the machine


@dataclass
class TransferMachine(Generic[L]):
    node_id: str
    has_nccl: bool
    nccl_chunk_bytes: int = 4 << 20
    max_waiting_pulls: int = 0
    max_wait_s: float = 30.0
    peer_grace_s: float = 5.0
    sends: dict[int, Send[L]] = field(default_factory=dict)
    pulls: dict[int, OurPull[L]] = field(default_factory=dict)
    incoming: dict[tuple[L, int], Incoming] = field(default_factory=dict)
    waiting: dict[tuple[L, int], Waiting[L]] = field(default_factory=dict)  # oldest first
    waiting_for: dict[str, int] = field(default_factory=dict)  # key -> pulls waiting
    abandoned: dict[int, Abandoned[L]] = field(default_factory=dict)
    served: dict[L, int] = field(default_factory=dict)  # pulls served now, per peer
    served_all: int = 0
    counters: Counters = field(default_factory=Counters)

    @property
    def max_served(self) -> int:
        return max(MAX_PULLS_SERVED_PER_LINK, self.max_waiting_pulls)

    @property
    def max_served_all(self) -> int:
        return _LINKS_AT_THEIR_MOST * self.max_served

    # ============================================================== a client's requests

    def send(self, s: Send[L], now: float) -> list[Action[L]]:
        """A send begins (``s`` as the driver found it: its source's facts)."""
        self.sends[s.tid] = s
        acts: list[Action[L]] = [Timer(("deadline", None, s.tid), s.deadline)]
        if s.from_gpu or s.inline:
            return acts + self._offer(s)
        s.step = Step.LINKING  # host memory, not inline: TCP may be chosen
        return [*acts, PrepareTcp(s.tid)]

    def pull(self, tid: int, link: L, key: str, layout: Layout, num_blocks: int,
             wait_for_key_s: float, share: Share) -> list[Action[L]]:
        """Our pull begins: ask the owner."""
        self.pulls[tid] = OurPull(link, key, layout, num_blocks)
        return [Tell(link, PullRequest(
            transfer_id=tid, key=key, dst_dev=CPU_DEVICE, num_blocks=num_blocks,
            layout=list(layout), wait_for_key_s=wait_for_key_s, share=share))]

    def cancel_pull(self, tid: int) -> list[Action[L]]:
        """The requester gave up our pull ``tid`` (cancelled, timed out, or failed)."""
        pull = self.pulls.get(tid)
        if pull is None:
            return []
        # Stop the owner; bytes not yet arriving are dropped; arriving ones are waited
        # for (the pull settles when its receive ends).
        if pull.receiving:
            return [Tell(pull.link, XferCancel(transfer_id=tid)), Discard(pull.link, tid)]
        return self._end_pull(tid, Cancelled(f"pull {tid} cancelled"))

    def cancel_send(self, tid: int, now: float) -> list[Action[L]]:
        """The requester gave up send ``tid``."""
        s = self.sends.get(tid)
        if s is None or s.step in (Step.ENDING, Step.CANCELLING, Step.VERDICT):
            return []  # (already ending: the requester waits for its end)
        acts: list[Action[L]] = [Tell(s.link, XferCancel(transfer_id=tid))]
        acts += [Halt(tid, j) for j in s.running()]
        s.step, s.label = Step.CANCELLING, "cancelled"
        acts.append(Timer(("grace", None, tid), now + JOBS_GRACE_S))
        if not s.running():
            acts += self._jobs_stopped(s, now)
        return acts

    def drain(self, err: KvdError) -> tuple[list[Action[L]], int]:
        """Draining: the peers' pulls waiting here for a key and our pulls no owner has
        answered yet fail now (as gets waiting for a key do). Also returns how many."""
        acts: list[Action[L]] = []
        n = len(self.waiting)
        for link, tid in list(self.waiting):
            acts += [*self._unwait(link, tid), refuse(link, tid, err)]
        for tid, pull in list(self.pulls.items()):
            if not pull.receiving:
                acts += self._end_pull(tid, err)
                n += 1
        return acts, n

    # ============================================================== what the driver found

    def tcp_ready(self, tid: int, error: KvdError | None) -> list[Action[L]]:
        s = self.sends.get(tid)
        if s is None or s.step is not Step.LINKING:
            return []
        if error is not None:
            return self._end(s, error)
        s.tcp_ready = True
        s.eager_tcp_left = not s.nccl  # host bytes go right behind the first offer
        return self._offer(s)

    def offered_eager(self, tid: int, channel: int) -> None:
        """The offer found a live NCCL channel: its bytes are queued there."""
        s = self.sends[tid]
        s.offering, s.channel = Offering.EAGER_NCCL, channel
        s.jobs[Job.EAGER_NCCL] = None
        self.counters.eager_nccl_sent += 1

    def start_failed(self, tid: int, accept: Accept, error: KvdError) -> list[Action[L]]:
        """The route the ACCEPT chose could not take the bytes."""
        s = self.sends.get(tid)
        if s is None:
            return []
        s.accepted = False
        if s.mover is not None:
            s.jobs[s.mover] = False
        acts: list[Action[L]] = [channel_down(s.link, accept, error)] if accept.channel else []
        return acts + self._end(s, error)

    def took(self, link: L, offer: Offer, result: TakeResult) -> list[Action[L]]:
        """What ``Take`` found for ``offer``."""
        tid = offer.transfer_id
        pull = self.pulls.get(tid) if self._is_our_pull(link, tid) else None
        if isinstance(result, Receiving):
            self.incoming[(link, tid)] = Incoming(pull is not None, result.to_waiter)
            if pull is not None:
                pull.receiving = True
            return [Tell(link, result.accept)]
        if isinstance(result, Landed):
            _bump(self.counters.received, "done")
            self.counters.bytes_received += result.nbytes
            acts: list[Action[L]] = []
            if pull is not None:
                acts += self._end_pull(tid, result.nbytes)
            return [*acts, Tell(link, XferDone(transfer_id=tid, nbytes=result.nbytes),
                                soon=result.to_waiter)]
        if isinstance(result, NoChannel):
            # The sender aborts its end of the channel (and the send waiting on it), and
            # offers again without one.
            return [Tell(link, ChannelDown(channel=offer.channel, reason=(
                        f"no live receive channel {offer.channel}"))),
                    Tell(link, Busy(transfer_id=tid, retry_after_s=0.0))]
        acts = self._drop_eager(link, offer, duplicate=False)
        if isinstance(result, NoRoom):
            self.counters.busy_replies += 1
            return [Tell(link, Busy(transfer_id=tid, retry_after_s=BUSY_RETRY_S)), *acts]
        acts.insert(0, refuse(link, tid, result))
        if isinstance(result, PoolExhausted):  # larger than the whole pool: never fits
            acts.insert(0, Count("bad_offer", f"offer refused transfer_id={tid} from "
                                              f"{link.address}: {result.message}"))
        if pull is not None:
            acts[1:1] = self._end_pull(tid, result)
        return acts

    def claimed(self, link: L, req: PullRequest, result: Send[L] | KvdError, now: float,
                until: float | None = None) -> list[Action[L]]:
        """What ``Serve`` found for a peer's pull: its send, a read of the key held for it
        (the source's facts), or why not (``until``: the end of its wait so far)."""
        tid = req.transfer_id
        if isinstance(result, Send):
            self.served[link] = self.served.get(link, 0) + 1
            self.served_all += 1
            result.served = True
            return self.send(result, now)
        if isinstance(result, UnknownKey) and not isinstance(result, KeyGone):
            # Not here yet: it waits for its key, if it may (a KeyGone will not come).
            if until is None:
                until = now + min(req.wait_for_key_s, self.max_wait_s)
            if (until > now and len(self.waiting) < self.max_waiting_pulls
                    and (link, tid) not in self.waiting):
                self.waiting[(link, tid)] = Waiting(link, req, until)
                self.waiting_for[req.key] = self.waiting_for.get(req.key, 0) + 1
                return [Timer(("wait", link, tid), until)]
        return [refuse(link, tid, result)]

    # ============================================================== keys

    def waits_for(self, key: str) -> bool:
        return key in self.waiting_for

    def busy_links(self) -> set[L]:
        """The links with work of ours on them: sends, pulls, pulls waiting here for their
        key, and pulls of the peer's we serve (the driver adds its receives)."""
        return ({s.link for s in self.sends.values()} | {p.link for p in self.pulls.values()}
                | {link for link, _ in self.waiting} | set(self.served))

    def key_appeared(self, key: str) -> list[Action[L]]:
        """The daemon stored, published or lent ``key``: the pulls waiting for it are
        served, in the order they came (one, if it is lent; the others wait on)."""
        acts: list[Action[L]] = []
        if key not in self.waiting_for:
            return acts
        for (link, tid), w in list(self.waiting.items()):
            if w.req.key == key:
                acts += [*self._unwait(link, tid), Serve(link, w.req, w.until)]
        return acts

    def key_went(self, key: str, err: KvdError) -> list[Action[L]]:
        """``key`` will not come (its reader released it): the pulls waiting for it fail."""
        acts: list[Action[L]] = []
        for (link, tid), w in list(self.waiting.items()):
            if w.req.key == key:
                acts += [*self._unwait(link, tid), refuse(link, tid, err)]
        return acts

    # ============================================================== a peer's messages

    def message(self, link: L, msg: PeerMessage, now: float) -> list[Action[L]]:
        if isinstance(msg, Offer):
            return self._on_offer(link, msg)
        if isinstance(msg, PullRequest):
            return self._on_pull_request(link, msg)
        if isinstance(msg, XferCancel):
            return self._on_cancel(link, msg.transfer_id, now)
        if isinstance(msg, Accept | Busy | Refuse | XferDone | XferFailed):
            return self._on_answer(link, msg, now)
        return []

    def _on_answer(self, link: L, msg: Answer, now: float) -> list[Action[L]]:
        tid = msg.transfer_id
        if isinstance(msg, Refuse) and self._is_our_pull(link, tid):
            err = error_from_code(msg.code, f"{link.address} refused the pull: {msg.message}")
            return self._end_pull(tid, err)
        s = self.sends.get(tid)
        if s is None or s.link != link:
            gone = self.abandoned.get(tid)
            if gone is not None and gone.link == link:
                del self.abandoned[tid]
                return [SendZeros(gone, msg)] if isinstance(msg, Accept) and msg.channel else []
            return [Count("unknown_transfer", f"message for unknown transfer_id={tid} from "
                          f"{link.address} ignored")]
        if s.step in (Step.CANCELLING, Step.VERDICT, Step.ENDING):
            return self._answer_while_ending(s, msg, now)
        if s.step is Step.OFFERED:
            return self._answer_to_offer(s, msg, now)
        if s.step is Step.MOVING:
            if isinstance(msg, XferDone):
                s.done_nbytes = msg.nbytes
                return self._progress(s)
            if isinstance(msg, XferFailed):
                return self._end(s, error_from_code(
                    msg.code, f"receiver {link.address}: {msg.message}"))
        return self._end(s, ProtocolError(
            f"unexpected {type(msg).__name__} from {link.address} "
            f"({s.step.name.lower()})"))

    def _answer_to_offer(self, s: Send[L], msg: Answer, now: float) -> list[Action[L]]:
        s.offer_out = False
        acts: list[Action[L]] = []
        if isinstance(msg, Busy | Refuse | XferFailed) and s.offering is Offering.EAGER_TCP:
            s.dropped.add(Job.EAGER_TCP)  # the receiver drops those bytes: stop them
            if s.jobs.get(Job.EAGER_TCP) is None:
                acts.append(Halt(s.tid, Job.EAGER_TCP))
        if isinstance(msg, Accept):
            return self._accepted(s, msg)
        if isinstance(msg, XferDone):
            if s.offering is not Offering.INLINE:
                return self._end(s, ProtocolError("unexpected XferDone in answer to an offer"))
            s.accepted = True  # (an inline offer's answer is its XFER_DONE)
            return self._finish(s, s.nbytes, "done")
        if isinstance(msg, Refuse | XferFailed):
            return acts + self._end(s, error_from_code(
                msg.code, f"{s.link.address} refused: {msg.message}"))
        self.counters.busy_replies += 1
        if s.offering is Offering.EAGER_NCCL:
            # The receiver drops the bytes queued with the offer; offer again, without
            # sending first, once they are out (at once if it lacked the channel).
            s.dropped.add(Job.EAGER_NCCL)
            s.no_eager = True
            if s.jobs.get(Job.EAGER_NCCL) is None:
                s.step, s.retry_after = Step.RETRYING, msg.retry_after_s
                return acts
            if msg.retry_after_s == 0:
                return acts + self._offer(s)
        return acts + self._back_off(s, msg.retry_after_s, now)

    def _back_off(self, s: Send[L], retry_after: float, now: float) -> list[Action[L]]:
        wait = min(max(s.backoff, retry_after), MAX_BACKOFF_S)
        if now + wait >= s.deadline:
            return self._end(s, PoolExhausted(
                f"{s.link.address} had no room for {s.nbytes} bytes of key {s.key!r} "
                "before the deadline"))
        s.step = Step.RETRYING
        s.backoff = min(s.backoff * 2, MAX_BACKOFF_S)
        return [Timer(("retry", None, s.tid), now + wait)]

    def _accepted(self, s: Send[L], msg: Accept) -> list[Action[L]]:
        address = s.link.address
        if s.offering is Offering.INLINE:
            return self._end(s, ProtocolError(
                f"{address} accepted an offer that carried its bytes"))
        if msg.channel == 0:  # over TCP
            if s.from_gpu or not s.tcp_ready:
                return self._end(s, ProtocolError(f"{address} accepted GPU blocks over TCP"))
            s.accepted, s.step = True, Step.MOVING
            if s.offering is Offering.EAGER_TCP:  # the bytes are on their way already
                s.mover = Job.EAGER_TCP
                return self._progress(s)
            s.mover = Job.TCP
            s.jobs[Job.TCP] = None
            return [StartSend(s.tid, msg)]
        if s.offering is Offering.EAGER_NCCL:  # the bytes were queued with the offer
            if msg.channel != s.channel:
                return self._end(s, ProtocolError(
                    f"{address} accepted on channel {msg.channel}, the bytes are on "
                    f"{s.channel}"))
            s.accepted, s.step, s.mover = True, Step.MOVING, Job.EAGER_NCCL
            return self._progress(s)
        if not self.has_nccl or not s.nccl:
            # The receiver queued its receive on that channel and would wait for bytes
            # that will not come until its deadline: it drops the channel now.
            err = ProtocolError("accepted over NCCL, which this transfer did not offer")
            return [channel_down(s.link, msg, err), *self._end(s, err)]
        s.accepted, s.step, s.mover = True, Step.MOVING, Job.NCCL
        s.jobs[Job.NCCL] = None
        return [StartSend(s.tid, msg)]

    def _answer_while_ending(self, s: Send[L], msg: Answer, now: float
                             ) -> list[Action[L]]:
        """An answer to a send that is ending: an NCCL ACCEPT gets zeros (the receiver
        waits on its channel; we read no more of the client's blocks); a cancelled one's
        answer is its verdict."""
        if isinstance(msg, Accept):
            plain_nccl_out = s.offer_out and s.nccl and s.offering is Offering.PLAIN
            s.offer_out = False
            if msg.channel and plain_nccl_out:  # (an eager offer's bytes are queued)
                return [SendZeros(s.gone(), msg)]
            return []
        if isinstance(msg, XferDone):
            s.done_nbytes = msg.nbytes
        elif isinstance(msg, Busy | Refuse | XferFailed):
            s.offer_out = False
            s.done_nbytes = -1  # it did not keep them
        if s.step is Step.VERDICT:
            return self._verdict(s)
        return []

    def _on_offer(self, link: L, offer: Offer) -> list[Action[L]]:
        tid = offer.transfer_id
        acts: list[Action[L]] = []
        if offer.channel and (err := self._eager_problem(offer)) is not None:
            # Its bytes cannot be taken on that channel: the sender aborts its end.
            acts += [Count("bad_offer", f"offer refused transfer_id={tid} from "
                                        f"{link.address}: {err.message}"),
                     Tell(link, ChannelDown(channel=offer.channel, reason=err.message[:4000])),
                     refuse(link, tid, err)]
            if not self.in_use(link, tid) and self._is_our_pull(link, tid):
                acts += self._end_pull(tid, err)
            return acts
        problem = self._offer_problem(link, offer)
        if problem is None:
            return [Take(link, offer, self._is_our_pull(link, tid))]
        err, bad, fails_pull = problem
        if bad is not None:
            acts.append(Count(bad, f"offer refused transfer_id={tid} from {link.address}: "
                                   f"[{err.code}] {err.message}"))
        acts.append(refuse(link, tid, err))
        acts += self._drop_eager(link, offer, duplicate=bad == "duplicate_transfer")
        if fails_pull and self._is_our_pull(link, tid):
            acts += self._end_pull(tid, err)
        return acts

    def _eager_problem(self, offer: Offer) -> KvdError | None:
        """Why an OFFER naming an NCCL channel (its bytes queued on it) is malformed here."""
        if not self.has_nccl:
            return BadRequest(f"{self.node_id} has no NCCL")
        if not (offer.src_gpu and offer.src_dev.startswith("cuda:")):
            return ProtocolError("an offer with an NCCL channel must be of GPU blocks")
        if not MIN_NCCL_CHUNK_BYTES <= offer.chunk_bytes <= MAX_NCCL_CHUNK_BYTES:
            return ProtocolError(f"NCCL chunk size {offer.chunk_bytes} out of range")
        return None

    def _offer_problem(self, link: L, offer: Offer
                       ) -> tuple[KvdError, str | None, bool] | None:
        """Why ``offer`` cannot be taken at all: the error the REFUSE carries, the
        bad-message kind to count (None: a fair offer this daemon cannot serve), and
        whether the pull it answers fails (not for a duplicate id: bytes may be landing
        for that pull)."""
        tid = offer.transfer_id
        pull = self.pulls.get(tid) if self._is_our_pull(link, tid) else None
        if self.in_use(link, tid) or (pull is not None and pull.receiving):
            return ProtocolError(f"transfer id {tid} is already in use"), \
                "duplicate_transfer", False
        layout = tuple(offer.layout)
        wire = sum(e.bytes_per_block for e in layout) * offer.num_blocks
        sender_nccl = offer.src_dev != CPU_DEVICE
        if offer.inline and (len(offer.inline) != offer.nbytes or offer.src_gpu
                             or offer.channel or offer.eager):
            return ProtocolError("an offer carrying its bytes must be of host memory, "
                                 "whole, and nothing else"), "bad_offer", True
        if offer.nbytes != wire:
            return ProtocolError(
                f"offer of {offer.nbytes} bytes does not match {offer.num_blocks} blocks "
                f"of its layout ({wire} bytes)"), "bad_offer", True
        if sender_nccl and not offer.src_dev.startswith("cuda:"):
            return ProtocolError(f"bad device {offer.src_dev!r}"), "bad_offer", True
        if offer.src_gpu and (not self.has_nccl or not sender_nccl):
            return BadRequest(
                f"{link.address} offers GPU blocks, but {self.node_id} has no GPU with "
                "NCCL (GPU memory does not go over TCP)"), None, True
        if pull is not None and (offer.key != pull.key or layout != pull.layout
                                 or offer.num_blocks != pull.num_blocks or offer.first):
            return ProtocolError("offer does not match the pull it answers"), None, True
        return None

    def _drop_eager(self, link: L, offer: Offer, duplicate: bool) -> list[Action[L]]:
        """An offer we do not take whose bytes come anyway: an NCCL one's (even under a
        duplicate id: the channel's two ends stay in step), a TCP one's unless its id is
        a duplicate (the data connection reads them for the live transfer)."""
        if offer.channel:
            self.counters.eager_nccl_dropped += 1
            return [DropEager(link, offer)]
        if offer.eager and not duplicate:
            return [DropEager(link, offer)]
        return []

    def _on_pull_request(self, link: L, req: PullRequest) -> list[Action[L]]:
        tid = req.transfer_id
        if tid in self.sends or self.in_use(link, tid):
            # A send is known by its id alone until it ends: a second request under a
            # live id would take the first one's place.
            err: KvdError = ProtocolError(f"transfer id {tid} is already in use")
            return [Count("duplicate_transfer", f"pull refused transfer_id={tid} from "
                          f"{link.address}: {err.message}"), refuse(link, tid, err)]
        served = self.served.get(link, 0)
        if served >= self.max_served:
            whose, message = f"{served} of its pulls are", (
                f"{self.node_id} serves {served} pulls for {link.address} already")
        elif self.served_all >= self.max_served_all:
            whose, message = f"{self.served_all} pulls of all peers are", (
                f"{self.node_id} serves {self.served_all} pulls for its peers already")
        else:
            return [Serve(link, req)]
        # (before the read is claimed: a claim takes a lent key out of the store)
        err = PoolExhausted(f"{message} (the most at once): ask again")
        return [Count("pull_limit", f"pull refused transfer_id={tid} key={req.key} "
                      f"from={link.address}: {whose} being served already (the most at "
                      "once)"), refuse(link, tid, err)]

    def _on_cancel(self, link: L, tid: int, now: float) -> list[Action[L]]:
        """The peer gave up ``tid``: its waiting pull is forgotten, our receive of it
        drops its bytes, our send of it (a pull we serve) ends with ``Cancelled``."""
        acts: list[Action[L]] = []
        if (link, tid) in self.waiting:
            acts += self._unwait(link, tid)
        if (link, tid) in self.incoming:
            acts.append(Discard(link, tid))
        s = self.sends.get(tid)
        if s is not None and s.link == link and s.step not in (
                Step.ENDING, Step.CANCELLING, Step.VERDICT):
            acts += self._end(s, Cancelled(f"transfer {tid} cancelled by {link.address}"))
        return acts

    # ============================================================== routes

    def sent(self, tid: int, job: Job, result: int | KvdError, now: float
             ) -> list[Action[L]]:
        """A send job ended: the bytes it sent (it ran to its end), or why not (stopped:
        ``Cancelled``; or failed)."""
        s = self.sends.get(tid)
        if s is None or job not in s.jobs:
            return []
        s.jobs[job] = not isinstance(result, KvdError)
        if s.step is Step.MOVING and job is s.mover:
            if isinstance(result, KvdError):
                return self._end(s, result)
            return self._progress(s)
        if s.step is Step.RETRYING and job is Job.EAGER_NCCL:
            if s.retry_after == 0:
                return self._offer(s)
            return self._back_off(s, s.retry_after, now)
        if s.step is Step.ENDING and not s.running():
            assert s.outcome is not None
            return self._finish(s, s.outcome, s.label)
        if s.step is Step.CANCELLING and not s.running():
            return self._jobs_stopped(s, now)
        return []

    def received(self, link: L, tid: int, result: int | KvdError) -> list[Action[L]]:
        """A receive job ended: ``result`` is the bytes in place, or why not."""
        inc = self.incoming.pop((link, tid), None)
        if inc is None:
            return []
        acts: list[Action[L]] = [EndReceive(link, tid, result)]
        if isinstance(result, KvdError):
            _bump(self.counters.received,
                  "cancelled" if isinstance(result, Cancelled) else "failed")
            acts.append(Tell(link, XferFailed(transfer_id=tid, code=result.code,
                                              message=result.message)))
        else:
            _bump(self.counters.received, "done")
            self.counters.bytes_received += result
            # The get these bytes answer replies first: its client is what a decode step
            # waits for; the sender's confirmation follows one turn of the loop later.
            acts.append(Tell(link, XferDone(transfer_id=tid, nbytes=result),
                             soon=inc.to_waiter))
        if inc.pull:
            acts[1:1] = self._end_pull(tid, result)
        return acts

    # ============================================================== timers

    def timer(self, key: TimerKey, now: float) -> list[Action[L]]:
        kind, link, tid = key
        if kind == "forget":
            self.abandoned.pop(tid, None)
            return []
        if kind == "wait":
            w = self.waiting.get((link, tid))  # type: ignore[arg-type]
            if w is None:
                return []
            self._unwait(w.link, tid)  # (its timer is the one that fired)
            return [refuse(w.link, tid, UnknownKey(
                f"no key {w.req.key!r} on {self.node_id} within {w.req.wait_for_key_s:g}s"))]
        s = self.sends.get(tid)
        if s is None:
            return []
        if kind == "retry":
            return self._offer(s) if s.step is Step.RETRYING else []
        if kind == "deadline":
            return self._deadline(s)
        if kind == "grace" and s.step in (Step.ENDING, Step.CANCELLING):
            # Its jobs did not stop in time: it answers anyway.
            if s.step is Step.CANCELLING:
                return self._finish(s, Cancelled(f"transfer {tid} cancelled"), "cancelled")
            assert s.outcome is not None
            return self._finish(s, s.outcome, s.label)
        if kind == "verdict" and s.step is Step.VERDICT:
            return self._finish(s, TransferFailed(
                f"transfer {tid} of key {s.key!r} was cancelled after its bytes went, and "
                f"{s.link.address} did not say whether it kept them"), "failed")
        return []

    def _deadline(self, s: Send[L]) -> list[Action[L]]:
        what = {Step.LINKING: "its data connection", Step.OFFERED: "an answer to the offer",
                Step.RETRYING: "room", Step.MOVING: "the receiver's confirmation"}
        if s.step not in what:
            return []
        if s.step is Step.MOVING and s.mover is not None and s.jobs[s.mover] is None:
            s.late = True  # the bytes are moving: their end decides
            return []
        acts: list[Action[L]] = []
        if s.step is Step.LINKING:
            acts.append(Tell(s.link, XferCancel(transfer_id=s.tid)))
        return acts + self._end(s, KvdTimeout(
            f"transfer {s.tid} of key {s.key!r}: no {what[s.step]} from {s.link.address} "
            "before the deadline"), label="timeout")

    # ============================================================== a lost link

    def link_lost(self, link: L, error: KvdError, now: float) -> list[Action[L]]:
        """Every send with the link fails; its waiting pulls and offers given up are
        forgotten; our pulls it has not begun to answer fail (those receiving end as
        their channels, aborted, fail their jobs)."""
        acts: list[Action[L]] = []
        for tid in [t for t, gone in self.abandoned.items() if gone.link == link]:
            del self.abandoned[tid]
            acts.append(CancelTimer(("forget", None, tid)))
        for w_link, tid in [k for k in self.waiting if k[0] == link]:
            acts += self._unwait(w_link, tid)
        for tid, pull in list(self.pulls.items()):
            if pull.link == link and not pull.receiving:
                acts += self._end_pull(tid, error)
        for s in [s for s in self.sends.values() if s.link == link]:
            if s.step is Step.VERDICT:
                s.done_nbytes = None
                acts += self._finish(s, TransferFailed(
                    f"transfer {s.tid} of key {s.key!r} was cancelled after its bytes "
                    f"went, and {link.address} is gone: {error.message}"), "failed")
            elif s.step is not Step.CANCELLING and s.step is not Step.ENDING:
                acts += self._end(s, error)
        return acts

    # ============================================================== inside

    def _offer(self, s: Send[L]) -> list[Action[L]]:
        s.step, s.offer_out, s.channel = Step.OFFERED, True, 0
        if s.inline:
            s.offering = Offering.INLINE
        elif s.eager_tcp_left:
            s.offering, s.eager_tcp_left = Offering.EAGER_TCP, False
            s.jobs[Job.EAGER_TCP] = None
        elif self.may_send_eager_nccl(s):
            s.offering = Offering.PLAIN  # until offered_eager says it found a channel
            return [SendOffer(s.tid, Offering.EAGER_NCCL)]
        else:
            s.offering = Offering.PLAIN
        return [SendOffer(s.tid, s.offering)]

    def may_send_eager_nccl(self, s: Send[L]) -> bool:
        """Whether this GPU send may be queued on an NCCL channel together with its OFFER.

        Both ends must run a channel's jobs in the same order. Plain offers queue at the
        ACCEPT (the receiver when it sends it, we when it arrives), eager ones at the OFFER
        (we when we send it, the receiver when it arrives). Mixed freely the orders can
        differ: an eager offer sent after ACCEPT 0 arrived, while the receiver had already
        accepted a plain offer 2 on the same channel, queues 0, 1, 2 here and 0, 2, 1 there.
        So: eager only when no plain NCCL offer to this peer is unanswered (nor one given
        up whose answer may still come). Then every plain job answered earlier is queued
        before ours on both ends, and every later one after it."""
        if (not self.has_nccl or not s.from_gpu or s.no_eager
                or not MIN_NCCL_CHUNK_BYTES <= self.nccl_chunk_bytes <= MAX_NCCL_CHUNK_BYTES):
            return False
        if any(o is not s and o.link == s.link and o.offer_out and o.nccl
               and o.offering is Offering.PLAIN for o in self.sends.values()):
            return False
        return not any(gone.link == s.link for gone in self.abandoned.values())

    def _progress(self, s: Send[L]) -> list[Action[L]]:
        """MOVING: done once the bytes are out and the receiver said XFER_DONE."""
        assert s.mover is not None
        sent_all = s.jobs[s.mover]
        if sent_all is None:
            return []
        if sent_all is False:
            return self._end(s, TransferFailed(f"transfer {s.tid}: its bytes did not go"))
        if s.done_nbytes is not None:
            return self._end(s, s.nbytes, "done")
        if s.late:
            return self._deadline(s)
        return []

    def _end(self, s: Send[L], result: int | KvdError, label: str = "failed"
             ) -> list[Action[L]]:
        """The send's outcome is known: it finishes once its jobs have stopped (halted
        now where they can), as none may read the client's blocks after it answers."""
        if s.step is Step.ENDING:
            return []
        s.step, s.outcome, s.label = Step.ENDING, result, label
        running = s.running()
        if not running:
            return self._finish(s, result, label)
        return [*(Halt(s.tid, j) for j in running),
                Timer(("grace", None, s.tid), s.deadline + JOBS_GRACE_S)]

    def _jobs_stopped(self, s: Send[L], now: float) -> list[Action[L]]:
        """A cancelled send's jobs have stopped: could every byte have reached a receiver
        that keeps them? Then its answer decides; else the cancel stands."""
        if not self._may_have_arrived(s):
            return self._finish(s, Cancelled(f"transfer {s.tid} cancelled"), "cancelled")
        s.step = Step.VERDICT
        if s.done_nbytes is not None:
            return self._verdict(s)
        until = max(s.deadline, now + 2 * self.peer_grace_s)
        return [Timer(("verdict", None, s.tid), until)]

    def _may_have_arrived(self, s: Send[L]) -> bool:
        """Whether every byte may have reached the receiver: a job it did not drop ran to
        its end, or the offer carried them and was not turned down."""
        if s.offering is Offering.INLINE and (s.offer_out or s.accepted):
            return True
        return any(sent is not False for j, sent in s.jobs.items() if j not in s.dropped)

    def _verdict(self, s: Send[L]) -> list[Action[L]]:
        if s.done_nbytes is None:
            return []
        if s.done_nbytes < 0:
            return self._finish(s, Cancelled(f"transfer {s.tid} cancelled"), "cancelled")
        return self._finish(s, s.nbytes, "done")

    def _finish(self, s: Send[L], result: int | KvdError, label: str) -> list[Action[L]]:
        del self.sends[s.tid]
        _bump(self.counters.sent, label)
        acts: list[Action[L]] = [Finish(s.tid, result, label)]
        if isinstance(result, int):
            self.counters.bytes_sent += result
        if s.served:
            self.served_all -= 1
            left = self.served.pop(s.link, 0) - 1
            if left > 0:
                self.served[s.link] = left
            acts.append(EndRead(s.tid, result if isinstance(result, int) else 0))
        if s.offer_out and s.nccl and s.offering is Offering.PLAIN:
            # An ACCEPT may still come: remembered a while (its channel gets zeros).
            self.abandoned[s.tid] = s.gone()
            acts.append(Timer(("forget", None, s.tid), s.deadline + max(
                60.0, self.peer_grace_s * 4)))
        return acts

    def _unwait(self, link: L, tid: int) -> list[Action[L]]:
        key = self.waiting.pop((link, tid)).req.key
        left = self.waiting_for.pop(key) - 1
        if left:
            self.waiting_for[key] = left
        return [CancelTimer(("wait", link, tid))]

    def _is_our_pull(self, link: L, tid: int) -> bool:
        pull = self.pulls.get(tid)
        return pull is not None and pull.link == link

    def _end_pull(self, tid: int, result: int | KvdError) -> list[Action[L]]:
        """Our pull is over: it gets ``result``; if it failed, its owner is told to stop."""
        pull = self.pulls.pop(tid)
        if isinstance(result, int):
            return [SettlePull(tid, result)]
        return [SettlePull(tid, result), Tell(pull.link, XferCancel(transfer_id=tid))]

    def in_use(self, link: L, tid: int) -> bool:
        """Whether ``tid`` names a transfer still live with ``link``: ids are the peer's to
        choose, and must differ while live (its messages say which transfer they are
        about; a second transfer under one id would be mistaken for the first)."""
        s = self.sends.get(tid)
        return ((link, tid) in self.incoming or (link, tid) in self.waiting
                or (s is not None and s.link == link))
