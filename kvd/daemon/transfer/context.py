"""What the transfer wing's parts share: the daemon's parts, the machine, the routes, and
the records of the transfers in progress.

``PeerTransfers`` (``transfers``) makes one ``TransferContext``; the sender (``sending``),
the receiver (``receiving``) and the pull server (``serving``) each take it and read the
same state through ``TransferPart``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import random
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvd.daemon.engine import Engine
from kvd.daemon.futures import on_loop, settle_awaited
from kvd.daemon.peer_link import PeerLink
from kvd.daemon.peers import PeerPlane
from kvd.daemon.transfer.arrivals import Arrival, Arrivals
from kvd.daemon.transfer.machine import Answer, Outgoing, PullState, TransferMachine
from kvd.daemon.transfer.nccl_links import NcclLinks
from kvd.daemon.transfer.routes import Moving, Routes, Source, TcpSendRoute
from kvd.daemon.transfer.waiting_pulls import WaitingPull, WaitingPulls
from kvd.errors import BadRequest, Cancelled, KvdError, TransferFailed, UnknownKey
from kvd.memory.regions import Region
from kvd.protocol import Refuse
from kvd.transport.chunks import BlockSet

log = logging.getLogger("kvd.daemon.transfer.transfers")

BUSY_RETRY_S = 0.05  # a BUSY's retry_after_s, and a sender's first backoff after one


class Replies:
    """What answers one send, in arrival order (the peer's answers, an error the daemon
    hands it), taken one at a time by the send's task. An ``asyncio.Queue`` did this with
    an event, a lock-free waiting list and a loop lookup made for every send; one waiter
    is all a send needs. An answer stays here until taken, so a task cancelled as it
    arrives (after a cancel, ``Sender._verdict`` reads on) still finds it."""

    __slots__ = ("_answers", "_waiter")

    def __init__(self) -> None:
        self._answers: collections.deque[Answer | KvdError] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, answer: Answer | KvdError) -> None:
        self._answers.append(answer)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Answer | KvdError:
        while not self._answers:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self._answers.popleft()


@dataclass(eq=False)
class Push:
    """A send in progress: its machine state, and what moves its bytes."""

    state: Outgoing[PeerLink]
    source: Source
    deadline: float  # loop time
    first: int = 0  # the key's block the source's first is (Offer.first)
    tcp: TcpSendRoute | None = None  # our data connection, if TCP may be chosen
    eager_tcp: Moving | None = None  # bytes sent with the first offer (TCP)
    tcp_job: Moving | None = None  # the bytes the ACCEPT took over TCP
    nccl_job: Moving | None = None  # ... or over NCCL (queued with the offer, if eager)
    replies: Replies = field(default_factory=Replies)

    def jobs(self) -> list[Moving]:
        return [j for j in (self.eager_tcp, self.tcp_job, self.nccl_job) if j is not None]


@dataclass(eq=False)
class Receive:
    transfer_id: int
    key: str
    link: PeerLink
    arrival: Arrival
    job: Moving
    nbytes: int

    @property
    def regions(self) -> list[Region]:
        """The client regions the bytes land in (a pull's, or a waiting get's)."""
        waiter = self.arrival.waiter
        return [r for r in (self.arrival.region, waiter.region if waiter else None)
                if r is not None]


@dataclass(eq=False)
class Pull:
    """One of our pulls: its machine state, and where its bytes go."""

    state: PullState[PeerLink]
    region: Region
    # Settled by whatever ends the pull (its bytes, a refusal, the link's loss), maybe
    # once nothing awaits it (cancelled, timed out): then a cancelled pull waits on it
    # for bytes still landing.
    future: asyncio.Future[int]
    blocks: BlockSet  # the destination, prepared while the request is out
    # What the pull's task awaits: settled with ``future``, but a cancel of the task
    # cancels only this one. (``asyncio.shield(future)`` would do the same one turn of
    # the loop later, as store.Waiter.wake says.)
    wake: asyncio.Future[int] = field(init=False)

    def __post_init__(self) -> None:
        self.wake = self.future.get_loop().create_future()

    def settle(self, result: int | KvdError) -> None:
        """The pull's end: the bytes it took, or its error (once; later ones are moot)."""
        settle_awaited(self.future, self.wake, result)


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


class TransferContext:
    def __init__(self, engine: Engine, plane: PeerPlane, nccl: NcclLinks | None) -> None:
        config = engine.config
        self.engine = engine
        self.plane = plane
        self.nccl = nccl  # None: this daemon moves bytes over TCP only
        self.arrivals = Arrivals(engine)  # where incoming bytes go, what peers may read
        self.routes = Routes(nccl, engine.busy_poll, config.nccl_chunk_bytes,
                             config.peer_grace_s, list(plane.gpus))
        self.machine: TransferMachine[PeerLink] = TransferMachine(
            has_nccl=nccl is not None, max_waiting_pulls=config.max_waiting_pulls)
        self.counters = TransferCounters()
        self.pushes: dict[int, Push] = {}
        self.receives: dict[tuple[int, int], Receive] = {}  # (id(link), transfer id)
        self.pulls: dict[int, Pull] = {}
        self.loop = asyncio.get_running_loop()
        self.tasks: set[asyncio.Task[Any]] = set()
        # Peers' pulls of keys we do not hold yet, held until they appear (or time out).
        self.waiting_pulls = WaitingPulls(self.loop, config.max_waiting_pulls,
                                          self._waited_in_vain)

    def count_bad(self, kind: str) -> None:
        self.plane.bad_messages[kind] = self.plane.bad_messages.get(kind, 0) + 1

    def refuse(self, link: PeerLink, tid: int, err: KvdError, bad: str | None = None) -> None:
        if bad is not None:
            self.count_bad(bad)
        log.info("transfer refused transfer_id=%d from=%s: [%s] %s", tid, link.address,
                 err.code, err.message)
        self.plane.send(link, Refuse(transfer_id=tid, code=err.code, message=err.message))

    def _waited_in_vain(self, pull: WaitingPull) -> None:
        self.refuse(pull.link, pull.req.transfer_id, UnknownKey(
            f"no key {pull.req.key!r} on {self.engine.config.node_id} within "
            f"{pull.req.wait_for_key_s:g}s"))


class TransferPart:
    """One part of the wing: the shared state under short names, and what every part
    does the same way."""

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.config = ctx.engine.config
        self.plane = ctx.plane
        self.nccl = ctx.nccl
        self.arrivals = ctx.arrivals
        self.routes = ctx.routes
        self.machine = ctx.machine
        self.counters = ctx.counters
        self._pushes = ctx.pushes
        self._receives = ctx.receives
        self._pulls = ctx.pulls
        self._loop = ctx.loop
        self._waiting_pulls = ctx.waiting_pulls

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self._loop.create_task(coro)
        self.ctx.tasks.add(task)
        task.add_done_callback(self.ctx.tasks.discard)
        return task

    def _count_bad(self, kind: str) -> None:
        self.ctx.count_bad(kind)

    def _fail_pull(self, tid: int, err: KvdError) -> None:
        """Our pull ``tid`` fails now (no bytes of it land), not at its timeout."""
        pull = self._pulls.get(tid)
        if pull is not None:
            pull.settle(err)

    def _refuse(self, link: PeerLink, tid: int, err: KvdError, bad: str | None = None) -> None:
        self.ctx.refuse(link, tid, err, bad)

    def _check_gpu_route(self, link: PeerLink, source: Source) -> None:
        if source.gpu is None:
            return
        if self.nccl is None:
            raise BadRequest(f"blocks on {source.gpu} need NCCL to leave this daemon, and "
                             f"{self.config.node_id} runs without it")
        if not any(d.startswith("cuda") for d in link.devices):
            raise BadRequest(f"blocks on {source.gpu} cannot go to {link.address}: it has "
                             "no GPU with NCCL (GPU memory does not go over TCP)")


def as_kvd_error(exc: BaseException, what: str) -> KvdError:
    if isinstance(exc, KvdError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        return Cancelled(f"{what} cancelled")
    return TransferFailed(f"{what}: {exc!r}")


def ended(cfut: concurrent.futures.Future[Any]) -> asyncio.Future[Any]:
    """A loop future that settles when ``cfut`` does, for what waits only for the end
    (regions held while a job runs). Whoever awaits the job reports its error: here it is
    marked retrieved, so that dropping this future logs no "exception never retrieved"."""
    afut = on_loop(cfut)
    afut.add_done_callback(retrieved)
    return afut


def retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def uncancel() -> None:
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11
        task.uncancel()


# Transfer ids only have to differ (a peer is authenticated before it sends any): a
# generator seeded once from the OS, not an os.urandom call per transfer (~7 us each in a
# daemon on the GPU host).
_id_source = random.Random(secrets.randbits(128))


def new_id() -> int:
    return _id_source.getrandbits(62) + 1
