"""Which requests a mover reports back: their parts counted, without the daemon.

A request may move in parts, one key each. The engine hears of the request, not of its
parts: a send is *released* (the engine may free its blocks) once its final part has come
and no part holds the blocks any more; a load has *ended* once every part has, and then
either loaded or failed with the blocks of the parts that failed and the first cause.
``KvMover`` tells ``RequestParts`` what happened to each part; what the engine is to hear
collects here until the mover's next ``poll``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvd.integrations.kv_orders import LoadOrder, MoverStats, Polled, SendOrder


@dataclass(eq=False)
class _SendGroup:
    """The parts of one request being sent."""

    open: set[str] = field(default_factory=set)  # keys still holding the engine's blocks
    final: bool = False


@dataclass(eq=False)
class _LoadGroup:
    """The parts of one request being loaded."""

    expected: int
    started: float  # time.monotonic() of its first part
    ended: int = 0
    failed_blocks: list[int] = field(default_factory=list)
    failed: bool = False
    cause: str = ""  # the first part's failure
    refused: bool = False  # a part was refused before it started (its cause said already)
    nbytes: int = 0  # what its parts brought


class RequestParts:
    """The parts of each request being sent or loaded, and what the engine is to hear."""

    def __init__(self, stats: MoverStats) -> None:
        self._stats = stats  # counts loads and load failures, per request
        self._sending: dict[str, _SendGroup] = {}  # by request
        self._loading: dict[str, _LoadGroup] = {}  # by request
        self._done = Polled()

    def take_done(self) -> Polled:
        """What finished since the last call."""
        done, self._done = self._done, Polled()
        return done

    def clear(self) -> None:
        self._sending.clear()
        self._loading.clear()

    # ------------------------------------------------------------ sends

    def send_ordered(self, order: SendOrder, holds: bool) -> None:
        """A part was ordered: it holds the engine's blocks until ``release`` (``holds``),
        or it was refused and holds nothing."""
        group = self._sending.setdefault(order.req_id, _SendGroup())
        group.final = group.final or order.final
        if holds:
            group.open.add(order.key)
        else:
            self._release_if_done(order.req_id, group)

    def release(self, order: SendOrder) -> None:
        """This part no longer needs the engine's blocks; the request is released when
        its final part has come and no part needs them (again: nothing)."""
        group = self._sending.get(order.req_id)
        if group is None or order.key not in group.open:
            return
        group.open.discard(order.key)
        self._release_if_done(order.req_id, group)

    def _release_if_done(self, req_id: str, group: _SendGroup) -> None:
        if group.final and not group.open:
            del self._sending[req_id]
            self._done.released.add(req_id)

    # ------------------------------------------------------------ loads

    def load_ordered(self, order: LoadOrder, now: float) -> None:
        self._loading.setdefault(order.req_id, _LoadGroup(max(order.parts, 1), now))

    def loading(self, req_id: str) -> bool:
        """Whether a load of this request is under way (ordered, not yet reported)."""
        return req_id in self._loading

    def load_failed(self, req_id: str) -> bool:
        """Whether a part of this request has failed already (its other parts need not
        start)."""
        group = self._loading.get(req_id)
        return group is not None and group.failed

    def load_ended(self, order: LoadOrder, ok: bool, cause: str = "",
                   refused: bool = False, nbytes: int = 0) -> None:
        """Count a part; once every part of the request has ended (none can write into
        its blocks any more), report the request loaded, or failed with the blocks of
        the parts that failed and the first part's cause."""
        group = self._loading.get(order.req_id)
        if group is None:
            return
        group.ended += 1
        group.nbytes += nbytes
        if not ok:
            group.failed = True
            group.failed_blocks.extend(order.block_ids)
            group.cause = group.cause or cause
            group.refused = group.refused or refused
        if group.ended < group.expected:
            return
        del self._loading[order.req_id]
        if group.failed:
            self._stats.load_failures += 1
            self._done.failed[order.req_id] = group.failed_blocks
            self._done.causes[order.req_id] = group.cause
            if group.refused:
                self._done.refused.add(order.req_id)
        else:
            took = time.monotonic() - group.started
            self._stats.loads += 1
            self._stats.load_seconds += took
            self._stats.load_samples.append([took, group.nbytes])
            self._done.loaded.add(order.req_id)
            self._done.nbytes[order.req_id] = group.nbytes
