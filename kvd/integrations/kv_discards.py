"""Keys pushed to this daemon that the engine does not need, taken and dropped.

A part of a prompt that decode has cached itself still arrives when prefill pushes it;
left alone it would hold the daemon's pool until its lease ends. Each such key is taken by
a get into a *sink*: blocks shaped like the engine's, as many as the largest key discarded,
in memory the daemon can map, shared by all discards (nobody reads what lands there). A
discard is taken at once if the key is there, the moment it arrives if not, and given up
when its timeout passes.

``KvMover`` owns the daemon client (a new one after a daemon restart), so it hands it to
every call here; ``Discards`` owns the discards in flight and the sink.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvd.client.base import Region
from kvd.client.sync import KvdClient, Transfer
from kvd.errors import KvdError
from kvd.integrations.kv_orders import DiscardOrder, MoverStats
from kvd.protocol import Share


@dataclass(eq=False)
class Sink:
    """A region that discarded keys are written into, shared by all discards."""

    region: Region
    num_blocks: int
    users: int = 0  # discards whose get writes into it


@dataclass(eq=False)
class Discarding:
    """One discard in flight: its get, once started, and the sink it writes into."""

    order: DiscardOrder
    deadline: float
    sink: Sink | None = None
    transfer: Transfer | None = None


class Discards:
    """The discards in flight, by key, and the sink new ones write into."""

    def __init__(self, blocks_like: Callable[[int], list[torch.Tensor]], stats: MoverStats,
                 note: Callable[[KvdError], None], connected: Callable[[], bool],
                 logger: logging.Logger) -> None:
        self._blocks_like = blocks_like  # n blocks like the engine's, mappable by the daemon
        self._stats = stats
        self._note = note  # tells the mover of an error (the daemon may have gone away)
        self._connected = connected  # whether the mover's daemon is there
        self.log = logger
        self._pending: dict[str, Discarding] = {}  # by key
        self._sink: Sink | None = None  # the one new discards write into

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, key: object) -> bool:
        return key in self._pending

    def in_flight(self) -> list[Discarding]:
        return list(self._pending.values())

    def forget_sink(self) -> None:
        """A new registration (a restarted daemon): the next discard makes a new sink."""
        self._sink = None

    def start(self, client: KvdClient, order: DiscardOrder) -> None:
        discard = self._pending[order.key] = Discarding(order,
                                                        time.monotonic() + order.timeout_s)
        self.advance(client, discard)

    def advance_all(self, client: KvdClient) -> None:
        for discard in list(self._pending.values()):
            self.advance(client, discard)

    def advance(self, client: KvdClient, discard: Discarding) -> None:
        order = discard.order
        try:
            if discard.transfer is None:
                left = discard.deadline - time.monotonic()
                if left <= 0:
                    raise KvdError(f"not started within {order.timeout_s:g}s")
                sink = discard.sink = self._sink_for(client, order.num_blocks)
                sink.users += 1
                discard.transfer = client.start_get(
                    order.key, sink.region, range(order.num_blocks), timeout_s=left,
                    share=Share(order.part, readers=order.readers), into=order.into)
                return
            if not discard.transfer.done():
                return
            discard.transfer.wait(0)
            self._stats.parts_dropped += 1
        except KvdError as err:
            self._note(err)
            # Not taken (prefill never sent it, or not in time): if it comes after all, it
            # stays in the daemon's pool until its lease ends, like any unclaimed put.
            self.log.info("kvd: part %s, cached here, was not taken: %s", order.key, err)
        self.end(client, discard)

    def _sink_for(self, client: KvdClient, num_blocks: int) -> Sink:
        """The sink, made (again, larger) when it has fewer blocks than asked; a smaller
        one goes once no discard writes into it."""
        sink = self._sink
        if sink is None or sink.num_blocks < num_blocks:
            if sink is not None and sink.users == 0:
                _unregister_sink(client, sink)
            self._sink = None
            # Named by size: a smaller one may still be registered, taking a discard.
            region = client.register(f"kv-discard-{num_blocks}", self._blocks_like(num_blocks))
            sink = self._sink = Sink(region, num_blocks)
        return sink

    def end(self, client: KvdClient, discard: Discarding) -> None:
        self._pending.pop(discard.order.key, None)
        sink, discard.sink = discard.sink, None
        if sink is not None:
            sink.users -= 1
            if sink is not self._sink and sink.users == 0 and self._connected():
                _unregister_sink(client, sink)

    def clear(self) -> None:
        self._pending.clear()


def _unregister_sink(client: KvdClient, sink: Sink) -> None:
    with contextlib.suppress(KvdError):  # a daemon that went away dropped it already
        client.unregister(sink.region)
