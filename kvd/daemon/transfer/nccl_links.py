"""NCCL channels between this daemon and its peers: which exist, made on demand, torn down.

A channel is keyed by (peer link, direction, local device, remote device) and has an id.
The *receiver* makes a channel: when it accepts a transfer over NCCL and has no live
channel for that key, it creates an ncclUniqueId and a channel id, joins as rank 1, and
puts both in the ACCEPT; the sender joins as rank 0 when an ACCEPT names a channel it
does not have (every ACCEPT carries the id, so concurrent first transfers share one
channel). A channel that fails on either side is aborted there and announced with
CHANNEL_DOWN, so the other side aborts its end and the next transfer makes a new one. The
channels on a GPU hold at most ``nccl_channel_memory_bytes`` of it, as ``NcclChannel.gpu_bytes``
counts (a communicator, ~34 MiB, and the staging buffers a channel made): a new channel
that would pass it evicts the least recently used idle ones the same way. When none is
idle the channel is made all the same (the transfer needs it), and this is logged.

Warm-up (``nccl_warm_up``): when a peer link comes up, the receiver makes its channels from
the peer's GPUs ahead of any transfer (init and NCCL's connection setup take 0.5-0.7 s) and
sends CHANNEL_WARM with each one's id; the sender joins it. Both ends queue one small
message on the channel right after the init, the receiver when it makes the channel and the
sender when CHANNEL_WARM arrives — before any ACCEPT that names the channel, which the link
delivers later — so the two threads still run matching jobs in the same order. The receiver
never evicts to warm up (a GPU whose channels would pass the budget is skipped); the sender
joins as it would for an ACCEPT. An incoming link is warmed when its first message after
the handshake arrives: the dialer may drop a message that reaches it before its loop has
made the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from kvd.config import Config
from kvd.daemon.futures import keep_task
from kvd.daemon.peer_link import PeerLink
from kvd.daemon.peers import PeerPlane
from kvd.errors import KvdError, PeerUnreachable, TransferFailed
from kvd.protocol import ChannelDown, ChannelWarm
from kvd.transport.nccl import new_unique_id
from kvd.transport.nccl_channel import COMMUNICATOR_BYTES, NcclChannel

log = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0


@dataclass(eq=False)
class _Entry:
    channel_id: int
    unique_id: bytes
    channel: NcclChannel
    link: PeerLink
    key: tuple[str, str, str]  # direction, local device, remote device


class NcclLinks:
    def __init__(self, config: Config, plane: PeerPlane) -> None:
        self.config = config
        self.plane = plane
        self._loop = asyncio.get_running_loop()
        self._by_key: dict[tuple[int, str, str, str], _Entry] = {}  # id(link), key
        self._by_id: dict[int, _Entry] = {}
        self._stopping: set[asyncio.Task[Any]] = set()
        self.created = 0
        self.failed = 0
        self.evicted = 0
        self.over_budget = 0  # channels made past nccl_channel_memory_bytes (every one busy)
        self.warmed = 0

    # ------------------------------------------------------------ finding or making

    def for_receive(self, link: PeerLink, local_dev: str, remote_dev: str) -> _Entry:
        """A live receive channel from the peer's ``remote_dev`` to our ``local_dev``."""
        entry = self._live(link, ("recv", local_dev, remote_dev))
        if entry is not None:
            return entry
        return self._make(link, ("recv", local_dev, remote_dev), _new_channel_id(),
                          new_unique_id(), rank=1)

    def for_send(self, link: PeerLink, local_dev: str, remote_dev: str, channel_id: int,
                 unique_id: bytes) -> _Entry:
        """Our end of the channel ``channel_id`` the receiver named in its ACCEPT."""
        entry = self._by_id.get(channel_id)
        if entry is not None:
            if entry.link is not link or entry.key != ("send", local_dev, remote_dev):
                raise TransferFailed(f"channel {channel_id} belongs to another peer or device")
            if entry.channel.failed is not None:
                raise entry.channel.failed
            return entry
        if len(unique_id) != 128:
            raise TransferFailed(f"accept names unknown channel {channel_id} without its id")
        old = self._by_key.get((id(link), "send", local_dev, remote_dev))
        if old is not None:
            self._drop(old, PeerUnreachable("replaced by a new channel"), tell_peer=False)
        return self._make(link, ("send", local_dev, remote_dev), channel_id, unique_id, rank=0)

    def for_eager_send(self, link: PeerLink, local_dev: str) -> _Entry | None:
        """A live send channel to the peer from ``local_dev`` to queue bytes on before the
        receiver answers (``nccl_eager``): the one used last, whichever GPU of the peer it
        reaches (the receiver copies on if its blocks are on another). None if there is
        none yet: the first transfer makes one through its ACCEPT."""
        if not self.config.nccl_eager:
            return None
        live = [e for e in self._by_id.values()
                if e.link is link and e.key[:2] == ("send", local_dev)
                and e.channel.failed is None]
        return max(live, key=lambda e: e.channel.last_used, default=None)

    def for_eager_receive(self, link: PeerLink, channel_id: int, remote_dev: str
                          ) -> _Entry | None:
        """Our live receive channel ``channel_id`` from the peer's ``remote_dev``, which an
        eager OFFER says the bytes are already queued on; None if we have no such channel."""
        entry = self._by_id.get(channel_id)
        if (entry is None or entry.link is not link or entry.key[0] != "recv"
                or entry.key[2] != remote_dev or entry.channel.failed is not None):
            return None
        return entry

    def warm_up(self, link: PeerLink) -> None:
        """Make our receive channels from a peer that just linked, now (``nccl_warm_up``)."""
        mode = self.config.nccl_warm_up
        theirs = [d for d in link.devices if d.startswith("cuda:")]
        if mode == "off" or not theirs:
            return
        for local_dev in self.plane.gpus:
            for remote_dev in theirs:
                if mode == "matching" and remote_dev != local_dev:
                    continue
                if self._live(link, ("recv", local_dev, remote_dev)) is not None or (
                        self._held_on(local_dev) + COMMUNICATOR_BYTES
                        > self.config.nccl_channel_memory_bytes):
                    continue
                entry = self._make(link, ("recv", local_dev, remote_dev), _new_channel_id(),
                                   new_unique_id(), rank=1)
                entry.channel.warm(self.config.nccl_init_timeout_s)
                self.warmed += 1
                self.plane.send(link, ChannelWarm(channel=entry.channel_id,
                                                  nccl_uid=entry.unique_id,
                                                  src_dev=remote_dev, dst_dev=local_dev))

    def on_channel_warm(self, link: PeerLink, msg: ChannelWarm) -> None:
        """The peer made a channel from our ``src_dev`` ahead of any transfer: join it and
        queue the matching small message; or decline (CHANNEL_DOWN), and it drops its end."""
        reason = ""
        if msg.src_dev not in self.plane.gpus:
            reason = f"{msg.src_dev} is not a GPU of this daemon with NCCL"
        elif msg.dst_dev not in link.devices:
            reason = f"{msg.dst_dev} is not among the devices {link.address} announced"
        elif msg.channel in self._by_id:
            reason = f"channel {msg.channel} already exists"
        if not reason:  # like an ACCEPT naming a new channel: may evict an idle one here
            try:
                entry = self.for_send(link, msg.src_dev, msg.dst_dev, msg.channel,
                                      msg.nccl_uid)
            except KvdError as err:
                reason = err.message
            else:
                entry.channel.warm(self.config.nccl_init_timeout_s)
                self.warmed += 1
                return
        log.info("nccl channel %d from %s not warmed: %s", msg.channel, link.address, reason)
        self.plane.send(link, ChannelDown(channel=msg.channel, reason=reason[:4000]))

    def _held_on(self, local_dev: str) -> int:
        return sum(e.channel.gpu_bytes for e in self._by_id.values() if e.key[1] == local_dev)

    def _live(self, link: PeerLink, key: tuple[str, str, str]) -> _Entry | None:
        entry = self._by_key.get((id(link), *key))
        if entry is None:
            return None
        if entry.channel.failed is not None:
            self._drop(entry, entry.channel.failed, tell_peer=True)
            return None
        return entry

    def _make(self, link: PeerLink, key: tuple[str, str, str], channel_id: int,
              unique_id: bytes, rank: int) -> _Entry:
        direction, local_dev, remote_dev = key
        self._evict_for(local_dev)
        name = f"kvd-nccl-{direction}-{local_dev}-{link.node_id}-{remote_dev}"
        channel = NcclChannel(name, torch.device(local_dev), direction,
                              self.config.nccl_chunk_bytes, on_failed=self._failed_in_thread,
                              # Both ends split, or neither: each computes the same answer
                              # from the two handshakes.
                              blocking_calls=(self.plane.nccl_blocking_calls
                                              and link.nccl_blocking_calls))
        channel.start(unique_id, rank, self.config.nccl_init_timeout_s)
        entry = _Entry(channel_id, unique_id, channel, link, key)
        self._by_key[(id(link), *key)] = entry
        self._by_id[channel_id] = entry
        self.created += 1
        log.info("nccl channel %d created %s (rank %d) to %s", channel_id, name, rank,
                 link.address)
        return entry

    def _evict_for(self, local_dev: str) -> None:
        """Room in ``nccl_channel_memory_bytes`` for one more channel on ``local_dev``: the least
        recently used idle channels there are closed until it fits."""
        budget = self.config.nccl_channel_memory_bytes
        held = self._held_on(local_dev)
        on_device = [e for e in self._by_id.values() if e.key[1] == local_dev]
        for entry in sorted(on_device, key=lambda e: e.channel.last_used):
            if held + COMMUNICATOR_BYTES <= budget:
                return
            if entry.channel.idle:
                held -= entry.channel.gpu_bytes
                self.evicted += 1
                self._drop(entry, PeerUnreachable(
                    f"nccl channel evicted: the channels on {local_dev} would hold more than "
                    f"nccl_channel_memory_bytes ({budget / 2**20:.0f} MiB)"), tell_peer=True)
        if held + COMMUNICATOR_BYTES > budget:
            self.over_budget += 1
            log.warning("nccl channels on %s hold %.0f MiB, and every one has work in "
                        "flight: one more is made past nccl_channel_memory_bytes (%.0f MiB)",
                        local_dev, held / 2**20, budget / 2**20)

    # ------------------------------------------------------------ tearing down

    def _failed_in_thread(self, channel: NcclChannel, err: KvdError) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone at shutdown
            self._loop.call_soon_threadsafe(self._on_failed, channel, err)

    def _on_failed(self, channel: NcclChannel, err: KvdError) -> None:
        for entry in list(self._by_id.values()):
            if entry.channel is channel:
                self.failed += 1
                log.warning("nccl channel %d failed: [%s] %s", entry.channel_id, err.code,
                            err.message)
                self._drop(entry, err, tell_peer=True)

    def on_channel_down(self, link: PeerLink, msg: ChannelDown) -> None:
        entry = self._by_id.get(msg.channel)
        if entry is not None and entry.link is link:
            log.info("nccl channel %d down at %s: %s", msg.channel, link.address, msg.reason)
            self._drop(entry, PeerUnreachable(
                f"peer {link.address} closed nccl channel {msg.channel}: {msg.reason}"),
                tell_peer=False)

    def on_link_lost(self, link: PeerLink, err: KvdError) -> None:
        for entry in [e for e in self._by_id.values() if e.link is link]:
            self._drop(entry, err, tell_peer=False)

    def _drop(self, entry: _Entry, err: KvdError, tell_peer: bool) -> None:
        if self._by_id.get(entry.channel_id) is not entry:
            return
        del self._by_id[entry.channel_id]
        self._by_key.pop((id(entry.link), *entry.key), None)
        entry.channel.failed = entry.channel.failed or err  # later jobs fail at once
        if tell_peer:
            self.plane.send(entry.link, ChannelDown(channel=entry.channel_id,
                                                    reason=err.message[:4000]))

        def teardown() -> None:  # an abort takes ~0.5 s: not on the loop
            entry.channel.abort(err)
            entry.channel.stop(_STOP_TIMEOUT_S)

        keep_task(self._stopping, asyncio.to_thread(teardown))

    async def close(self) -> None:
        for entry in list(self._by_id.values()):
            self._drop(entry, PeerUnreachable("daemon stopping"), tell_peer=True)
        if self._stopping:
            await asyncio.wait(list(self._stopping), timeout=_STOP_TIMEOUT_S + 1)

    def stats(self) -> dict[str, Any]:
        return {"channels": [{"id": e.channel_id, "peer": e.link.address,
                              "direction": e.key[0], "device": e.key[1],
                              "peer_device": e.key[2], "idle": e.channel.idle,
                              "jobs": e.channel.jobs,
                              "jobs_overlapped": e.channel.jobs_overlapped,
                              "blocking_calls": e.channel.blocking_calls,
                              "gpu_bytes": e.channel.gpu_bytes}
                             for e in self._by_id.values()],
                "created": self.created, "failed": self.failed, "evicted": self.evicted,
                "over_budget": self.over_budget, "warmed": self.warmed}


def _new_channel_id() -> int:
    return secrets.randbits(62) + 1
