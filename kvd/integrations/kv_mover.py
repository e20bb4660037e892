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
  of a prompt it has cached itself) is taken and dropped: at once if it is there, the
  moment it arrives if not, so that it never waits in the daemon's pool for its lease.
- ``poll()``: what finished since the last call: sends whose blocks the engine may free,
  loads that completed, loads that failed (with the block ids that hold no valid data and
  the cause).

GPU tensors are registered in place (CUDA IPC) and move without copies. CPU tensors of an
engine are private memory the daemon cannot map, so they go through a *staging* region in
shared memory: a send copies the blocks into staging slots (the engine's blocks are free
at once), a load lands in staging and is copied into the blocks. A load whose first blocks
are already cached locally (a prefix hit) also goes through staging, so that only the
missing blocks are written. A discarded key is taken by a get into a *sink*: blocks
shaped like the engine's, as many as the largest key discarded, in memory like staging's,
which all discards share (nobody reads what lands there). Every wait has a deadline: a
send is withdrawn when its lease ends, a load fails when its timeout passes, a discard is
given up when its timeout passes. If the daemon goes away (restarted, upgraded), what was
in flight fails, new orders fail at once, and the mover connects and registers again by
itself as soon as a daemon answers on the socket: kvd restarts without the engine
restarting.

Log lines go to the logger the caller gives (the vLLM connector's, so that they reach
vLLM's log), else to this module's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvd.client.base import Region
from kvd.client.shm import shared_empty
from kvd.client.sync import KvdClient, Transfer
from kvd.errors import BadRequest, DaemonUnavailable, KvdError, UnknownKey

log = logging.getLogger(__name__)

PULL_RETRY_S = 0.01  # a pull that finds no key yet (prefill has not lent it) tries again
# A pull waits at prefill's daemon for the key to be lent until this long before its own
# deadline, so that a key that never comes is answered (UnknownKey) before the pull's
# timeout: the load then fails with that answer, not with a timeout.
PULL_KEY_MARGIN_S = 0.25
RECONNECT_S = 1.0  # after the daemon went away: how often to try a restarted one
HELLO_TIMEOUT_S = 0.2  # a reconnect attempt blocks the engine's step at most this long


@dataclass
class SendOrder:
    """Send blocks ``block_ids`` of request ``req_id`` under ``key``: lent for one pull
    (``push_to`` None) or put to the daemon at ``push_to``; given up after ``lease_s``.

    A request may be sent in parts (one order each, one key each): it is released once its
    ``final`` order has come and every part is done with the engine's blocks. ``stage``:
    copy the blocks to staging first even when they could be read in place (a part sent
    while the request still runs: the engine may reuse its blocks before the send ends)."""

    req_id: str
    key: str
    block_ids: list[int]
    lease_s: float
    push_to: str | None = None
    final: bool = True
    stage: bool = False


@dataclass
class LoadOrder:
    """Bring ``key`` (``remote_blocks`` blocks) into this engine: its blocks from
    ``first`` on go into ``block_ids`` (the ones before are cached here already). From
    daemon ``source`` (pull), or, with ``source`` None, pushed to this daemon."""

    req_id: str
    key: str
    source: str | None
    remote_blocks: int
    first: int
    block_ids: list[int]
    timeout_s: float
    parts: int = 1  # how many orders (keys) the request is loaded from; all come together


@dataclass
class DiscardOrder:
    """Take ``key`` (``num_blocks`` blocks, pushed to this daemon) and drop its bytes: a
    part of a prompt that this engine has cached itself. Taken at once if it is there,
    else the moment it arrives, until ``timeout_s`` has passed."""

    key: str
    num_blocks: int
    timeout_s: float


@dataclass
class Polled:
    released: set[str] = field(default_factory=set)  # sends: the engine may free the blocks
    loaded: set[str] = field(default_factory=set)  # loads that completed
    failed: dict[str, list[int]] = field(default_factory=dict)  # loads that failed: blocks
    causes: dict[str, str] = field(default_factory=dict)  # why each of those failed


@dataclass
class MoverStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    sends: int = 0
    sends_unread: int = 0  # lent, and nobody pulled them before the lease ended
    send_failures: int = 0
    loads: int = 0
    load_failures: int = 0
    load_seconds: float = 0.0  # summed over completed loads
    pull_retries: int = 0  # pulls that found no key yet (not lent yet) and went again
    parts_dropped: int = 0  # pushed parts this engine had cached: taken and dropped

    def as_dict(self) -> dict[str, int | float]:
        return dict(self.__dict__)


def block_dim_of(tensor: torch.Tensor, num_blocks: int) -> int:
    """Which dimension indexes blocks: the first one of size ``num_blocks``."""
    for dim, size in enumerate(tensor.shape[:2]):
        if size == num_blocks:
            return dim
    raise BadRequest(f"KV tensor of shape {tuple(tensor.shape)} has no dimension of "
                     f"{num_blocks} blocks among its first two")


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` (blocks first) as [blocks, words] of the widest integer its block bytes allow,
    when each block is one contiguous run: a block copy then moves 8 bytes per element
    instead of 2 (about twice as fast for bf16 on CPU). Otherwise ``t`` itself."""
    try:
        flat = t.view(t.shape[0], -1)
    except RuntimeError:
        return t  # a block is not one run (e.g. K and V apart): copy it as it is
    nbytes = flat.shape[1] * flat.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        if nbytes % dtype.itemsize == 0 and flat.stride(-1) == 1:
            try:
                return flat.view(dtype)
            except RuntimeError:
                continue
    return t


def _wide_pair(layer: torch.Tensor, stage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer and its staging, both widened alike, or both as they are."""
    wide_layer, wide_stage = _wide(layer), _wide(stage)
    if wide_layer.dtype == wide_stage.dtype and wide_layer.dim() == wide_stage.dim() == 2:
        return wide_layer, wide_stage
    return layer, stage


class _Slots:
    """Which staging slots are free (first fit, lowest first)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count))

    def take(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def give(self, slots: Sequence[int]) -> None:
        self._free = sorted([*self._free, *slots])

    @property
    def free(self) -> int:
        return len(self._free)


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


@dataclass(eq=False)
class _Send:
    order: SendOrder
    deadline: float
    slots: list[int] | None = None
    transfer: Transfer | None = None


@dataclass(eq=False)
class _Load:
    order: LoadOrder
    deadline: float
    slots: list[int] | None = None
    transfer: Transfer | None = None
    retry_at: float = 0.0


@dataclass(eq=False)
class _Sink:
    """A region that discarded keys are written into, shared by all discards."""

    region: Region
    num_blocks: int
    users: int = 0  # discards whose get writes into it


@dataclass(eq=False)
class _Discard:
    order: DiscardOrder
    deadline: float
    sink: _Sink | None = None
    transfer: Transfer | None = None


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
        self._slots = _Slots(0)
        self._sink: _Sink | None = None  # the one new discards write into
        self._register()
        self.connected = True  # False from when the daemon goes away until one is back
        self._reconnect_at = 0.0
        self._sends: dict[str, _Send] = {}  # by key
        self._loads: dict[str, _Load] = {}  # by key
        self._discards: dict[str, _Discard] = {}  # by key
        self._send_groups: dict[str, _SendGroup] = {}  # by request
        self._load_groups: dict[str, _LoadGroup] = {}  # by request
        self._done = Polled()
        self.stats = MoverStats()

    def _register(self) -> None:
        """Register with the daemon: GPU tensors in place, CPU ones through staging.
        Staging is made anew each time (memory an old daemon may still hold is not
        reused), and so is the sink."""
        self._staging, self._staging_region, self._slots = None, None, _Slots(0)
        self._sink = None
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
            self._load_ended(load, ok=False, cause="the kvd daemon went away")
        for discard in list(self._discards.values()):
            self._end_discard(discard)
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

    def _blocks_like_layers(self, n: int) -> list[torch.Tensor]:
        """``n`` blocks shaped like one block of each layer, in memory the daemon can map
        (shared memory for CPU tensors, the same GPU for GPU tensors)."""
        if self.direct:
            return [torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device)
                    for t in self.layers]
        return [shared_empty((n, *t.shape[1:]), t.dtype) for t in self.layers]

    def _make_staging(self) -> None:
        n = self._staging_blocks
        if n <= 0:
            raise BadRequest("staging_blocks must be positive for CPU KV tensors")
        tensors = self._blocks_like_layers(n)
        self._staging = tensors
        self._staging_region = self.client.register("kv-staging", tensors)
        self._wide_pairs = [_wide_pair(t, st) for t, st in zip(self.layers, tensors,
                                                               strict=True)]
        self._slots = _Slots(n)

    def _take_slots(self, n: int) -> list[int] | None:
        if self._staging is None:
            self._make_staging()
        if n > self._slots.count:
            raise BadRequest(f"{n} blocks do not fit in {self._slots.count} staging blocks "
                             "(raise staging_blocks)")
        return self._slots.take(n)

    def _stage(self, block_ids: Sequence[int], slots: Sequence[int], inward: bool) -> None:
        """Engine blocks into staging slots (``inward``), or staging slots into blocks."""
        device = self.layers[0].device
        blocks = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        staged = torch.tensor(list(slots), dtype=torch.long, device=device)
        for layer, stage in self._wide_pairs:
            if inward:
                stage.index_copy_(0, staged, layer.index_select(0, blocks))
            else:
                layer.index_copy_(0, blocks, stage.index_select(0, staged))

    # ------------------------------------------------------------ orders

    def send(self, order: SendOrder) -> None:
        """Start sending (never raises: a bad order is logged, counted and released)."""
        group = self._send_groups.setdefault(order.req_id, _SendGroup())
        group.final = group.final or order.final
        if order.key in self._sends:
            self.stats.send_failures += 1
            self.log.error("kvd send %s: key %r is already being sent: not sending",
                           order.req_id, order.key)
            if group.final and not group.open:
                del self._send_groups[order.req_id]
                self._done.released.add(order.req_id)
            return
        group.open.add(order.key)
        send = self._sends[order.key] = _Send(order, time.monotonic() + order.lease_s)
        if not self._valid(order.block_ids):
            self.stats.send_failures += 1
            self.log.error("kvd send %s: block ids %s outside 0..%d: not sending",
                           order.req_id, order.block_ids, self.num_blocks - 1)
            self._end_send(send)
            return
        self._advance_send(send)

    def _valid(self, block_ids: Sequence[int]) -> bool:
        return all(0 <= b < self.num_blocks for b in block_ids)

    def load(self, order: LoadOrder) -> None:
        """Start loading (never raises: a bad order is logged and reported failed)."""
        now = time.monotonic()
        self._load_groups.setdefault(order.req_id, _LoadGroup(max(order.parts, 1), now))
        load = _Load(order, now + order.timeout_s)
        if (order.key in self._loads
                or len(order.block_ids) != order.remote_blocks - order.first
                or order.first < 0 or not self._valid(order.block_ids)):
            self.log.error("kvd load %s of %r: blocks %s for %d remote blocks from %d, or the "
                           "key is loading already: not loading", order.req_id, order.key,
                           order.block_ids, order.remote_blocks, order.first)
            self._load_ended(load, ok=False, cause=f"bad load order for key {order.key!r}")
            return
        self._loads[order.key] = load
        self._advance_load(load)

    def poll(self) -> Polled:
        if not self.connected:
            self._recover()
        for send in list(self._sends.values()):
            self._advance_send(send)
        for load in list(self._loads.values()):
            self._advance_load(load)
        for discard in list(self._discards.values()):
            self._advance_discard(discard)
        done, self._done = self._done, Polled()
        return done

    # ------------------------------------------------------------ sends

    def _advance_send(self, send: _Send) -> None:
        order = send.order
        try:
            if send.transfer is None:
                self._start_send(send)
            elif send.transfer.done():
                nbytes = send.transfer.wait(0)
                self.stats.sends += 1
                self.stats.bytes_sent += nbytes
                if nbytes == 0 and order.push_to is None:
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
            self._release(send)  # the bytes are in staging: the engine's blocks are free
            region, blocks = self._staging_region, slots
        if order.push_to is None:
            send.transfer = self.client.lend(order.key, region, blocks, ttl_s=left)
        else:
            send.transfer = self.client.put(order.key, region, blocks, to=order.push_to,
                                            ttl_s=order.lease_s, timeout_s=left)

    def _release(self, send: _Send) -> None:
        """This part no longer needs the engine's blocks; the request is released when
        its final part has come and no part needs them (again: nothing)."""
        req = send.order.req_id
        group = self._send_groups.get(req)
        if group is None or send.order.key not in group.open:
            return
        group.open.discard(send.order.key)
        if group.final and not group.open:
            del self._send_groups[req]
            self._done.released.add(req)

    def _end_send(self, send: _Send) -> None:
        self._sends.pop(send.order.key, None)
        if send.slots is not None:
            self._slots.give(send.slots)
            send.slots = None
        self._release(send)

    # ------------------------------------------------------------ loads

    def _advance_load(self, load: _Load) -> None:
        order = load.order
        now = time.monotonic()
        group = self._load_groups.get(order.req_id)
        try:
            if load.transfer is None:
                if group is not None and group.failed:
                    raise KvdError("another part of this request failed")
                if now >= load.retry_at:  # a retry is always due before the deadline
                    self._start_load(load, now)
                return
            if not load.transfer.done():
                return
            try:
                nbytes = load.transfer.wait(0)
            except UnknownKey:
                # Pull flow: the key did not appear while the pull waited at prefill's
                # daemon (that daemon held too many waiting pulls, or no time was left).
                if time.monotonic() + PULL_RETRY_S >= load.deadline:
                    raise
                load.transfer, load.retry_at = None, time.monotonic() + PULL_RETRY_S
                self.stats.pull_retries += 1
                return
            if load.slots is not None:
                self._stage(order.block_ids, load.slots[order.first:], inward=False)
            self.stats.bytes_received += nbytes
            self._end_load(load)
            self._load_ended(load, ok=True)
        except KvdError as err:
            self._note(err)
            # The request's failure, with its first cause, is the caller's to log (poll).
            self.log.warning("kvd load %s (key %s) failed: %s", order.req_id, order.key, err)
            self._end_load(load)
            self._load_ended(load, ok=False, cause=f"key {order.key!r}: {err}")

    def _load_ended(self, load: _Load, ok: bool, cause: str = "") -> None:
        """Count a part; once every part of the request has ended (none can write into
        its blocks any more), report the request loaded, or failed with the blocks of
        the parts that failed and the first part's cause."""
        order = load.order
        group = self._load_groups.get(order.req_id)
        if group is None:
            return
        group.ended += 1
        if not ok:
            group.failed = True
            group.failed_blocks.extend(order.block_ids)
            group.cause = group.cause or cause
        if group.ended < group.expected:
            return
        del self._load_groups[order.req_id]
        if group.failed:
            self.stats.load_failures += 1
            self._done.failed[order.req_id] = group.failed_blocks
            self._done.causes[order.req_id] = group.cause
        else:
            self.stats.loads += 1
            self.stats.load_seconds += time.monotonic() - group.started
            self._done.loaded.add(order.req_id)

    def _start_load(self, load: _Load, now: float) -> None:
        order = load.order
        left = load.deadline - now
        if left <= 0:
            raise KvdError(f"key {order.key!r} did not come within {order.timeout_s:g}s")
        if self.direct and order.first == 0:
            region, blocks = self.region, order.block_ids
        else:
            if load.slots is None:
                load.slots = self._take_slots(order.remote_blocks)
                if load.slots is None:
                    return  # staging is full: try again at the next poll
            region, blocks = self._staging_region, load.slots
        if order.source is None:
            load.transfer = self.client.start_get(order.key, region, blocks, timeout_s=left)
        else:
            # Prefill lends one engine step after it answered, so the pull often comes
            # first: it waits there for the key and is served the moment it is lent.
            load.transfer = self.client.start_pull(
                order.key, order.source, region, blocks, timeout_s=left,
                wait_for_key_s=max(0.0, left - PULL_KEY_MARGIN_S))

    def _end_load(self, load: _Load) -> None:
        self._loads.pop(load.order.key, None)
        if load.slots is not None:
            self._slots.give(load.slots)
            load.slots = None

    # ------------------------------------------------------------ discards

    def discard(self, order: DiscardOrder) -> None:
        """Start taking a key this engine does not need (never raises: a bad order is
        logged and dropped)."""
        if (order.key in self._discards or order.key in self._loads
                or not 0 < order.num_blocks <= self.num_blocks):
            self.log.error("kvd discard of %r (%d blocks): a key already being loaded or "
                           "discarded, or more blocks than the engine has: not taking it",
                           order.key, order.num_blocks)
            return
        discard = self._discards[order.key] = _Discard(order,
                                                       time.monotonic() + order.timeout_s)
        self._advance_discard(discard)

    def _advance_discard(self, discard: _Discard) -> None:
        order = discard.order
        try:
            if discard.transfer is None:
                left = discard.deadline - time.monotonic()
                if left <= 0:
                    raise KvdError(f"not started within {order.timeout_s:g}s")
                sink = discard.sink = self._sink_for(order.num_blocks)
                sink.users += 1
                discard.transfer = self.client.start_get(
                    order.key, sink.region, range(order.num_blocks), timeout_s=left)
                return
            if not discard.transfer.done():
                return
            discard.transfer.wait(0)
            self.stats.parts_dropped += 1
        except KvdError as err:
            self._note(err)
            # Not taken (prefill never sent it, or not in time): if it comes after all, it
            # stays in the daemon's pool until its lease ends, like any unclaimed put.
            self.log.info("kvd: part %s, cached here, was not taken: %s", order.key, err)
        self._end_discard(discard)

    def _sink_for(self, num_blocks: int) -> _Sink:
        """The sink, made (again, larger) when it has fewer blocks than asked; a smaller
        one goes once no discard writes into it."""
        sink = self._sink
        if sink is None or sink.num_blocks < num_blocks:
            if sink is not None and sink.users == 0:
                self._unregister_sink(sink)
            self._sink = None
            # Named by size: a smaller one may still be registered, taking a discard.
            region = self.client.register(f"kv-discard-{num_blocks}",
                                          self._blocks_like_layers(num_blocks))
            sink = self._sink = _Sink(region, num_blocks)
        return sink

    def _unregister_sink(self, sink: _Sink) -> None:
        with contextlib.suppress(KvdError):  # a daemon that went away dropped it already
            self.client.unregister(sink.region)

    def _end_discard(self, discard: _Discard) -> None:
        self._discards.pop(discard.order.key, None)
        sink, discard.sink = discard.sink, None
        if sink is not None:
            sink.users -= 1
            if sink is not self._sink and sink.users == 0 and self.connected:
                self._unregister_sink(sink)

    # ------------------------------------------------------------ shutdown

    def close(self, timeout_s: float = 5.0) -> None:
        """Withdraw what is in flight (bounded), then close the client: the daemon drops
        this client's registrations."""
        items: list[_Send | _Load | _Discard] = [
            *self._sends.values(), *self._loads.values(), *self._discards.values()]
        for item in items:
            if item.transfer is not None and not item.transfer.done():
                try:
                    item.transfer.cancel(timeout_s)
                except KvdError as err:
                    self.log.warning("kvd: cancelling key %s at shutdown: %s",
                                     item.order.key, err)
        self._sends.clear()
        self._loads.clear()
        self._discards.clear()
        self._send_groups.clear()
        self._load_groups.clear()
        self.client.close()


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) if tokens > 0 else 0


def part_ranges(num_blocks: int, part_blocks: int) -> list[tuple[int, int]]:
    """How a request of ``num_blocks`` is cut into parts of ``part_blocks`` (0: one part);
    both ends compute it the same way."""
    if part_blocks <= 0 or num_blocks <= part_blocks:
        return [(0, num_blocks)]
    return [(lo, min(lo + part_blocks, num_blocks)) for lo in range(0, num_blocks, part_blocks)]


def part_key(key: str, index: int, count: int) -> str:
    return key if count == 1 else f"{key}#p{index}"
