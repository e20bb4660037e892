"""GPU to GPU through kvd against raw NCCL and raw peer copy, measured in the same run.

Run on a host with two GPUs: ``python benchmarks/gpu_transfer.py [--json] [--repeat N]``

kvd side: two ``kvd serve`` subprocesses, one per GPU (``CUDA_VISIBLE_DEVICES``), linked
over loopback as if they were two nodes; this process is a client of both, with CUDA
regions on GPU0 (registered with daemon a) and GPU1 (with daemon b). Every timed transfer
is a fresh key, *get posted first*: a thread on b posts ``get`` and we wait until b reports
it waiting; the time runs from ``put(..., to=b)`` to the get's return — put -> get complete,
what a decode worker waits for once prefill says "sent". It includes the client -> daemon
requests, OFFER/ACCEPT between the daemons, NCCL, and the get's reply. The put's own reply
comes after the receiver's confirmation travels back (~0.1-0.2 ms later): the time to the
later of the two is reported too, as "acked".

* (a) 1 GiB contiguous: one uint8 tensor of 1024 blocks of 1 MiB, all blocks.
* (b) a Llama-3-8B-shaped request: 32 layers x K and V, each ``[1024, 16, 8, 128]`` bf16
  (32 KiB per block per tensor), 256 random blocks to 256 random blocks (512 MiB).
* (c) latency: one 1 MiB block, median of many put -> get.
* (d) (b) within one daemon that sees both GPUs (the local transport: a peer copy).

Raw side (``benchmarks/gpu_raw.py``): NCCL send/recv between two processes through
torch.distributed of the same byte counts (contiguous), a 1 MiB ping-pong (one-way = round
trip / 2), and a contiguous 512 MiB peer copy. Ratios are kvd GB/s over raw GB/s (or, for
latency, kvd minus raw in µs), best and median of ``--repeat`` runs. Targets, reported and
never enforced: (a), (b) >= 90% of raw NCCL, (c) <= raw + 100 µs, (d) >= 90% of raw copy.
Every kvd transfer's destination is checked against the source before timing starts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from daemons import stop_daemon
from gpu_raw import measure_raw_nccl, measure_raw_peer_copy

import kvd
from kvd import timeline

MiB, GiB = 2**20, 2**30
LLAMA_SHAPE = (1024, 16, 8, 128)  # blocks, tokens, kv heads, head dim
LLAMA_TENSORS = 64  # 32 layers x (K, V)
LLAMA_BLOCKS = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


EXTRA_FLAGS: list[str] = []  # --daemon-flag values, passed to every kvd serve


def start_daemon(root: str, name: str, gpus: str, env: dict[str, str] | None = None,
                 ) -> tuple[subprocess.Popen[bytes], str, str]:
    """A ``kvd serve`` on ``gpus`` (``CUDA_VISIBLE_DEVICES``), ``env`` added to this
    process's environment; its process, socket and peer address once it answers."""
    os.makedirs(os.path.join(root, name), exist_ok=True)
    sock = os.path.join(root, name, "kvd.sock")
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "NCCL_NVLS_ENABLE": "0", **(env or {})}
    with open(os.path.join(root, name, "daemon.log"), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli", "serve", "--socket-path", sock, "--node-id", name,
             "--peer-port", str(port), "--data-port", str(free_port()), "--http-port", "0",
             "--pool-size-bytes", "256MiB", "--gpu-staging-bytes", "1GiB",
             "--log-level", "warning", *EXTRA_FLAGS], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while True:
        try:
            with kvd.KvdClient(sock, timeout_s=1) as c:
                c.ping()
            return proc, sock, f"127.0.0.1:{port}"
        except kvd.DaemonUnavailable:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon {name} did not start (see {root})") from None
            time.sleep(0.1)


class Flow:
    """put on ``tx`` to ``to`` with a get already waiting on ``rx``; ``once`` returns the
    seconds to the get's return and leaves the seconds to both replies in ``acked_s``."""

    def __init__(self, tx_sock: str, rx_sock: str, to: str | None) -> None:
        self.tx = kvd.KvdClient(tx_sock, timeout_s=120)
        self.rx = kvd.KvdClient(rx_sock, timeout_s=120)
        self.watch = kvd.KvdClient(rx_sock, timeout_s=120)
        for c in (self.tx, self.rx, self.watch):
            c.connect()
        self.to = to
        self.n = 0
        self.acked_s = 0.0

    def register(self, src: list[torch.Tensor], dst: list[torch.Tensor]) -> tuple[Any, Any]:
        torch.cuda.synchronize()
        return self.tx.register(f"src{self.n}", src), self.rx.register(f"dst{self.n}", dst)

    def once(self, r_src: Any, src_ids: list[int], r_dst: Any, dst_ids: list[int]) -> float:
        """One timed transfer under a fresh key ``k<n>``. It leaves timeline marks
        (``put.start k<n>``, ``put.returned``, ``get.returned``) that tools/timeline.py
        reads when this process records (kvd/timeline.py); otherwise they cost nothing."""
        self.n += 1
        key = f"k{self.n}"
        got: dict[str, Any] = {}

        def get() -> None:
            try:
                got["n"] = self.rx.get(key, r_dst, dst_ids, timeout_s=60)
            except BaseException as exc:  # reported below
                got["err"] = exc
            timeline.mark("get.returned")
            got["t"] = time.perf_counter()

        thread = threading.Thread(target=get)
        thread.start()
        deadline = time.monotonic() + 10
        while "t" not in got and self.watch.stats()["waiting_gets"] < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the get never started waiting")
        t0 = time.perf_counter()
        timeline.mark(f"put.start {key}")
        sent = self.tx.put(key, r_src, src_ids, to=self.to, timeout_s=60).wait(60)
        timeline.mark("put.returned")
        t_put = time.perf_counter()
        thread.join(70)
        if "err" in got:
            raise RuntimeError(f"get failed: {got['err']!r}")
        if got["n"] != sent:
            raise RuntimeError(f"put moved {sent} bytes, get {got['n']}")
        self.acked_s = max(t_put, got["t"]) - t0
        return float(got["t"] - t0)

    def close(self) -> None:
        for c in (self.tx, self.rx, self.watch):
            c.close()


PHASES = ("queue_wait", "wire")


def phase_sums(metrics_text: str) -> dict[str, float]:
    """``{"<phase>_<direction>_<transport>_sum|_count": value}`` from a daemon's
    /metrics: kvd's own per-transfer timings (queue wait: request to first byte; wire:
    first byte to the end), to see where a case's time goes."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        for phase in PHASES:
            for part in ("_sum", "_count"):
                prefix = f"kvd_transfer_{phase}_seconds{part}{{"
                if line.startswith(prefix):
                    labels, value = line[len(prefix):].rsplit("} ", 1)
                    tags = dict(kv.split("=", 1) for kv in labels.split(","))
                    key = f"{phase}_{tags['direction'].strip(chr(34))}_" \
                          f"{tags['transport'].strip(chr(34))}{part}"
                    out[key] = float(value)
    return out


def phase_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean seconds per transfer of each phase between two scrapes."""
    means = {}
    for key, total in after.items():
        if key.endswith("_sum"):
            base = key[: -len("_sum")]
            n = after.get(base + "_count", 0) - before.get(base + "_count", 0)
            if n > 0:
                means[base + "_mean_us"] = round((total - before.get(key, 0.0)) / n * 1e6, 1)
    return means


def scrape(client: kvd.KvdClient) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://{client.stats()['http']}/metrics", timeout=10) as r:
        return phase_sums(r.read().decode())


PHASE_LOG: dict[str, dict[str, float]] = {}  # case -> kvd's own phase means (tx_/rx_)


def checked_times(flow: Flow, src: list[torch.Tensor], src_ids: list[int],
                  dst: list[torch.Tensor], dst_ids: list[int], repeat: int,
                  case: str = "") -> tuple[list[float], list[float]]:
    """Seconds to the get's return, and to both replies, of ``repeat`` checked transfers."""
    r_src, r_dst = flow.register(src, dst)
    flow.once(r_src, src_ids, r_dst, dst_ids)  # warm-up (channels, first NCCL transfer)
    torch.cuda.synchronize()
    for s, d in zip(src, dst, strict=True):  # compared as raw bits: NaN != NaN
        if not torch.equal(s[src_ids].to(d.device).view(torch.uint8), d[dst_ids].view(
                torch.uint8)):
            raise RuntimeError("destination differs from the source")
    before = (scrape(flow.tx), scrape(flow.rx))
    turns = [c.stats()["busy_poll"]["turns"] for c in (flow.tx, flow.rx)]
    times, acked = [], []
    for _ in range(repeat):
        times.append(flow.once(r_src, src_ids, r_dst, dst_ids))
        acked.append(flow.acked_s)
    after = (scrape(flow.tx), scrape(flow.rx))
    if case:
        PHASE_LOG[case] = {
            **{f"tx_{k}": v for k, v in phase_means(before[0], after[0]).items()},
            **{f"rx_{k}": v for k, v in phase_means(before[1], after[1]).items()}}
        # How much each daemon's loop spun (busy_poll), and whether work it handed to a
        # thread is still out (which stops the spinning until it returns).
        for side, c, t0 in (("tx", flow.tx, turns[0]), ("rx", flow.rx, turns[1])):
            spin = c.stats()["busy_poll"]
            PHASE_LOG[case][f"{side}_busy_poll_turns_per_transfer"] = round(
                (spin["turns"] - t0) / repeat)
            PHASE_LOG[case][f"{side}_busy_poll_threads_working"] = spin["threads_working"]
    flow.tx.unregister(r_src)
    flow.rx.unregister(r_dst)
    return times, acked


def llama(device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(-(2**15), 2**15 - 1, LLAMA_SHAPE, generator=gen, device=device,
                          dtype=torch.int16).view(torch.bfloat16)
            for _ in range(LLAMA_TENSORS)]


def summary(measured: tuple[list[float], list[float]], nbytes: int) -> dict[str, Any]:
    """Best and median of the times to get complete, and of the times to both replies."""
    def of(times: list[float]) -> dict[str, float]:
        best, median = min(times), statistics.median(times)
        return {"best_s": best, "median_s": median, "best_gbps": nbytes / best / 1e9,
                "median_gbps": nbytes / median / 1e9}
    return {**of(measured[0]), "acked": of(measured[1])}


def kvd_side(repeat: int, latency_repeat: int) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="kvd-gpu-bench-", dir="/tmp")
    procs = []
    try:
        a, a_sock, _ = start_daemon(root, "a", "0")
        procs.append(a)
        b, b_sock, b_addr = start_daemon(root, "b", "1")
        procs.append(b)
        both, both_sock, _ = start_daemon(root, "both", "0,1")
        procs.append(both)
        out: dict[str, Any] = {}
        rng = torch.Generator().manual_seed(0)

        remote = Flow(a_sock, b_sock, b_addr)
        try:
            big = [torch.randint(0, 255, (1024, MiB), dtype=torch.uint8, device="cuda:0")]
            big_dst = [torch.zeros_like(big[0], device="cuda:1")]
            all_ids = list(range(1024))
            out["a"] = summary(checked_times(remote, big, all_ids, big_dst, all_ids, repeat,
                                             "a"),
                               GiB)
            times, acked = checked_times(remote, big, [7], big_dst, [9], latency_repeat, "c")
            out["c_us"] = [t * 1e6 for t in times]
            out["c_acked_us"] = [t * 1e6 for t in acked]
            del big, big_dst
            torch.cuda.empty_cache()
            src, dst = llama("cuda:0", 1), [torch.zeros(LLAMA_SHAPE, dtype=torch.bfloat16,
                                                        device="cuda:1")
                                            for _ in range(LLAMA_TENSORS)]
            src_ids = torch.randperm(LLAMA_SHAPE[0], generator=rng)[:LLAMA_BLOCKS].tolist()
            dst_ids = torch.randperm(LLAMA_SHAPE[0], generator=rng)[:LLAMA_BLOCKS].tolist()
            nbytes = LLAMA_TENSORS * LLAMA_BLOCKS * 32 * 1024
            out["b"] = summary(checked_times(remote, src, src_ids, dst, dst_ids, repeat, "b"),
                               nbytes)
        finally:
            remote.close()
        local = Flow(both_sock, both_sock, None)
        try:
            for d in dst:
                d.zero_()
            out["d"] = summary(checked_times(local, src, src_ids, dst, dst_ids, repeat, "d"),
                               nbytes)
        finally:
            local.close()
        return out
    except BaseException:
        for name in ("a", "b", "both"):
            path = os.path.join(root, name, "daemon.log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    print(f"--- daemon {name} log:\n{f.read()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for proc in procs:
            stop_daemon(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--latency-repeat", type=int, default=100)
    ap.add_argument("--daemon-flag", action="append", default=[],
                    help="an extra operator flag for every kvd serve, e.g. "
                         "--daemon-flag=--gpu-staging-bytes=2GiB (development settings: "
                         "KVD_DEV in this environment, which the daemons inherit)")
    args = ap.parse_args()
    EXTRA_FLAGS.extend(args.daemon_flag)
    if torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 2
    raw_nccl = measure_raw_nccl({"1GiB": GiB, "512MiB": 512 * MiB}, latency_bytes=MiB,
                                iters=args.repeat)
    raw_copy = measure_raw_peer_copy(512 * MiB, iters=args.repeat)
    kv = kvd_side(args.repeat, args.latency_repeat)

    res: dict[str, Any] = {"gpus": [torch.cuda.get_device_name(i) for i in range(2)],
                           "nccl": raw_nccl.get("nccl_version"), "torch": torch.__version__,
                           "repeat": args.repeat}
    rows = []
    for name, raw, what in (("a", raw_nccl["sizes"]["1GiB"], "1 GiB contiguous, 2 daemons"),
                            ("b", raw_nccl["sizes"]["512MiB"],
                             "Llama-3-8B 256 random blocks (512 MiB), 2 daemons"),
                            ("d", raw_copy, "(b) in one daemon, GPU0 -> GPU1")):
        k = kv[name]
        raw_best, raw_median = raw["bytes"] / raw["best_s"] / 1e9, raw["bytes"] / raw[
            "median_s"] / 1e9
        ratio_best, ratio_median = k["best_gbps"] / raw_best, k["median_gbps"] / raw_median
        res.update({f"{name}_kvd_best_gbps": round(k["best_gbps"], 1),
                    f"{name}_kvd_median_gbps": round(k["median_gbps"], 1),
                    f"{name}_raw_best_gbps": round(raw_best, 1),
                    f"{name}_raw_median_gbps": round(raw_median, 1),
                    f"{name}_ratio_best": round(ratio_best, 3),
                    f"{name}_ratio_median": round(ratio_median, 3),
                    f"{name}_target_met": ratio_median >= 0.9,
                    f"{name}_acked_median_gbps": round(k["acked"]["median_gbps"], 1),
                    f"{name}_acked_ratio_median": round(
                        k["acked"]["median_gbps"] / raw_median, 3)})
        rows.append((name, what, raw_best, raw_median, k["best_gbps"], k["median_gbps"],
                     ratio_best, ratio_median, k["acked"]["median_gbps"] / raw_median))
    raw_lat = raw_nccl["latency_1MiB_us"]["median"]
    kvd_lat = statistics.median(kv["c_us"])
    res.update({"c_kvd_median_us": round(kvd_lat, 1), "c_kvd_p90_us": round(
        sorted(kv["c_us"])[int(0.9 * (len(kv["c_us"]) - 1))], 1),
        "c_raw_median_us": round(raw_lat, 1), "c_extra_us": round(kvd_lat - raw_lat, 1),
        "c_target_met": kvd_lat <= raw_lat + 100,
        "c_acked_median_us": round(statistics.median(kv["c_acked_us"]), 1)})

    print(f"kvd GPU transfers on {res['gpus'][0]} x2, NCCL {res['nccl']}, torch "
          f"{res['torch']}; best / median of {args.repeat}; GB/s = 1e9 B/s; kvd: put -> get "
          "complete (acked: until the put's reply too)")
    print(f"{'case':<52}{'raw GB/s':>16}{'kvd GB/s':>16}{'kvd/raw':>14}{'acked':>7}")
    for name, what, rb, rm, kb, km, qb, qm, qa in rows:
        print(f"({name}) {what:<48}{rb:>7.1f} /{rm:>6.1f}{kb:>9.1f} /{km:>6.1f}"
              f"{qb:>8.2f} /{qm:>5.2f}{qa:>7.2f}")
    print(f"(c) 1 MiB put -> get latency: kvd median {kvd_lat:.0f} us (p90 "
          f"{res['c_kvd_p90_us']:.0f}; acked {res['c_acked_median_us']:.0f}), raw NCCL "
          f"one-way {raw_lat:.0f} us, extra {kvd_lat - raw_lat:.0f} us")
    print("kvd's own per-transfer phases (mean us; queue_wait: request to first byte, wire: "
          "first byte to the end; tx = sending daemon, rx = receiving daemon; busy_poll: "
          "its loop's spinning turns per transfer, and thread work still out at the end):")
    for case, phases in sorted(PHASE_LOG.items()):
        print(f"  ({case}) " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(phases.items())))
        res.update({f"{case}_phase_{k}": v for k, v in phases.items()})
    if args.json:
        print(json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
