"""Renewals and releases of keys that prefill lent for this engine to pull, or pushes.

Decode's requests wait in its engine's queue, and prefill's daemon keeps their blocks for
a lease. While a request waits to load, its lease is renewed (``renew``); when it will
not load (aborted, computed here, its load failed), the key is released (``release``) and
prefill gets its blocks back at once. A pushed key decode will not load (a part it has
cached) is released both at this engine's daemon ("local") and at prefill's, which then
never sends it. Each is one request to this engine's daemon, which asks prefill's
(``KvdClient.renew`` / ``release``); it is polled, never waited for.

``KvMover`` owns the daemon clients (new ones after a daemon restart), so it hands the
order's group's to every call here; ``LeaseCalls`` owns the calls in flight, one per kind,
key and daemon.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvd.client.sync import KvdClient, Transfer
from kvd.errors import KeyGone, KvdError, UnknownKey
from kvd.integrations.kv_orders import MoverStats, ReleaseOrder, RenewOrder

# How long a renewal or a release may take (prefill's daemon linked, asked, answered).
CALL_TIMEOUT_S = 10.0


@dataclass(eq=False)
class _Call:
    order: RenewOrder | ReleaseOrder
    transfer: Transfer


class LeaseCalls:
    """The renewals and releases in flight, by (kind, key)."""

    def __init__(self, stats: MoverStats, note: Callable[[KvdError], None],
                 logger: logging.Logger) -> None:
        self._stats = stats
        self._note = note  # tells the mover of an error (the daemon may have gone away)
        self.log = logger
        self._calls: dict[tuple[str, str, str], _Call] = {}  # by kind, key, source

    def __len__(self) -> int:
        return len(self._calls)

    def start(self, client: KvdClient, order: RenewOrder | ReleaseOrder) -> None:
        """Renew or release, unless the last such call for the key is still on its way."""
        ident = ("renew" if isinstance(order, RenewOrder) else "release", order.key,
                 order.source)
        if ident in self._calls:
            return
        try:
            if isinstance(order, RenewOrder):
                transfer = client.renew(order.key, order.source, ttl_s=order.ttl_s,
                                        timeout_s=CALL_TIMEOUT_S)
            else:
                transfer = client.release(order.key, order.source, timeout_s=CALL_TIMEOUT_S,
                                          skip=order.skip)
            self._calls[ident] = _Call(order, transfer)
        except KvdError as err:
            self._note(err)
            self.log.warning("kvd: %s of key %s (request %s) at %s failed: %s", ident[0],
                             order.key, order.req_id, order.source, err)

    def advance_all(self) -> None:
        for ident, call in list(self._calls.items()):
            if not call.transfer.done():
                continue
            del self._calls[ident]
            order = call.order
            try:
                call.transfer.wait(0)
            except (KeyGone, UnknownKey) as err:
                # Not lent yet, or gone already (pulled, its lease over, released): no
                # lease to renew or release. The load, if any, says what it finds.
                self.log.debug("kvd: %s of key %s at %s: %s", ident[0], order.key,
                               order.source, err)
            except KvdError as err:
                self._note(err)
                self.log.warning("kvd: %s of key %s (request %s) at %s failed: %s",
                                 ident[0], order.key, order.req_id, order.source, err)
            else:
                if isinstance(order, RenewOrder):
                    self._stats.leases_renewed += 1
                elif order.skip:  # a pushed key's cached blocks: the rest still comes
                    self.log.debug("kvd: request %s has key %s's first %d blocks: released "
                                   "at %s", order.req_id, order.key, order.skip, order.source)
                elif order.source == "local":  # a pushed key, at this engine's daemon
                    self.log.debug("kvd: request %s will not load key %s: released here",
                                   order.req_id, order.key)
                else:
                    self._stats.leases_released += 1
                    self.log.info("kvd: request %s will not load key %s: released at %s",
                                  order.req_id, order.key, order.source)

    def clear(self) -> None:
        """Forget every call (the daemon went away, or the mover closes: its client's close
        stops what is left)."""
        self._calls.clear()
