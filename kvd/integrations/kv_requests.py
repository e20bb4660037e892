"""Which requests a mover reports back: their parts counted, without the daemon.

A request may move in parts, one key each, and a hybrid model's in each of its KV cache
groups. The engine hears of the request, not of its parts: a send is *released* (the
engine may free its blocks) once a final part has come and no part holds the blocks any
more; a load has *ended* once every group's parts have, and then either loaded or failed
with the blocks of the parts that failed and the first cause. ``KvMover`` tells
``RequestParts`` what happened to each part; what the engine is to hear collects here
until the mover's next ``poll``.
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

    started: float  # time.monotonic() of its first part
    expected: dict[int, int] = field(default_factory=dict)  # parts, by KV cache group
    ended: int = 0
    failed_blocks: list[int] = field(default_factory=list)
    failed: bool = False
    cause: str = ""  # the first part's failure
    refused: bool = False  # a part was refused before it started (its cause said already)
    aborted: bool = False  # released while it loaded: the request is gone
    nbytes: int = 0  # what its parts brought


class RequestParts:
    """The parts of each request being sent or loaded, and what the engine is to hear."""

    def __init__(self, stats: MoverStats, groups: int = 1) -> None:
        self._stats = stats  # counts loads, their failures and refusals, per request
        self._groups = groups  # KV cache groups: a load has a part in each
        self._sending: dict[str, _SendGroup] = {}  # by request
        self._loading: dict[str, _LoadGroup] = {}  # by request
        self._done = Polled()

    def take_done(self) -> Polled:
        """What finished since the last call. A send is released here, not as its last
        part lets go, as every group's final orders come in one step, one after another."""
        for req_id, group in list(self._sending.items()):
            if group.final and not group.open:
                del self._sending[req_id]
                self._done.released.add(req_id)
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

    def release(self, order: SendOrder) -> None:
        """This part no longer needs the engine's blocks (again: nothing)."""
        group = self._sending.get(order.req_id)
        if group is not None:
            group.open.discard(order.key)

    # ------------------------------------------------------------ loads

    def load_ordered(self, order: LoadOrder, now: float) -> None:
        group = self._loading.setdefault(order.req_id, _LoadGroup(now))
        group.expected.setdefault(order.group, max(order.parts, 1))

    def loading(self, req_id: str) -> bool:
        """Whether a load of this request is under way (ordered, not yet reported)."""
        return req_id in self._loading

    def abort(self, req_id: str) -> None:
        """The request was released while it loads: its failure, if it fails, is no error."""
        group = self._loading.get(req_id)
        if group is not None:
            group.aborted = True

    def aborted(self, req_id: str) -> bool:
        group = self._loading.get(req_id)
        return group is not None and group.aborted

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
            if not group.cause:
                group.cause = f"group {order.group}: {cause}" if self._groups > 1 else cause
            group.refused = group.refused or refused
        if len(group.expected) < self._groups or group.ended < sum(group.expected.values()):
            return
        del self._loading[order.req_id]
        if group.failed:
            self._stats.load_failures += 1
            self._done.failed[order.req_id] = group.failed_blocks
            self._done.causes[order.req_id] = group.cause
            if group.refused:
                self._stats.loads_refused += 1
                self._done.refused.add(order.req_id)
            if group.aborted:
                self._done.aborted.add(order.req_id)
        else:
            took = time.monotonic() - group.started
            self._stats.loads += 1
            self._stats.load_seconds += took
            self._stats.load_samples.append([took, group.nbytes])
            self._done.loaded.add(order.req_id)
            self._done.nbytes[order.req_id] = group.nbytes
