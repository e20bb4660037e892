"""What one NCCL channel costs: its set-up time, and the GPU memory, host memory and threads
it holds while it lives.

    python benchmarks/nccl_channels.py [--channels 8] [--json]

Two processes, rank 0 (this one) and rank 1, each told it is a host of its own
(``NCCL_HOSTID``) so that NCCL connects them as two nodes even on a one-GPU machine, as two
daemons sharing one GPU do. They make ``--channels`` channels one after the other, as kvd
makes them (``transport.nccl_channel.NcclChannel``: a 2-rank communicator, its worker, its
streams; then one small message, which sets up NCCL's connections: kvd's warm-up). After
each, rank 0 reads the GPU's free memory (both ranks' ends: a channel is two ends, one in
each daemon), its own resident memory and its threads. The staging buffers a channel makes
on its first staged transfer are not in these figures: up to ``STAGING_BUFFERS`` x
``nccl_chunk_bytes`` more, per end (``transport/nccl_streams.py``).

The last line (``--json``): one object, every figure. Needs CUDA and nccl4py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from mesh import process_figures

from kvd.transport.nccl import nccl_version, new_unique_id
from kvd.transport.nccl_channel import NcclChannel
from kvd.transport.nccl_streams import STAGING_BUFFERS

MiB = 2**20
TIMEOUT_S = 60.0


def make_channel(i: int, uid: bytes, rank: int) -> tuple[NcclChannel, float]:
    """A channel joined and warm, and the seconds it took."""
    began = time.monotonic()
    channel = NcclChannel(f"probe-{i}", torch.device("cuda:0"), ("send", "recv")[rank], MiB)
    channel.start(uid, rank, TIMEOUT_S)
    channel.warm(TIMEOUT_S)
    while not channel.idle:
        if time.monotonic() - began > TIMEOUT_S:
            raise RuntimeError(f"channel {i} not warm within {TIMEOUT_S:g}s")
        time.sleep(0.001)
    if channel.failed is not None:
        raise RuntimeError(f"channel {i}: {channel.failed.message}")
    return channel, time.monotonic() - began


def rank1() -> None:
    """Join each channel rank 0 names on stdin; say so on stdout."""
    torch.zeros(1, device="cuda:0")
    channels = []
    for i, line in enumerate(sys.stdin):
        if line.strip() == "end":
            break
        channel, _ = make_channel(i, bytes.fromhex(line.strip()), 1)
        channels.append(channel)
        print("ready", flush=True)
    for channel in channels:
        channel.stop(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rank1", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank1:
        rank1()
        return
    env = {**os.environ, "NCCL_HOSTID": "kvd-probe-rank1", "NCCL_SOCKET_IFNAME": "lo",
           "NCCL_NVLS_ENABLE": "0"}
    os.environ.update({"NCCL_HOSTID": "kvd-probe-rank0", "NCCL_SOCKET_IFNAME": "lo",
                       "NCCL_NVLS_ENABLE": "0"})
    torch.zeros(1, device="cuda:0")
    other = subprocess.Popen([sys.executable, __file__, "--rank1"], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert other.stdin is not None and other.stdout is not None
    time.sleep(2.0)  # (rank 1's CUDA context made before the first figure is taken)
    base = (torch.cuda.mem_get_info()[0], process_figures(os.getpid()))
    rows, channels = [], []
    try:
        for i in range(args.channels):
            uid = new_unique_id()
            other.stdin.write(uid.hex() + "\n")
            other.stdin.flush()
            channel, took = make_channel(i, uid, 0)
            channels.append(channel)
            if other.stdout.readline().strip() != "ready":
                raise RuntimeError("rank 1 failed")
            now = process_figures(os.getpid())
            rows.append({"setup_s": round(took, 3),
                         "gpu_used_mib": round((base[0] - torch.cuda.mem_get_info()[0]) / MiB, 1),
                         "rss_mib": round(now["rss_mib"] - base[1]["rss_mib"], 1),
                         "threads": int(now["threads"] - base[1]["threads"])})
            print(f"channel {i + 1}: {rows[-1]}", file=sys.stderr)
        other.stdin.write("end\n")
        other.stdin.flush()
        other.wait(30)
    finally:
        if other.poll() is None:
            other.kill()
        for channel in channels:
            channel.stop(10)
    n = len(rows)
    out = {
        "nccl": nccl_version(), "gpu": torch.cuda.get_device_name(0), "channels": n,
        "setup_s_first": rows[0]["setup_s"],
        "setup_s_median": statistics.median(r["setup_s"] for r in rows),
        "setup_s_max": max(r["setup_s"] for r in rows),
        # Both ends of each channel (one per daemon), on the GPU they share here.
        "gpu_mib_per_channel_both_ends": round(rows[-1]["gpu_used_mib"] / n, 1),
        "gpu_mib_first_channel_both_ends": rows[0]["gpu_used_mib"],
        "gpu_mib_per_later_channel_both_ends": round(
            (rows[-1]["gpu_used_mib"] - rows[0]["gpu_used_mib"]) / max(1, n - 1), 1),
        "host_rss_mib_per_channel_one_end": round(rows[-1]["rss_mib"] / n, 1),
        "threads_per_channel_one_end": round(rows[-1]["threads"] / n, 2),
        "staging_mib_per_end_at_most": STAGING_BUFFERS * 128,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            if key != "rows":
                print(f"{key}: {value}")


if __name__ == "__main__":
    main()
