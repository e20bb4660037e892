"""Peers' pull requests that wait at the owner for their key to appear.

The vLLM connector's flow races by nature: decode's pull for a request can reach prefill's
daemon before prefill has lent the request's blocks (it lends one engine step after it
answered). A pull that says how long it may wait (``PullRequest.wait_for_key_s``) is held
here, and served the moment the key is published, lent or stored, instead of being refused
and tried again by the puller some milliseconds later. Each waits against its own deadline
(then it is refused with ``UnknownKey``, as a pull without a wait is at once), and at most
``limit`` wait at a time (``max_waiting_pulls``: a timer and a request each, a few KiB at
most): past that a pull is refused at once (the puller retries).

Only bookkeeping: ``PeerTransfers`` decides what a pull gets once its key is there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from kvd.daemon.peer_link import PeerLink
from kvd.protocol import PullRequest


@dataclass(eq=False)
class WaitingPull:
    link: PeerLink
    req: PullRequest
    deadline: float  # loop.time()
    timer: asyncio.TimerHandle | None = None


class WaitingPulls:
    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int,
                 on_expired: Callable[[WaitingPull], None]) -> None:
        self._loop = loop
        self._limit = limit
        self._on_expired = on_expired
        self._by_key: dict[str, list[WaitingPull]] = {}  # in arrival order
        self._by_id: dict[tuple[int, int], WaitingPull] = {}  # (id(link), transfer id)

    def __len__(self) -> int:
        return len(self._by_id)

    def hold(self, link: PeerLink, req: PullRequest, deadline: float) -> bool:
        """Hold ``req`` until its key appears or ``deadline``; False when it cannot wait
        (no time left, which a pull without a wait never has, or too many wait already):
        refuse it now."""
        ident = (id(link), req.transfer_id)
        if (deadline <= self._loop.time() or len(self._by_id) >= self._limit
                or ident in self._by_id):
            return False
        pull = WaitingPull(link, req, deadline)
        pull.timer = self._loop.call_at(deadline, self._expire, pull)
        self._by_id[ident] = pull
        self._by_key.setdefault(req.key, []).append(pull)
        return True

    def take(self, key: str) -> list[WaitingPull]:
        """The pulls waiting for ``key``, oldest first, no longer held."""
        pulls = self._by_key.pop(key, [])
        for pull in pulls:
            self._forget(pull, from_key=False)
        return pulls

    def take_all(self) -> list[WaitingPull]:
        """Every waiting pull, no longer held."""
        pulls = list(self._by_id.values())
        for pull in pulls:
            self._forget(pull)
        return pulls

    def drop(self, link: PeerLink, transfer_id: int) -> None:
        """The puller gave up: forget its request, if held (nothing is sent)."""
        pull = self._by_id.get((id(link), transfer_id))
        if pull is not None:
            self._forget(pull)

    def holds(self, link: PeerLink, transfer_id: int) -> bool:
        return (id(link), transfer_id) in self._by_id

    def drop_link(self, link: PeerLink) -> None:
        for pull in [p for p in self._by_id.values() if p.link is link]:
            self._forget(pull)

    def _expire(self, pull: WaitingPull) -> None:
        pull.timer = None
        self._forget(pull)
        self._on_expired(pull)

    def _forget(self, pull: WaitingPull, from_key: bool = True) -> None:
        self._by_id.pop((id(pull.link), pull.req.transfer_id), None)
        if pull.timer is not None:
            pull.timer.cancel()
            pull.timer = None
        if from_key:
            waiting = self._by_key.get(pull.req.key)
            if waiting is not None:
                waiting.remove(pull)
                if not waiting:
                    del self._by_key[pull.req.key]
