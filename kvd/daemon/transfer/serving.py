"""Serving peers' pulls: a PULL_REQUEST answered by pushing the key with the puller's id.

The owner claims a read of the key and pushes it (``Sender.push``) under the transfer id
the puller chose; the puller recognises its id and takes the bytes into the blocks it
asked for. A pull of a key we do not hold yet waits for it (``WaitingPulls``) up to its
``wait_for_key_s``. The pulls served at once are bounded, per peer and for all
(``TransferMachine.may_serve``): past that the request is refused with the retriable
PoolExhausted.
"""

from __future__ import annotations

import asyncio
import contextlib

from kvd.daemon.accepting import Throttled
from kvd.daemon.peer_link import PeerLink
from kvd.daemon.transfer.context import TransferContext, TransferPart, log
from kvd.daemon.transfer.routes import Source
from kvd.daemon.transfer.sending import Sender
from kvd.errors import KeyGone, KvdError, PoolExhausted, ProtocolError, UnknownKey
from kvd.protocol import PullRequest, Refuse


class PullServer(TransferPart):
    def __init__(self, ctx: TransferContext, sender: Sender) -> None:
        super().__init__(ctx)
        self.sender = sender
        self._refusing_pulls = Throttled(log)

    def on_pull_request(self, link: PeerLink, req: PullRequest,
                         wait_until: float | None = None) -> None:
        tid = req.transfer_id
        why_not = self.machine.may_serve(link, tid, self._waiting_pulls.holds(link, tid))
        if why_not == "duplicate":
            self._refuse(link, tid, ProtocolError(f"transfer id {tid} is already in use"),
                         "duplicate_transfer")
            return
        if why_not is not None:
            # (before the read is claimed: a claim takes a lent key out of the store)
            self._refuse_pull_over_limit(link, req, why_not)
            return
        try:
            item = self.arrivals.readable(req.key, tuple(req.layout), req.num_blocks,
                                          req.share)
        except UnknownKey as err:
            if isinstance(err, KeyGone):  # it will not come back: no wait
                self._refuse(link, tid, err)
                return
            if wait_until is None:  # a new request: its wait starts now
                wait_until = self._loop.time() + min(req.wait_for_key_s,
                                                     self.config.max_wait_s)
            if not self._waiting_pulls.hold(link, req, wait_until):  # (no wait: refused)
                self._refuse(link, tid, err)
            return
        except KvdError as err:
            self._refuse(link, tid, err)
            return
        regions = [item.region] if item.region is not None else []
        try:
            source = Source(self.arrivals.source_blocks(item, req.share), tuple(req.layout),
                            req.num_blocks, regions)
        except KvdError as err:  # (blocks that cannot be cut so: BadRequest)
            item.end_read()
            self._refuse(link, tid, err)
            return
        try:  # GPU bytes for a puller without NCCL: tell it now, not at its timeout
            self._check_gpu_route(link, source)
        except KvdError as err:
            item.end_read()
            self._refuse(link, tid, err)
            return
        deadline = self._loop.time() + self.config.max_wait_s

        async def serve() -> None:
            if not link.alive:  # lost before this ran (on_link_lost did not see it)
                return
            with contextlib.suppress(KvdError):  # logged in Sender.push; the puller has its own
                item.bytes_read += await self.sender.push(link, tid, req.key, source, None,
                                                    deadline)

        def ended(_task: asyncio.Task[None]) -> None:
            # (a callback, not a finally: a task cancelled before it first ran, at
            # shutdown, runs no finally, and the read would never end)
            item.end_read()
            self.machine.serving_ends(link, tid)

        self.machine.serving_begins(link, tid)
        self._spawn(serve()).add_done_callback(ended)

    def _refuse_pull_over_limit(self, link: PeerLink, req: PullRequest, whose_limit: str
                                ) -> None:
        """A pull past the pulls served at once, the peer's or all peers': refused with a
        retriable error, counted (``pull_limit``), and logged at most every few seconds."""
        node = self.config.node_id
        if whose_limit == "link":
            served = self.machine.served.get(id(link), 0)
            whose = f"{served} of its pulls are"
            message = f"{node} serves {served} pulls for {link.address} already"
        else:
            whose = f"{self.machine.served_all} pulls of all peers are"
            message = f"{node} serves {self.machine.served_all} pulls for its peers already"
        self._count_bad("pull_limit")
        self._refusing_pulls.warning(
            "pull refused transfer_id=%d key=%s from=%s: %s being served already (the most "
            "at once)", req.transfer_id, req.key, link.address, whose)
        err = PoolExhausted(f"{message} (the most at once): ask again")
        self.plane.send(link, Refuse(transfer_id=req.transfer_id, code=err.code,
                                     message=err.message))

    def key_appeared(self, key: str) -> None:
        """The engine stored, published or lent ``key``: serve the pulls waiting for it, in
        the order they came (one, if it is lent; the others wait on, to their deadline)."""
        for pull in self._waiting_pulls.take(key):
            self.on_pull_request(pull.link, pull.req, wait_until=pull.deadline)

    def key_went(self, key: str) -> None:
        """``key`` will not come (its reader released it before it was lent): the pulls
        waiting here for it fail now, as one that comes later does."""
        for pull in self._waiting_pulls.take(key):
            self._refuse(pull.link, pull.req.transfer_id, self.engine.store.missing(key))

    def refuse_waiting(self, err: KvdError) -> int:
        """Draining: the peers' pulls waiting here for a key fail now. Returns how many."""
        refused = 0
        for pull in self._waiting_pulls.take_all():
            self._refuse(pull.link, pull.req.transfer_id, err)
            refused += 1
        return refused
