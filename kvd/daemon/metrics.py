"""Prometheus metrics: one registry per daemon (so tests can run several in a process).

Events that need a distribution or a per-peer breakdown (transfers, their bytes, queue wait
and wire time) are recorded as they happen through ``Metrics.transfer``. Everything that is
state (pool, keys, peers, clients, channels, in-flight work) or already counted by the
daemon's own tables (requests, bad messages, expiries) is read at scrape time by a custom
collector, so there is one source of truth and nothing to keep in step.

Every series a dashboard plots exists from the first scrape: each bad-message reason is
there at 0 until it happens (``BAD_MESSAGE_REASONS``), so a healthy daemon's panel shows
zero, not "no data". No ``*_created`` samples: they double the series for a value nobody
graphs.

Names follow ``kvd_<noun>_<unit>``; docs/operations.md lists them with one line each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvd import __version__
from kvd.protocol import PROTOCOL_VERSION

if TYPE_CHECKING:  # (the engine records into Metrics: types only the other way)
    from kvd.daemon.engine import Engine
    from kvd.daemon.service import Daemon

# 10 µs … 60 s: a small control round trip up to a multi-GB transfer over a slow link.
DURATION_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

# What the daemon counts in ``bad_messages``, by socket: the local one (local_server.py,
# lifelines.py) and the peer plane (peers.py, peer_sockets.py, peer_data.py,
# transfer/). Each is exported at 0 from the start; a reason counted but missing here is
# still exported once it happens (and a test fails until it is added).
BAD_MESSAGE_REASONS: dict[str, tuple[str, ...]] = {
    "local": (
        "connection_lost", "descriptor_limit", "duplicate_hello", "duplicate_req_id",
        "frames", "lifeline", "malformed", "no_hello", "no_lifeline", "no_session",
        "unclaimed_limit", "unread_replies", "version",
    ),
    "peer": (
        "auth", "bad_offer", "data_connect", "data_encryption", "data_handshake",
        "data_token", "duplicate_hello", "duplicate_transfer", "empty", "frames",
        "handshake", "handshake_limit", "link_limit", "malformed", "no_link", "pull_limit",
        "takeover", "unexpected", "unknown_call", "unknown_transfer", "unlinked_limit",
        "version",
    ),
}


def _nccl_version() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:  # no NCCL in a CPU build: that is an answer, not an error
        pass
    return "none"


@dataclass(frozen=True, slots=True)
class _TransferSeries:
    """The series of one (peer, direction, transport, outcome)."""

    transfers: Counter
    nbytes: Counter
    queue: Histogram
    wire: Histogram


class Metrics:
    def __init__(self) -> None:
        # (Process-wide in prometheus_client, read at scrape time; the daemon owns its
        # process, and in tests nothing wants the creation times either.)
        disable_created_metrics()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_*: memory, CPU, descriptors, start
        self._transfers = Counter(
            "kvd_transfers", "Transfers finished, by peer, direction, transport and outcome.",
            ["peer", "direction", "transport", "outcome"], registry=self.registry)
        self._bytes = Counter(
            "kvd_transfer_bytes", "Bytes moved by finished transfers.",
            ["peer", "direction", "transport"], registry=self.registry)
        self._queue = Histogram(
            "kvd_transfer_queue_wait_seconds",
            "From the request to the first byte: offers, BUSY back-off, channel queue.",
            ["direction", "transport"], buckets=DURATION_BUCKETS, registry=self.registry)
        self._wire = Histogram(
            "kvd_transfer_wire_seconds", "From the first byte to the last.",
            ["direction", "transport"], buckets=DURATION_BUCKETS, registry=self.registry)
        self._children: dict[tuple[str, str, str, str], _TransferSeries] = {}

    def transfer(self, *, peer: str, direction: str, transport: str, outcome: str,
                 nbytes: int = 0, queue_s: float | None = None,
                 wire_s: float | None = None) -> None:
        series = self._series(peer, direction, transport, outcome)
        series.transfers.inc()
        if outcome == "done":
            series.nbytes.inc(nbytes)
            if wire_s is not None:
                series.wire.observe(max(wire_s, 0.0))
        if queue_s is not None:
            series.queue.observe(max(queue_s, 0.0))

    def _series(self, peer: str, direction: str, transport: str, outcome: str
                ) -> _TransferSeries:
        """The labelled series one transfer counts in, looked up once per label set (one
        dict lookup per transfer): prometheus_client validates and locks on every
        labels() call, ~25 us per transfer in a daemon on the GPU host (py-spy), and this
        runs at the end of every transfer."""
        key = (peer, direction, transport, outcome)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = _TransferSeries(
                self._transfers.labels(peer, direction, transport, outcome),
                self._bytes.labels(peer, direction, transport),
                self._queue.labels(direction, transport),
                self._wire.labels(direction, transport))
        return found

    def attach(self, daemon: Daemon) -> None:
        """Expose the state of the daemon's parts (read at scrape time, as they come up)."""
        self.registry.register(_StateCollector(daemon))


class _StateCollector(Collector):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.nccl = _nccl_version()

    def collect(self) -> Iterator[Any]:
        d = self.daemon
        engine, local, peers, transfers = d.engine, d.local, d.peers, d.transfers
        build = GaugeMetricFamily(
            "kvd_build_info", "Versions of kvd, its protocol, torch and NCCL.",
            labels=["version", "protocol_version", "torch_version", "nccl_version"])
        import torch

        build.add_metric([__version__, str(PROTOCOL_VERSION), torch.__version__, self.nccl], 1)
        yield build
        if engine is None:
            return
        pool = engine.pool
        for name, value, text in (
            ("kvd_pool_capacity_bytes", pool.capacity_bytes, "Host pool size."),
            ("kvd_pool_used_bytes", pool.used_bytes, "Host pool bytes allocated."),
            ("kvd_pool_free_bytes", pool.free_bytes, "Host pool bytes free."),
            ("kvd_pool_largest_free_bytes", pool.largest_free_bytes,
             "Largest allocation the host pool could serve now."),
            ("kvd_stored_keys", len(engine.store), "Keys stored or published."),
            ("kvd_clients_connected", len(local.sessions) if local else 0,
             "Local clients with a session."),
            ("kvd_peers_connected", len(peers.links) if peers else 0, "Peer daemons linked."),
        ):
            yield GaugeMetricFamily(name, text, value=value)
        yield CounterMetricFamily("kvd_peer_links_lost", "Peer links that ended: a peer "
                                  "gone, restarted or silent past its grace (two dials that "
                                  "cross leave one link and lose none).",
                                  value=peers.links_lost if peers else 0)
        yield CounterMetricFamily("kvd_peer_links_evicted", "Of the links lost, those closed "
                                  "for a new one at max_peer_links (the least recently used "
                                  "idle link).", value=peers.links_evicted if peers else 0)
        changes = CounterMetricFamily("kvd_allowed_key_changes", "Keys added to or taken off "
                                      "the allow-list by reloads (kvd reload, SIGHUP).",
                                      labels=["change"])
        for change, count in (peers.keys_changed if peers else {}).items():
            changes.add_metric([change], count)
        yield changes
        yield CounterMetricFamily("kvd_busy_poll_turns", "Turns of the event loop that "
                                  "polled without sleeping (busy polling, on nodes that "
                                  "see a GPU).", value=engine.busy_poll.turns)
        yield CounterMetricFamily("kvd_key_expiries", "Keys freed by their TTL.",
                                  value=engine.counters.expired_keys)
        leases = CounterMetricFamily(
            "kvd_lease_events", "Lent keys renewed or released by their reader, or expired "
            "unread; gets failed at once as the daemon they waited on was gone "
            "(sender_lost).", labels=["event"])
        for event, n in engine.leases.stats().items():
            leases.add_metric([event], n)
        yield leases
        requests = CounterMetricFamily("kvd_requests", "Client requests by operation and "
                                       "result code ('ok' or an error code).",
                                       labels=["op", "code"])
        for (op, code), n in sorted(engine.counters.requests.items()):
            requests.add_metric([op, code], n)
        yield requests
        bad = CounterMetricFamily("kvd_bad_messages", "Messages refused, by socket and reason.",
                                  labels=["socket", "reason"])
        for socket_name, table in (("local", local.bad_messages if local else {}),
                                   ("peer", peers.bad_messages if peers else {})):
            reasons = sorted({*BAD_MESSAGE_REASONS[socket_name], *table})
            for reason in reasons:
                bad.add_metric([socket_name, reason], table.get(reason, 0))
        yield bad
        in_flight = GaugeMetricFamily("kvd_in_flight_transfers", "Transfers in progress.",
                                      labels=["direction"])
        in_bytes = GaugeMetricFamily("kvd_in_flight_bytes", "Bytes of transfers in progress.",
                                     labels=["direction"])
        flights = transfers.in_flight() if transfers else {}
        flights["local"] = engine.copies.in_flight()
        for direction, (count, nbytes) in sorted(flights.items()):
            in_flight.add_metric([direction], count)
            in_bytes.add_metric([direction], nbytes)
        yield in_flight
        yield in_bytes
        yield GaugeMetricFamily(
            "kvd_pulls_waiting_for_key", "Peers' pulls held here until their key appears "
            "(wait_for_key_s).", value=transfers.waiting_pulls if transfers else 0)
        channels = GaugeMetricFamily("kvd_channels", "Data channels open.",
                                     labels=["direction", "transport"])
        sends = sum(1 for link in peers.links.values() if link.send_channel) if peers else 0
        recvs = len(peers.links) if peers else 0
        channels.add_metric(["send", "tcp"], sends)
        channels.add_metric(["recv", "tcp"], recvs)
        channels.add_metric(["local", "local"], 1)
        nccl = transfers.nccl.stats() if transfers is not None and transfers.nccl else None
        for direction in ("send", "recv"):
            channels.add_metric([direction, "nccl"], sum(
                1 for c in (nccl or {}).get("channels", []) if c["direction"] == direction))
        yield channels
        yield from _gpu_families(engine, nccl)


def _gpu_families(engine: Engine, nccl: dict[str, Any] | None) -> Iterator[Any]:
    """GPU staging and NCCL channel figures (no samples on a daemon without GPUs)."""
    staging = GaugeMetricFamily("kvd_gpu_staging_bytes", "GPU staging for NCCL arrivals "
                                "nobody waits for yet, by GPU and state.",
                                labels=["device", "state"])
    for device, pool in sorted(engine.gpu_pools.items()):
        staging.add_metric([device, "capacity"], pool.capacity_bytes)
        staging.add_metric([device, "used"], pool.used_bytes)
    yield staging
    yield CounterMetricFamily("kvd_gpu_spills", "NCCL arrivals that found GPU staging "
                              "full and went to the host pool.",
                              value=engine.counters.gpu_spills)
    events = CounterMetricFamily("kvd_nccl_channel_events", "NCCL channels created, failed "
                                 "(aborted), evicted (least recently used, past "
                                 "nccl_channel_memory_bytes), over_budget (made past it, every "
                                 "channel busy) and warmed (made when a peer linked, before "
                                 "any transfer).", labels=["event"])
    for event in ("created", "failed", "evicted", "over_budget", "warmed"):
        events.add_metric([event], (nccl or {}).get(event, 0))
    yield events
