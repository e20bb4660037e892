"""Leases between daemons: a reader's renew and release sent to the daemon that lent the
key, that daemon's answer, and the watch of the daemon a get waits on.

A reader's ``Renew`` / ``Release`` for a key lent at another daemon goes there as
LEASE_RENEW / LEASE_RELEASE with a call id, over the link to it (made if there is none);
the lender acts on its store (``daemon/leases.py``) and answers LEASE_ANSWER with the same
id: done, or the error's code and message. A call fails with ``PeerUnreachable`` if its
link is lost first and ``KvdTimeout`` past its timeout. An answer is taken only from the
link its call went on; any other is counted (``unknown_call``) and dropped. A peer's call
is answered at once and holds nothing here.

``watched``: a get for a key that another daemon (its *sender*) puts here, watched through
the link to that daemon. If the sender cannot be reached, or its link is lost, while the
get still waits for its key, the get stops and fails at once with ``PeerUnreachable``
rather than at its timeout. A get whose bytes are already coming is let finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from kvd.daemon.futures import wait_out
from kvd.daemon.leases import Leases
from kvd.daemon.peer_link import PeerLink
from kvd.daemon.peers import PeerPlane
from kvd.daemon.transfer.machine import new_id
from kvd.errors import KvdError, KvdTimeout, PeerUnreachable, error_from_code
from kvd.protocol import LeaseAnswer, LeaseRelease, LeaseRenew, PeerMessage

log = logging.getLogger("kvd.daemon.transfer.leasing")

LeaseCall = LeaseRenew | LeaseRelease


class Leasing:
    def __init__(self, plane: PeerPlane, leases: Leases) -> None:
        self.plane = plane
        self.leases = leases
        self._loop = asyncio.get_running_loop()
        # Our calls awaiting their answer: the link each went on, and its answer.
        self._calls: dict[int, tuple[PeerLink, asyncio.Future[LeaseAnswer | KvdError]]] = {}

    @property
    def address(self) -> str:
        return self.plane.address

    # ------------------------------------------------------------ asking the lender

    async def renew(self, key: str, src: str, ttl_s: float, timeout_s: float) -> None:
        await self._call(src, timeout_s, f"renewal of key {key!r}",
                         lambda cid: LeaseRenew(call_id=cid, key=key, ttl_s=ttl_s))

    async def release(self, key: str, src: str, timeout_s: float, skip: int = 0) -> None:
        await self._call(src, timeout_s, f"release of key {key!r}",
                         lambda cid: LeaseRelease(call_id=cid, key=key, skip=skip))

    async def _call(self, src: str, timeout_s: float, what: str,
                    message: Callable[[int], LeaseCall]) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                link = await self.plane.link_to(src, timeout_s)
                answer = await self._ask(link, message(new_id()))
        except TimeoutError:
            raise KvdTimeout(f"{what} at {src}: no answer within {timeout_s:g}s") from None
        if isinstance(answer, KvdError):
            raise answer
        if answer.code:
            raise error_from_code(answer.code, f"{src}: {answer.message}")

    async def _ask(self, link: PeerLink, msg: LeaseCall) -> LeaseAnswer | KvdError:
        answer: asyncio.Future[LeaseAnswer | KvdError] = self._loop.create_future()

        def lost(_link: PeerLink, err: KvdError) -> None:
            if not answer.done():
                answer.set_result(err)

        self._calls[msg.call_id] = (link, answer)
        link.on_lost.append(lost)
        try:
            self.plane.send(link, msg)
            return await answer
        finally:
            self._calls.pop(msg.call_id, None)
            with contextlib.suppress(ValueError):
                link.on_lost.remove(lost)

    # ------------------------------------------------------------ a peer's messages

    def on_message(self, link: PeerLink, msg: PeerMessage) -> None:
        if isinstance(msg, LeaseAnswer):
            call = self._calls.get(msg.call_id)
            if call is None or call[0] is not link or call[1].done():
                self.plane.bad_input.note("unknown_call", (
                    f"from={link.address}: lease answer for unknown call_id={msg.call_id}"))
                return
            call[1].set_result(msg)
            return
        if not isinstance(msg, LeaseRenew | LeaseRelease):
            return
        try:
            if isinstance(msg, LeaseRenew):
                self.leases.renew(msg.key, msg.ttl_s)
            else:
                self.leases.release(msg.key, msg.skip)
        except KvdError as err:
            log.info("lease %s refused key=%s from=%s: [%s] %s",
                     msg.__struct_config__.tag, msg.key, link.address, err.code, err.message)
            self.plane.send(link, LeaseAnswer(call_id=msg.call_id, code=err.code,
                                              message=err.message))
            return
        self.plane.send(link, LeaseAnswer(call_id=msg.call_id))

    # ------------------------------------------------------------ a get's sender

    async def watched(self, work: Awaitable[int], sender: str, timeout_s: float,
                      still_waiting: Callable[[], bool]) -> int:
        getting = asyncio.ensure_future(work)
        watch = self._loop.create_task(self._until_lost(sender, timeout_s))
        try:
            await asyncio.wait([getting, watch], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            watch.cancel()
            await self._stop(getting)
            raise
        if getting.done():
            watch.cancel()
            return getting.result()
        lost = watch.result()
        if not still_waiting():  # its bytes are coming: let them in
            return await getting
        self.leases.counters.sender_lost += 1
        log.warning("get stopped: the daemon it waits on is gone sender=%s: %s", sender,
                    lost.message)
        if await self._stop(getting):
            raise asyncio.CancelledError
        if getting.cancelled():
            raise PeerUnreachable(f"{sender}, which was to send this key, is gone: "
                                  f"{lost.message}")
        return getting.result()  # (it ended meanwhile)

    async def _stop(self, getting: asyncio.Future[int]) -> bool:
        """Cancel the get and wait until it has ended (no bytes land after it answers).
        True if a cancel of ours came meanwhile."""
        getting.cancel()
        cancelled = await wait_out(getting, 60.0)
        if getting.done() and not getting.cancelled():
            getting.exception()  # (retrieved: its outcome is reported, or not wanted)
        return cancelled

    async def _until_lost(self, sender: str, timeout_s: float) -> KvdError:
        """Once the link to ``sender`` is lost (or cannot be made): why."""
        try:
            link = await self.plane.link_to(sender, timeout_s)
        except KvdError as err:
            # The sender may have linked to us meanwhile (its hello crossed ours, and it
            # refused ours): that link is as good to watch.
            found = self.plane.links.get(sender)
            if found is None or not found.alive:
                return err
            link = found
        gone: asyncio.Future[KvdError] = self._loop.create_future()

        def lost(_link: PeerLink, err: KvdError) -> None:
            if not gone.done():
                gone.set_result(err)

        if not link.alive:
            return PeerUnreachable(f"link to {sender} lost")
        link.on_lost.append(lost)
        try:
            return await gone
        finally:
            with contextlib.suppress(ValueError):
                link.on_lost.remove(lost)
