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

A request may move in parts, one key each, and a hybrid model's in each of its KV cache
groups (``kv_groups``), which have their own layers and block ids, laid over one
allocation: each group is registered apart (``kv_staging``), and an order goes to the
registration of its ``group``. The engine hears of requests, not of parts
(``RequestParts``).

Log lines go to the logger the caller gives (the vLLM connector's, so that they reach
vLLM's log), else to this module's. The orders, ``Polled`` and ``MoverStats`` are
``kv_orders``' (importable from here).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvd.client.sync import KvdClient, Transfer
from kvd.errors import DaemonUnavailable, KeyGone, KvdError, PeerUnreachable, UnknownKey
from kvd.integrations.kv_orders import (
    DiscardOrder,
    LoadOrder,
    MoverStats,
    Polled,
    ReleaseOrder,
    RenewOrder,
    SendOrder,
)
from kvd.integrations.kv_staging import Registration, block_dim_of
from kvd.protocol import Share

__all__ = [  # the mover's surface; callers import all of it from here
    "DiscardOrder", "KvMover", "LoadOrder", "MoverStats", "Polled", "ReleaseOrder",
    "RenewOrder", "SendOrder", "block_dim_of",
]

log = logging.getLogger(__name__)

PULL_RETRY_S = 0.01  # a pull that finds no key yet (prefill has not lent it) tries again
# A pull waits at prefill's daemon for the key to be lent until this long before its own
# deadline, so that a key that never comes is answered (UnknownKey) before the pull's
# timeout: the load then fails with that answer, not with a timeout.
PULL_KEY_MARGIN_S = 0.25
RECONNECT_S = 1.0  # after the daemon went away: how often to try a restarted one
HELLO_TIMEOUT_S = 0.2  # a reconnect attempt blocks the engine's step at most this long
# How long a renewal or a release may take (prefill's daemon linked, asked, answered).
CALL_TIMEOUT_S = 10.0


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
    """The worker side of a connector: a registration per KV cache group, no blocking.

    ``client`` and ``layers`` are the first group's; ``more_groups``, a hybrid model's
    other groups (``order.group`` 1, 2, ...), each with its layers and a client of its own.
    Orders go to the registration of their group; ``poll`` reports requests, not groups.
    """

    def __init__(self, client: KvdClient, layers: Sequence[torch.Tensor], num_blocks: int,
                 staging_blocks: int, name: str = "kv", logger: logging.Logger | None = None,
                 more_groups: Sequence[tuple[KvdClient, Sequence[torch.Tensor]]] = (),
                 ) -> None:
        self.log = logger or log
        self.num_blocks = num_blocks
        groups = [(client, layers), *more_groups]
        self.groups = [Registration(c, ls, num_blocks, staging_blocks,
                                    f"{name}-g{g}" if more_groups else name)
                       for g, (c, ls) in enumerate(groups)]
        self.layers = self.groups[0].layers
        self.direct = all(r.direct for r in self.groups)
        self.block_bytes = sum(r.block_bytes for r in self.groups)  # a block of every group
        self.stats = MoverStats()
        self.connected = True  # False from when the daemon goes away until one is back
        self._reconnect_at = 0.0
        self._sends: dict[str, _Send] = {}  # by key
        self._loads: dict[str, _Load] = {}  # by key
        self._requests = RequestParts(self.stats, len(groups))  # what the engine hears
        self._leases = LeaseCalls(self.stats, self._note, self.log)

    @property
    def client(self) -> KvdClient:
        return self.groups[0].client

    # ------------------------------------------------------------ the daemon goes away

    def _note(self, err: KvdError) -> None:
        if isinstance(err, DaemonUnavailable) and self.connected:
            self.log.error("kvd daemon at %s went away: failing what is in flight, and "
                           "trying every %gs to reach it again", self.client.socket_path,
                           RECONNECT_S)
            self.connected = False

    def _recover(self) -> None:
        """Fail everything in flight (its daemon is gone, so no byte can land any more),
        then, at most every ``RECONNECT_S``, try a restarted daemon: new clients and new
        registrations. Until then new orders fail at once (decode recomputes)."""
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
        try:
            for reg in self.groups:
                client = KvdClient(reg.client.socket_path, name=reg.client.name)
                client.connect(timeout_s=HELLO_TIMEOUT_S)
                old, reg.client = reg.client, client
                with contextlib.suppress(KvdError, OSError):
                    old.close()
        except KvdError:
            return  # not back yet
        try:
            for reg in self.groups:
                reg.register()
        except KvdError as err:
            self.log.error("kvd: registering with the restarted daemon failed: %s", err)
            return
        self.connected = True
        self.log.info("kvd daemon at %s is back: registered again", self.client.socket_path)

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
        if not self._valid(order.group, order.block_ids):
            self.stats.send_failures += 1
            self.log.error("kvd send %s: group %d, block ids %s outside 0..%d: not sending",
                           order.req_id, order.group, order.block_ids, self.num_blocks - 1)
            self._end_send(send)
            return
        self._advance_send(send)

    def skip(self, order: SendOrder) -> None:
        """A send this engine need not make (another tensor-parallel rank sends the same
        KV heads): its blocks are released as if it had been made."""
        self._requests.send_ordered(order, holds=False)

    def _valid(self, group: int, block_ids: Sequence[int]) -> bool:
        return 0 <= group < len(self.groups) and all(0 <= b < self.num_blocks
                                                     for b in block_ids)

    def load(self, order: LoadOrder) -> None:
        """Start loading (never raises: a bad order is logged and reported failed)."""
        now = time.monotonic()
        self._requests.load_ordered(order, now)
        if order.refusal:
            self._requests.load_ended(order, ok=False, cause=order.refusal, refused=True)
            return
        load = _Load(order, now + order.timeout_s)
        if (order.key in self._loads
                or len(order.block_ids) != order.remote_blocks - order.first
                or order.first < 0 or not self._valid(order.group, order.block_ids)):
            self.log.error("kvd load %s of %r: group %d, blocks %s for %d remote blocks from "
                           "%d, or the key is loading already: not loading", order.req_id,
                           order.key, order.group, order.block_ids, order.remote_blocks,
                           order.first)
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
            self._leases.start(self._client(order.group), order)

    def release(self, order: ReleaseOrder) -> None:
        """Free ``order.key`` at its source now: the request will not load it (never
        raises). A pull of it waiting there fails at once, and its load is reported
        failed without an error: the request is gone."""
        self._requests.abort(order.req_id)
        if self.connected:
            self._leases.start(self._client(order.group), order)

    def _client(self, group: int) -> KvdClient:
        return self.groups[group if 0 <= group < len(self.groups) else 0].client

    def poll(self) -> Polled:
        if not self.connected:
            self._recover()
        for send in list(self._sends.values()):
            self._advance_send(send)
        for load in list(self._loads.values()):
            self._advance_load(load)
        self._leases.advance_all()
        return self._requests.take_done()

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
        reg = self.groups[order.group]
        if reg.direct and not order.stage:
            region, blocks = reg.region, order.block_ids
        else:
            slots = reg.take_slots(len(order.block_ids))
            if slots is None:
                return  # staging is full: try again at the next poll
            send.slots = slots
            reg.stage(order.block_ids, slots, inward=True)
            self._requests.release(order)  # the bytes are in staging: the blocks are free
            region, blocks = reg.staging_region, slots
        send.nbytes = len(blocks) * sum(e.bytes_per_block for e in region.layout)
        if order.push_to is None:
            send.transfer = reg.client.lend(order.key, region, blocks, ttl_s=left)
        else:
            send.transfer = reg.client.put(order.key, region, blocks, to=order.push_to,
                                           ttl_s=order.lease_s, timeout_s=left)

    def _end_send(self, send: _Send) -> None:
        self._sends.pop(send.order.key, None)
        if send.slots is not None:
            self.groups[send.order.group].slots.give(send.slots)
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
                self.groups[order.group].stage(order.block_ids, load.slots, inward=False,
                                               part=order.into)
            self.stats.bytes_received += nbytes
            self._end_load(load)
            self._requests.load_ended(order, ok=True, nbytes=nbytes)
        except KvdError as err:
            self._note(err)
            # The request's failure, with its first cause, is the caller's to log (poll).
            self.log.warning("kvd load %s (key %s) failed: %s", order.req_id, order.key, err)
            self._end_load(load)
            if (order.source is not None and self.connected
                    and not isinstance(err, KeyGone | PeerUnreachable)
                    and not self._requests.aborted(order.req_id)):
                # A pull-flow load that will not happen: its key is freed at prefill. (Gone,
                # or its daemon gone: nothing to free. Aborted: released already.)
                self._leases.start(self._client(order.group), ReleaseOrder(
                    order.req_id, order.key, order.source, order.their_tp, order.group))
            self._requests.load_ended(order, ok=False, cause=f"key {order.key!r}: {err}")

    def _start_load(self, load: _Load, now: float) -> None:
        order = load.order
        left = load.deadline - now
        if left <= 0:
            raise KvdError(f"key {order.key!r} did not come within {order.timeout_s:g}s")
        reg = self.groups[order.group]
        if reg.direct:
            region, blocks = reg.region, order.block_ids
        else:
            if load.slots is None:
                load.slots = reg.take_slots(len(order.block_ids))
                if load.slots is None:
                    return  # staging is full: try again at the next poll
            region, blocks = reg.staging_region, load.slots
        # Only the blocks not cached here cross the wire (a prefix hit skips the others).
        share = Share(order.part, skip=order.first, readers=order.readers)
        if order.source is None:
            load.transfer = reg.client.start_get(order.key, region, blocks, timeout_s=left,
                                                 share=share, into=order.into,
                                                 sender=order.sender)
        else:
            # Prefill lends one engine step after it answered, so the pull often comes
            # first: it waits there for the key and is served the moment it is lent.
            load.transfer = reg.client.start_pull(
                order.key, order.source, region, blocks, timeout_s=left,
                wait_for_key_s=max(0.0, left - PULL_KEY_MARGIN_S), share=share,
                into=order.into)

    def _end_load(self, load: _Load) -> None:
        self._loads.pop(load.order.key, None)
        if load.slots is not None:
            self.groups[load.order.group].slots.give(load.slots)
            load.slots = None

    # ------------------------------------------------------------ discards

    def discard(self, order: DiscardOrder) -> None:
        """Release a pushed key this engine will not load, here and at its sender (never
        raises). With ``order.skip``, the key's first blocks only, at its sender: the load
        of the rest goes on."""
        if order.skip:
            if self.connected and order.sender is not None:
                self._leases.start(self._client(order.group), ReleaseOrder(
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
                self._leases.start(self._client(order.group), ReleaseOrder(
                    order.req_id, order.key, source, order.their_tp, order.group))

    # ------------------------------------------------------------ shutdown

    def close(self, timeout_s: float = 5.0) -> None:
        """Withdraw what is in flight (bounded), then close the clients: the daemon drops
        their registrations. Each closes whatever the others raised."""
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
        errors = []
        for reg in self.groups:
            try:
                reg.client.close()
            except KvdError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


# ---------------------------------------------------------------- what the engine hears


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
    """The parts of each request being sent or loaded, and what the engine is to hear.

    A send is *released* (the engine may free its blocks) once a final part has come and
    no part holds the blocks any more; a load has *ended* once every group's parts have,
    and then either loaded or failed with the blocks of the parts that failed and the
    first cause. ``KvMover`` tells it what happened to each part; what the engine is to
    hear collects here until the mover's next ``poll``."""

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


# ---------------------------------------------------------------- renewals and releases


@dataclass(eq=False)
class _Call:
    order: RenewOrder | ReleaseOrder
    transfer: Transfer


class LeaseCalls:
    """The renewals and releases in flight, one per kind, key and daemon.

    While a request waits in decode's queue, prefill's daemon keeps its key for a lease,
    renewed meanwhile; a key decode will not load is released, and prefill gets its blocks
    back at once (a pushed one at this daemon, "local", too, and prefill's never sends
    it). Each is one request to this engine's daemon, which asks prefill's; it is polled,
    never waited for. The mover hands each call its group's client (a new one after a
    daemon restart)."""

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
