"""The data path of a hybrid model: one ``KvMover`` per KV cache group, heard as one.

Each group of a hybrid model (full attention, sliding window, recurrent state: see
``kv_groups``) has its own layers and its own block ids, and its layers' bytes may be the
same memory as another group's (vLLM lays every group over one allocation; a block id
belongs to one group at a time). So each group gets a mover of its own: its own client,
registration (or staging) and keys, and an order goes to the mover of its ``group``.

The engine hears of requests, not of groups: a request's send is released once the mover
of every group that got its final order has released it, and its load has ended once
every group's load has (none writes into its blocks any more), loaded if all loaded, else
failed with the first group's cause. Counters of bytes and keys add up over the movers;
those of requests (loads, failures, refusals, their seconds and samples) are counted here,
once per request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvd.errors import BadRequest, KvdError
from kvd.integrations.kv_mover import DiscardOrder, KvMover, LoadOrder, Polled, SendOrder
from kvd.integrations.kv_orders import MoverStats, ReleaseOrder, RenewOrder

# Counted here, once per request; every other counter is the sum of the movers'.
_PER_REQUEST = ("loads", "load_failures", "load_seconds", "loads_refused")


@dataclass(eq=False)
class _Loading:
    """A request being loaded: the groups whose loads have not ended yet."""

    pending: set[int]
    started: float
    failed_blocks: list[int] = field(default_factory=list)
    cause: str = ""
    refused: bool = False
    aborted: bool = False  # released before it ended: the request is gone
    nbytes: int = 0


class GroupMovers:
    """A mover per KV cache group, with the surface of one ``KvMover``."""

    def __init__(self, movers: Sequence[KvMover]) -> None:
        if not movers:
            raise BadRequest("no KV cache group to move")
        self.movers = list(movers)
        self.stats = MoverStats()
        self._sending: dict[str, set[int]] = {}  # by request: groups not released yet
        self._loading: dict[str, _Loading] = {}  # by request

    @property
    def direct(self) -> bool:
        return all(m.direct for m in self.movers)

    @property
    def block_bytes(self) -> int:
        """The bytes of a block in every group (each mover stages its own)."""
        return sum(m.block_bytes for m in self.movers)

    def _mover(self, group: int) -> KvMover:
        if not 0 <= group < len(self.movers):
            raise BadRequest(f"an order for KV cache group {group} of {len(self.movers)}")
        return self.movers[group]

    # ------------------------------------------------------------ orders

    def send(self, order: SendOrder) -> None:
        mover = self._mover(order.group)
        if order.final:
            self._sending.setdefault(order.req_id, set()).add(order.group)
        mover.send(order)

    def skip(self, order: SendOrder) -> None:
        mover = self._mover(order.group)
        if order.final:
            self._sending.setdefault(order.req_id, set()).add(order.group)
        mover.skip(order)

    def load(self, order: LoadOrder) -> None:
        """Every group loads each request it is ordered for; the request has ended once
        each group's loads have."""
        mover = self._mover(order.group)
        self._loading.setdefault(order.req_id, _Loading(set(range(len(self.movers))),
                                                        time.monotonic()))
        mover.load(order)

    def discard(self, order: DiscardOrder) -> None:
        self._mover(order.group).discard(order)

    def renew(self, order: RenewOrder) -> None:
        self._mover(order.group).renew(order)

    def release(self, order: ReleaseOrder) -> None:
        self._mover(order.group).release(order)

    # ------------------------------------------------------------ what ended

    def poll(self) -> Polled:
        done = Polled()
        for group, mover in enumerate(self.movers):
            got = mover.poll()
            for req_id in got.released:
                waiting = self._sending.get(req_id)
                if waiting is not None:
                    waiting.discard(group)
                    if waiting:
                        continue
                    del self._sending[req_id]
                done.released.add(req_id)
            for req_id in got.loaded | set(got.failed):
                self._load_ended(done, group, req_id, got)
        self._add_up()
        return done

    def _load_ended(self, done: Polled, group: int, req_id: str, got: Polled) -> None:
        loading = self._loading.get(req_id)
        if loading is None:
            return
        loading.pending.discard(group)
        if req_id in got.failed:
            loading.failed_blocks += got.failed[req_id]
            loading.cause = loading.cause or f"group {group}: {got.causes.get(req_id, '')}"
            loading.refused = loading.refused or req_id in got.refused
            loading.aborted = loading.aborted or req_id in got.aborted
        loading.nbytes += got.nbytes.get(req_id, 0)
        if loading.pending:
            return
        del self._loading[req_id]
        if loading.cause:
            self.stats.load_failures += 1
            done.failed[req_id] = loading.failed_blocks
            done.causes[req_id] = loading.cause
            if loading.refused:
                self.stats.loads_refused += 1
                done.refused.add(req_id)
            if loading.aborted:
                done.aborted.add(req_id)
            return
        took = time.monotonic() - loading.started
        self.stats.loads += 1
        self.stats.load_seconds += took
        self.stats.load_samples.append([took, loading.nbytes])
        done.loaded.add(req_id)
        done.nbytes[req_id] = loading.nbytes

    def _add_up(self) -> None:
        for name in self.stats.as_dict():
            if name not in _PER_REQUEST:
                setattr(self.stats, name, sum(getattr(m.stats, name) for m in self.movers))
        for mover in self.movers:
            samples = mover.stats.take_samples()  # its load samples are per group: dropped
            self.stats.send_samples += samples["send_samples"]

    # ------------------------------------------------------------ shutdown

    def close(self, timeout_s: float = 5.0) -> None:
        """Close every mover (each its own client), whatever the others raised."""
        errors = []
        for mover in self.movers:
            try:
                mover.close(timeout_s)
            except KvdError as exc:  # the rest close all the same
                errors.append(exc)
        self._sending.clear()
        self._loading.clear()
        if errors:
            raise errors[0]
