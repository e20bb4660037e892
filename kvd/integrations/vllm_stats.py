"""The vLLM connector's counters in vLLM's own stats and Prometheus registry.

The worker's ``KvMover`` counts what moved (``MoverStats``); each report hands vLLM the
change since the last one, which vLLM sums over workers and intervals and shows in its
logged stats and its ``/metrics``. Imports vLLM: only ``kvd.integrations.vllm`` imports
this, and only where vLLM imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Histograms of each request loaded and each key sent: its time and its bytes.
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0)
_BYTES = tuple(float(4**i) for i in range(6, 19))  # 4 KiB .. 64 GiB
_HISTOGRAMS = {  # (samples, which of each: 0 seconds, 1 bytes) -> name, buckets, help
    ("load_samples", 0): ("load_seconds_per_request", _SECONDS,
                          "Seconds from a request's load order to its KV in place"),
    ("load_samples", 1): ("load_bytes_per_request", _BYTES,
                          "Bytes of KV cache loaded through kvd per request"),
    ("send_samples", 0): ("send_seconds_per_key", _SECONDS,
                          "Seconds from a send order to the key's bytes taken (pulled or put)"),
    ("send_samples", 1): ("send_bytes_per_key", _BYTES,
                          "Bytes of KV cache sent through kvd per key"),
}


@dataclass
class KvdConnectorStats(KVConnectorStats):
    """Counts since the last report, summed over workers and intervals, and the samples
    for the histograms (lists, joined)."""

    def reset(self) -> None:
        empty: dict[str, Any] = {}
        self.data = empty

    def aggregate(self, other: KVConnectorStats) -> KvdConnectorStats:
        merged = dict(self.data)
        for k, v in other.data.items():
            merged[k] = [*merged.get(k, []), *v] if isinstance(v, list) else (
                merged.get(k, 0) + v)
        return KvdConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d[k] for k in sorted(d)
                                       if not isinstance(d[k], list)}
        loads = d.get("loads", 0)
        if loads:
            out["avg_load_ms"] = round(1000 * d.get("load_seconds", 0.0) / loads, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvdPromMetrics(KVConnectorPromMetrics):
    """kvd's counters in vLLM's own Prometheus registry, one child per engine."""

    _COUNTERS = {
        "bytes_sent": "Bytes of KV cache sent through kvd",
        "bytes_received": "Bytes of KV cache received through kvd",
        "sends": "KV sends through kvd that completed",
        "sends_unread": "KV lent through kvd that no decode pulled within its lease",
        "sends_released": ("KV sends that decode released (aborted, or cached there): lent "
                           "unread, or not pushed"),
        "send_failures": "KV sends through kvd that failed",
        "loads": "KV loads through kvd that completed",
        "load_failures": "KV loads through kvd that failed (reported as invalid blocks)",
        "load_seconds": "Seconds spent in completed KV loads through kvd",
        "pull_retries": "KV pulls through kvd that found no key yet and went again",
        "parts_dropped": "Pushed KV parts this engine had cached: released (not sent, or dropped)",
        "loads_refused": "KV loads refused: prefill's KV did not fit this engine",
        "loads_gone": "KV loads that found their key gone at prefill (lease over, released)",
        "leases_renewed": "Renewals of prefill's lease for requests waiting in the queue",
        "leases_released": "Keys released at prefill: their request will not load them",
    }

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, doc in self._COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:kvd_{name}", documentation=doc,
                                       labelnames=labelnames)
            self._counters[name] = {idx: metric.labels(*values) for idx, values
                                    in per_engine_labelvalues.items()}
        self._histograms = {}
        for (samples, which), (name, buckets, doc) in _HISTOGRAMS.items():
            histogram = self._histogram_cls(name=f"vllm:kvd_{name}", documentation=doc,
                                            buckets=list(buckets), labelnames=labelnames)
            self._histograms[samples, which] = {
                idx: histogram.labels(*values) for idx, values
                in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, children in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value and engine_idx in children:
                children[engine_idx].inc(value)
        for (samples, which), children in self._histograms.items():
            if engine_idx in children:
                for sample in transfer_stats_data.get(samples, ()):
                    children[engine_idx].observe(sample[which])
