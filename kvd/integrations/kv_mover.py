"""Moving one engine's paged KV blocks through its kvd daemon, without the engine's types.

This is the data path of the vLLM connector (``kvd.integrations.vllm``), kept free of vLLM
so that it is tested in kvd's own suite. A ``KvMover`` lives in the worker process that
owns the KV tensors (one per layer, blocks on one dimension, the same block ids in every
layer). It registers them with the daemon once and then, driven by the engine's step loop,
never blocks:

- ``send(order)``: the request's blocks leave under a key. Pull flow: they are *lent*
  (published for exactly one reader, the decode daemon's pull); push flow: they are *put*
  to the decode daemon. The blocks stay the engine's until ``poll`` reports the request in
  ``released``.
- ``load(order)``: blocks arrive under a key into the request's new blocks: pulled from
  the prefill daemon (pull flow, retried while the key is not lent yet) or taken from
  this daemon when the prefill daemon pushes them (push flow).
- ``discard(order)``: a key pushed to this daemon that the engine does not need (a part
  of a prompt it has cached itself) is released, here and at the daemon that pushes it:
  that one sends nothing, and what came already (or comes anyway) is dropped here, so
  that it never waits in the daemon's pool for its lease.
- ``renew(order)`` / ``release(order)``: a key lent at the prefill daemon for a request
  of this engine is kept there longer (the request waits in the engine's queue), or freed
  now (the request will not load it). A pull-flow load that fails releases its key too.
- ``poll()``: what finished since the last call: sends whose blocks the engine may free,
  loads that completed, loads that failed (with the block ids that hold no valid data and
  the cause).

GPU tensors are registered in place (CUDA IPC) and move without copies. CPU tensors of an
engine are private memory the daemon cannot map, so they go through a *staging* region in
shared memory: a send copies the blocks into staging slots (the engine's blocks are free
at once), a load lands in staging and is copied into the blocks. A load whose first blocks
are already cached locally (a prefix hit) takes only the others: the daemon skips the
cached ones at the source (``Share.skip``). When prefill splits its KV heads over another
number of ranks than decode (``kv_ranks``), a load is one read per prefill rank it takes
heads from: a part of each of that rank's blocks into a part of each of its own, in place
on GPU. Every wait has a deadline: a send is withdrawn when its lease ends, a load fails
when its timeout passes. If the daemon goes away (restarted, upgraded), what was
in flight fails, new orders fail at once, and the mover connects and registers again by
itself as soon as a daemon answers on the socket: kvd restarts without the engine
restarting.

Log lines go to the logger the caller gives (the vLLM connector's, so that they reach
vLLM's log), else to this module's.

This module holds ``KvMover`` itself: its sends, loads, staging region and reconnection.
Beside it: ``kv_orders`` (the orders, ``Polled`` and ``MoverStats``), ``kv_parts`` (how a
request is cut into keyed parts), ``kv_requests`` (what each request's parts add up to),
``kv_staging`` (block arithmetic and copies of staging) and ``kv_leases`` (renewals and
releases in flight, discards' too). Every public name of
these is importable from here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvd.client.sync import KvdClient, Transfer
from kvd.errors import (
    BadRequest,
    DaemonUnavailable,
    KeyGone,
    KvdError,
    PeerUnreachable,
    UnknownKey,
)
from kvd.integrations.kv_leases import LeaseCalls
from kvd.integrations.kv_orders import (
    DiscardOrder,
    LoadOrder,
    MoverStats,
    Polled,
    ReleaseOrder,
    RenewOrder,
    SendOrder,
)
from kvd.integrations.kv_parts import blocks_for, part_key, part_ranges
from kvd.integrations.kv_requests import RequestParts
from kvd.integrations.kv_staging import (
    Slots,
    block_dim_of,
    blocks_like,
    copy_blocks,
    part_pair,
    wide_pair,
)
from kvd.protocol import WHOLE, Part, Share

__all__ = [  # the mover's surface; callers import all of it from here
    "DiscardOrder", "KvMover", "LoadOrder", "MoverStats", "Polled", "ReleaseOrder",
    "RenewOrder", "SendOrder", "block_dim_of", "blocks_for", "part_key", "part_ranges",
]

log = logging.getLogger(__name__)

PULL_RETRY_S = 0.01  # a pull that finds no key yet (prefill has not lent it) tries again
# A pull waits at prefill's daemon for the key to be lent until this long before its own
# deadline, so that a key that never comes is answered (UnknownKey) before the pull's
# timeout: the load then fails with that answer, not with a timeout.
PULL_KEY_MARGIN_S = 0.25
RECONNECT_S = 1.0  # after the daemon went away: how often to try a restarted one
HELLO_TIMEOUT_S = 0.2  # a reconnect attempt blocks the engine's step at most this long


@dataclass(eq=False)
class _Send:
    order: SendOrder
    deadline: float
    started: float = field(default_factory=time.monotonic)
    slots: list[int] | None = None
    transfer: Transfer | None = None
    nbytes: int = 0  # the key's bytes, all of them


@dataclass(eq=False)
class _Load:
    order: LoadOrder
    deadline: float
    slots: list[int] | None = None
    transfer: Transfer | None = None
    retry_at: float = 0.0




class KvMover:
    """The worker side of a connector: one daemon client, one registration, no blocking."""

    def __init__(self, client: KvdClient, layers: Sequence[torch.Tensor], num_blocks: int,
                 staging_blocks: int, name: str = "kv",
                 logger: logging.Logger | None = None) -> None:
        self.log = logger or log
        if not layers:
            raise BadRequest("no KV tensors to register")
        self.client = client
        self.num_blocks = num_blocks
        self.block_dims = [block_dim_of(t, num_blocks) for t in layers]
        # Block-major views: index 0 picks a block, in every layer.
        self.layers = [t.movedim(d, 0) if d else t for t, d in zip(layers, self.block_dims,
                                                                   strict=True)]
        self.direct = all(t.is_cuda for t in layers)
        if not self.direct and any(t.is_cuda for t in layers):
            raise BadRequest("KV tensors are on both CPU and GPU")
        self.block_bytes = sum(t[0].numel() * t.element_size() for t in self.layers)
        if self.direct and len(set(self.block_dims)) != 1:
            raise BadRequest(f"KV tensors have their blocks on different dims {self.block_dims}")
        self._tensors = list(layers)
        self._name = name
        self._staging_blocks = staging_blocks
        self.region: Any = None
        self._staging: list[torch.Tensor] | None = None
        self._staging_region: Any = None
        self._wide_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (layer, staging)
        self._part_pairs: dict[Part, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._slots = Slots(0)
        self.stats = MoverStats()
        self.connected = True  # False from when the daemon goes away until one is back
        self._register()
        self._reconnect_at = 0.0
        self._sends: dict[str, _Send] = {}  # by key
        self._loads: dict[str, _Load] = {}  # by key
        self._requests = RequestParts(self.stats)  # what the engine hears, by request
        self._leases = LeaseCalls(self.stats, self._note, self.log)
        self._aborted: set[str] = set()  # requests released while their loads were running

    def _register(self) -> None:
        """Register with the daemon: GPU tensors in place, CPU ones through staging.
        Staging is made anew each time (memory an old daemon may still hold is not
        reused)."""
        self._staging, self._staging_region, self._slots = None, None, Slots(0)
        if self.direct:
            self.region = self.client.register(self._name, self._tensors,
                                               block_dim=self.block_dims[0])
        else:
            self._make_staging()

    # ------------------------------------------------------------ the daemon goes away

    def _note(self, err: KvdError) -> None:
        if isinstance(err, DaemonUnavailable) and self.connected:
            self.log.error("kvd daemon at %s went away: failing what is in flight, and "
                           "trying every %gs to reach it again", self.client.socket_path,
                           RECONNECT_S)
            self.connected = False

    def _recover(self) -> None:
        """Fail everything in flight (its daemon is gone, so no byte can land any more),
        then, at most every ``RECONNECT_S``, try a restarted daemon: a new client and a new
        registration. Until then new orders fail at once (decode recomputes)."""
        for send in list(self._sends.values()):
            self.stats.send_failures += 1
            self._end_send(send)
        for load in list(self._loads.values()):
            self._end_load(load)
            self._requests.load_ended(load.order, ok=False, cause="the kvd daemon went away")
        self._leases.clear()
        now = time.monotonic()
        if now < self._reconnect_at:
            return
        self._reconnect_at = now + RECONNECT_S
        client = KvdClient(self.client.socket_path, name=self.client.name)
        try:
            client.connect(timeout_s=HELLO_TIMEOUT_S)
        except KvdError:
            return  # not back yet
        old, self.client = self.client, client
        with contextlib.suppress(KvdError, OSError):
            old.close()
        try:
            self._register()
        except KvdError as err:
            self.log.error("kvd: registering with the restarted daemon failed: %s", err)
            return
        self.connected = True
        self.log.info("kvd daemon at %s is back: registered again", client.socket_path)

    # ------------------------------------------------------------ staging

    def _make_staging(self) -> None:
        n = self._staging_blocks
        if n <= 0:
            raise BadRequest("staging_blocks must be positive for CPU KV tensors")
        tensors = blocks_like(self.layers, n, on_gpu=self.direct)
        self._staging = tensors
        self._staging_region = self.client.register("kv-staging", tensors)
        self._part_pairs = {}
        self._wide_pairs = [wide_pair(t, st) for t, st in zip(self.layers, tensors,
                                                              strict=True)]
        self._slots = Slots(n)

    def _take_slots(self, n: int) -> list[int] | None:
        if self._staging is None:
            self._make_staging()
        if n > self._slots.count:
            raise BadRequest(f"{n} blocks do not fit in {self._slots.count} staging blocks "
                             "(raise staging_blocks)")
        return self._slots.take(n)

    def _stage(self, block_ids: Sequence[int], slots: Sequence[int], inward: bool,
               part: Part = WHOLE) -> None:
        """Engine blocks into staging slots (``inward``), or staging slots into blocks
        (only ``part`` of each)."""
        pairs = self._wide_pairs
        if part != WHOLE:
            if part not in self._part_pairs:
                assert self._staging is not None
                self._part_pairs[part] = [part_pair(t, st, part) for t, st in
                                          zip(self.layers, self._staging, strict=True)]
            pairs = self._part_pairs[part]
        copy_blocks(pairs, block_ids, slots, inward)

    # ------------------------------------------------------------ orders

    def send(self, order: SendOrder) -> None:
        """Start sending (never raises: a bad order is logged, counted and released)."""
        refused = order.key in self._sends
        self._requests.send_ordered(order, holds=not refused)
        if refused:
            self.stats.send_failures += 1
            self.log.error("kvd send %s: key %r is already being sent: not sending",
                           order.req_id, order.key)
            return
        send = self._sends[order.key] = _Send(order, time.monotonic() + order.lease_s)
        if not self._valid(order.block_ids):
            self.stats.send_failures += 1
            self.log.error("kvd send %s: block ids %s outside 0..%d: not sending",
                           order.req_id, order.block_ids, self.num_blocks - 1)
            self._end_send(send)
            return
        self._advance_send(send)

    def skip(self, order: SendOrder) -> None:
        """A send this engine need not make (another tensor-parallel rank sends the same
        KV heads): its blocks are released as if it had been made."""
        self._requests.send_ordered(order, holds=False)

    def _valid(self, block_ids: Sequence[int]) -> bool:
        return all(0 <= b < self.num_blocks for b in block_ids)

    def load(self, order: LoadOrder) -> None:
        """Start loading (never raises: a bad order is logged and reported failed)."""
        now = time.monotonic()
        self._requests.load_ordered(order, now)
        if order.refusal:
            self.stats.loads_refused += 1
            self._requests.load_ended(order, ok=False, cause=order.refusal, refused=True)
            return
        load = _Load(order, now + order.timeout_s)
        if (order.key in self._loads
                or len(order.block_ids) != order.remote_blocks - order.first
                or order.first < 0 or not self._valid(order.block_ids)):
            self.log.error("kvd load %s of %r: blocks %s for %d remote blocks from %d, or the "
                           "key is loading already: not loading", order.req_id, order.key,
                           order.block_ids, order.remote_blocks, order.first)
            self._requests.load_ended(order, ok=False,
                                      cause=f"bad load order for key {order.key!r}")
            return
        self._loads[order.key] = load
        self._advance_load(load)

    def renew(self, order: RenewOrder) -> None:
        """Keep ``order.key`` lent at its source longer (never raises: a failure is
        logged). Not while this engine's pull of it waits there: that takes it the moment
        it is lent."""
        load = self._loads.get(order.key)
        if self.connected and (load is None or load.transfer is None):
            self._leases.renew(self.client, order)

    def release(self, order: ReleaseOrder) -> None:
        """Free ``order.key`` at its source now: the request will not load it (never
        raises). A pull of it waiting there fails at once, and its load is reported
        failed without an error: the request is gone."""
        if self._requests.loading(order.req_id):
            self._aborted.add(order.req_id)
        if self.connected:
            self._leases.release(self.client, order)

    def _release_lent(self, order: LoadOrder) -> None:
        """A pull-flow load that will not happen: its key is freed at prefill."""
        if order.source is not None and self.connected:
            self._leases.release(self.client, ReleaseOrder(order.req_id, order.key,
                                                           order.source, order.their_tp))

    def poll(self) -> Polled:
        if not self.connected:
            self._recover()
        for send in list(self._sends.values()):
            self._advance_send(send)
        for load in list(self._loads.values()):
            self._advance_load(load)
        self._leases.advance_all()
        done = self._requests.take_done()
        if self._aborted:
            done.aborted = self._aborted & set(done.failed)
            self._aborted -= done.failed.keys() | done.loaded
        return done

    # ------------------------------------------------------------ sends

    def _advance_send(self, send: _Send) -> None:
        order = send.order
        try:
            if send.transfer is None:
                self._start_send(send)
            elif send.transfer.done():
                try:
                    nbytes = send.transfer.wait(0)
                except KeyGone:
                    if order.push_to is None:
                        raise
                    nbytes = 0  # pushed: refused by decode's daemon, released there
                self.stats.sends += 1
                self.stats.bytes_sent += nbytes
                if nbytes < send.nbytes and (order.push_to is not None or nbytes
                                             or time.monotonic() < send.deadline):
                    self.stats.bytes_unsent += send.nbytes - nbytes  # (unread: not these)
                self.stats.send_samples.append([time.monotonic() - send.started, nbytes])
                if nbytes == 0:
                    if order.push_to is not None or time.monotonic() < send.deadline:
                        # Its reader said it will not come (decode has it cached, or the
                        # request is gone): a push sent nothing, a lend was not read.
                        self.stats.sends_released += 1
                        self.log.info("kvd send %s: key %s was released by its reader "
                                      "(decode will not load it)", order.req_id, order.key)
                    else:
                        self.stats.sends_unread += 1
                        self.log.warning("kvd send %s: key %s was not pulled within its %gs "
                                         "lease", order.req_id, order.key, order.lease_s)
                self._end_send(send)
        except KvdError as err:
            self._note(err)
            self.stats.send_failures += 1
            self.log.error("kvd send %s (key %s) failed: %s", order.req_id, order.key, err)
            self._end_send(send)

    def _start_send(self, send: _Send) -> None:
        order = send.order
        left = send.deadline - time.monotonic()
        if left <= 0:
            raise KvdError(f"no staging room within its {order.lease_s:g}s lease")
        if self.direct and not order.stage:
            region, blocks = self.region, order.block_ids
        else:
            slots = self._take_slots(len(order.block_ids))
            if slots is None:
                return  # staging is full: try again at the next poll
            send.slots = slots
            self._stage(order.block_ids, slots, inward=True)
            self._requests.release(order)  # the bytes are in staging: the blocks are free
            region, blocks = self._staging_region, slots
        send.nbytes = len(blocks) * sum(e.bytes_per_block for e in region.layout)
        if order.push_to is None:
            send.transfer = self.client.lend(order.key, region, blocks, ttl_s=left)
        else:
            send.transfer = self.client.put(order.key, region, blocks, to=order.push_to,
                                            ttl_s=order.lease_s, timeout_s=left)

    def _end_send(self, send: _Send) -> None:
        self._sends.pop(send.order.key, None)
        if send.slots is not None:
            self._slots.give(send.slots)
            send.slots = None
        self._requests.release(send.order)

    # ------------------------------------------------------------ loads

    def _advance_load(self, load: _Load) -> None:
        order = load.order
        now = time.monotonic()
        try:
            if load.transfer is None:
                if self._requests.load_failed(order.req_id):
                    raise KvdError("another part of this request failed")
                if now >= load.retry_at:  # a retry is always due before the deadline
                    self._start_load(load, now)
                return
            if not load.transfer.done():
                return
            try:
                nbytes = load.transfer.wait(0)
            except UnknownKey as err:
                # Pull flow: the key did not appear while the pull waited at prefill's
                # daemon (that daemon held too many waiting pulls, or no time was left).
                # One that was there and is gone (its lease ended, say) will not come.
                if isinstance(err, KeyGone):
                    self.stats.loads_gone += 1
                    raise
                if time.monotonic() + PULL_RETRY_S >= load.deadline:
                    raise
                load.transfer, load.retry_at = None, time.monotonic() + PULL_RETRY_S
                self.stats.pull_retries += 1
                return
            if load.slots is not None:
                self._stage(order.block_ids, load.slots, inward=False, part=order.into)
            self.stats.bytes_received += nbytes
            self._end_load(load)
            self._requests.load_ended(order, ok=True, nbytes=nbytes)
        except KvdError as err:
            self._note(err)
            # The request's failure, with its first cause, is the caller's to log (poll).
            self.log.warning("kvd load %s (key %s) failed: %s", order.req_id, order.key, err)
            self._end_load(load)
            self._requests.load_ended(order, ok=False, cause=f"key {order.key!r}: {err}")
            if not isinstance(err, KeyGone | PeerUnreachable) and (
                    order.req_id not in self._aborted):
                # (Gone, or its daemon gone: nothing to free. Aborted: released already.)
                self._release_lent(order)

    def _start_load(self, load: _Load, now: float) -> None:
        order = load.order
        left = load.deadline - now
        if left <= 0:
            raise KvdError(f"key {order.key!r} did not come within {order.timeout_s:g}s")
        if self.direct:
            region, blocks = self.region, order.block_ids
        else:
            if load.slots is None:
                load.slots = self._take_slots(len(order.block_ids))
                if load.slots is None:
                    return  # staging is full: try again at the next poll
            region, blocks = self._staging_region, load.slots
        # Only the blocks not cached here cross the wire (a prefix hit skips the others).
        share = Share(order.part, skip=order.first, readers=order.readers)
        if order.source is None:
            load.transfer = self.client.start_get(order.key, region, blocks, timeout_s=left,
                                                  share=share, into=order.into,
                                                  sender=order.sender)
        else:
            # Prefill lends one engine step after it answered, so the pull often comes
            # first: it waits there for the key and is served the moment it is lent.
            load.transfer = self.client.start_pull(
                order.key, order.source, region, blocks, timeout_s=left,
                wait_for_key_s=max(0.0, left - PULL_KEY_MARGIN_S), share=share,
                into=order.into)

    def _end_load(self, load: _Load) -> None:
        self._loads.pop(load.order.key, None)
        if load.slots is not None:
            self._slots.give(load.slots)
            load.slots = None

    # ------------------------------------------------------------ discards

    def discard(self, order: DiscardOrder) -> None:
        """Release a pushed key this engine will not load, here and at its sender (never
        raises: a failure is logged). Only the bytes decode does not have cross the wire:
        prefill's daemon, told first, sends nothing; what came already, or comes anyway,
        is dropped here. With ``order.skip``, the key's first blocks only, at its sender:
        the load of the rest goes on."""
        if order.skip:
            if self.connected and order.sender is not None:
                self._leases.release(self.client, ReleaseOrder(
                    order.req_id, order.key, order.sender, order.their_tp, order.group,
                    order.skip))
            return
        if order.key in self._loads:
            self.log.error("kvd discard of %r: a key being loaded: not releasing it",
                           order.key)
            return
        self.stats.parts_dropped += 1
        if not self.connected:
            return  # (a restarted daemon holds nothing of it)
        for source in ("local", order.sender):
            if source is not None:
                self._leases.release(self.client, ReleaseOrder(
                    order.req_id, order.key, source, order.their_tp, order.group))

    # ------------------------------------------------------------ shutdown

    def close(self, timeout_s: float = 5.0) -> None:
        """Withdraw what is in flight (bounded), then close the client: the daemon drops
        this client's registrations."""
        items: list[_Send | _Load] = [*self._sends.values(), *self._loads.values()]
        for item in items:
            if item.transfer is not None and not item.transfer.done():
                try:
                    item.transfer.cancel(timeout_s)
                except KvdError as err:
                    self.log.warning("kvd: cancelling key %s at shutdown: %s",
                                     item.order.key, err)
        self._sends.clear()
        self._loads.clear()
        self._leases.clear()
        self._requests.clear()
        self.client.close()


