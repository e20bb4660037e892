"""Where a transfer's time goes: timeline marks from two daemons and this client.

Run: ``python tools/timeline.py [--device cpu|cuda] [--tensors N] [--blocks N]
[--block-bytes N] [--repeat N] [--contiguous] [--local] [--pull] [--dev KEY=VALUE]...
[--daemon-flag F]... [--json]``

Starts two ``kvd serve`` daemons recording timeline marks (``KVD_TIMELINE_DIR`` in their
environment, see ``kvd/timeline.py``; ``--dev`` items go to their ``KVD_DEV``, see
kvd/config.py; with ``--device cuda`` one per GPU, ``CUDA_VISIBLE_DEVICES`` 0 and 1, or both
on GPU 0 of a one-GPU host, each told it is a host of its own (``NCCL_HOSTID``) so that NCCL
joins them over its socket transport on loopback: the hand-offs are the daemons', the wire
is not NVLink's), or with ``--local`` one daemon, the local transport: case (d) between
two GPUs, or within GPU 0 of a one-GPU host; with ``--pull``, a pull of the daemon's own
address, as two engines that share one daemon pull),
registers a region of ``--tensors`` tensors of blocks on each (shared memory, or CUDA),
and times ``--repeat`` puts from A into a get already waiting on B, to the get's return
(``Flow.once`` of benchmarks/gpu_transfer.py, which marks ``put.start``, ``get.returned``
and ``put.returned`` in this client), or with ``--pull`` pulls from B of blocks A lent
(``pull_once``: ``pull.start``, ``pull.returned``, ``lend.returned``). Then it prints, for
every mark seen in most transfers, its median offset from the transfer's start: ``A:`` and
``B:`` are the daemons, ``X:`` this client. Last, per daemon and NCCL direction, the two
hand-offs of a job between its loop and its channel's worker (medians over the transfers):
``nccl.<dir>.queued`` -> ``.start`` (the worker took it) and ``.end`` (its bytes are there,
its future set) -> ``.seen`` (the loop ran the future's callback). A diagnostic, not a
benchmark: it prints no ratio, and recording marks costs a little time itself.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from daemons import stop_daemon
from gpu_transfer import EXTRA_FLAGS, Flow, start_daemon

from kvd import timeline
from kvd.client.shm import shared_zeros


def offsets(tdir: str, roles: dict[int, str], keys: list[str], start_mark: str = "put.start",
            ) -> dict[str, list[float]]:
    """Per mark (role:name, numbered when it recurs within a transfer): its offsets in
    microseconds from the start of each timed transfer (this client's ``start_mark``)."""
    marks = []
    for path in glob.glob(os.path.join(tdir, "*.json")):
        with open(path) as f:
            data = json.load(f)
        role = roles.get(data["pid"], str(data["pid"]))
        marks += [(t, f"{role}:{name}") for t, name, _thread in data["marks"]]
    marks.sort()
    timed = {f"X:{start_mark} {k}" for k in keys}
    per: dict[str, list[float]] = collections.defaultdict(list)
    start: float | None = None
    seen: collections.Counter[str] = collections.Counter()
    for t, name in marks:
        if name.startswith(f"X:{start_mark} "):
            start = t if name in timed else None
            seen.clear()
            continue
        if start is None or ".stats" in name or "stats_reply" in name:
            continue
        seen[name] += 1
        label = name if seen[name] == 1 else f"{name} #{seen[name]}"
        per[label].append((t - start) * 1e6)
    return per


def shared_gpu(name: str, one_gpu: bool) -> dict[str, str]:
    """Daemon ``name``'s NCCL environment when both daemons share this host's one GPU: a
    host of its own to NCCL, which refuses two ranks of one host on one GPU."""
    if not one_gpu:
        return {}
    return {"NCCL_HOSTID": f"kvd-timeline-{name}", "NCCL_SOCKET_IFNAME": "lo"}


def handoffs(per: dict[str, list[float]]) -> dict[str, float]:
    """Per daemon and NCCL direction, the median of each hand-off between its loop and the
    channel's worker (microseconds), from transfers that marked both ends of it once."""
    out: dict[str, float] = {}
    for label in per:
        role, _, name = label.partition(":")
        if not (name.startswith("nccl.") and name.endswith(".queued")):
            continue
        side = name[:-len(".queued")]
        for what, first, second in (("loop->worker", "queued", "start"),
                                    ("worker->loop", "end", "seen")):
            a, b = per.get(f"{role}:{side}.{first}"), per.get(f"{role}:{side}.{second}")
            if a and b and len(a) == len(b):
                out[f"{role}:{side} {what}"] = round(
                    statistics.median(y - x for x, y in zip(a, b, strict=True)), 1)
    return out


def pull_once(flow: Flow, r_src: Any, ids: list[int], r_dst: Any, a_addr: str) -> float:
    """A lends blocks under a fresh key; B pulls them (the vLLM connector's default flow).
    Returns the seconds of the pull, which marks ``pull.start <key>``, ``pull.returned``
    and, once A's lend has ended, ``lend.returned``."""
    flow.n += 1
    key = f"k{flow.n}"
    lent = flow.tx.lend(key, r_src, ids, ttl_s=60)
    deadline = time.monotonic() + 10
    while flow.tx.stats()["keys"] < 1:  # the lend is in (its reply comes at its end)
        if time.monotonic() > deadline:
            raise RuntimeError(f"daemon A never held {key}")
    t0 = time.perf_counter()
    timeline.mark(f"pull.start {key}")
    got = flow.rx.pull(key, a_addr, r_dst, ids, timeout_s=60)
    timeline.mark("pull.returned")
    took = time.perf_counter() - t0
    if lent.wait(60) != got:
        raise RuntimeError(f"lent {key}, but the pull moved {got} bytes")
    timeline.mark("lend.returned")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tensors", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=16, help="blocks moved per transfer")
    ap.add_argument("--block-bytes", type=int, default=64 * 1024)
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--contiguous", action="store_true",
                    help="move blocks 0..N-1 (one run: no staging) instead of every other")
    ap.add_argument("--local", action="store_true",
                    help="one daemon: the local transport, between its two GPUs (case "
                    "(d)) or within GPU 0 of a one-GPU host; needs --device cuda")
    ap.add_argument("--pull", action="store_true",
                    help="time a pull from B of blocks A lent (the vLLM connector's flow) "
                    "instead of a put into a waiting get (with --local: A pulls from "
                    "itself)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--dev", action="append", default=[], metavar="KEY=VALUE",
                    help="a development setting for both daemons (added to KVD_DEV), "
                         "e.g. --dev nccl_eager=false")
    ap.add_argument("--daemon-flag", action="append", default=[],
                    help="an extra operator flag for both daemons, e.g. "
                         "--daemon-flag=--gpu-staging-bytes=2GiB")
    args = ap.parse_args()
    EXTRA_FLAGS.extend(args.daemon_flag)
    # The daemons' folders and the marks; removed once read (a failed run leaves it, and
    # says where, for the daemons' logs).
    root = tempfile.mkdtemp(prefix="kvd-timeline-")
    tdir = os.path.join(root, "marks")
    os.mkdir(tdir)
    # The daemons inherit this environment (gpu_transfer.start_daemon).
    os.environ["KVD_TIMELINE_DIR"] = tdir
    os.environ["KVD_DEV"] = ",".join(
        item for item in [os.environ.get("KVD_DEV", ""), *args.dev] if item)
    cuda = args.device == "cuda"
    one_gpu = cuda and torch.cuda.device_count() < 2
    if args.local and not cuda:
        ap.error("--local copies between two GPUs of one daemon: it needs --device cuda")
    if not cuda:
        EXTRA_FLAGS.extend(["--gpu-staging-bytes", "0"])
    timeline.start(tdir)
    procs = []
    try:
        if args.local:
            a, a_sock, a_addr = start_daemon(root, "a", "0" if one_gpu else "0,1")
            procs.append(a)
            flow = Flow(a_sock, a_sock, None)
        else:
            gpu_a, gpu_b = ("0", "0" if one_gpu else "1") if cuda else ("", "")
            a, a_sock, a_addr = start_daemon(root, "a", gpu_a, shared_gpu("a", one_gpu))
            procs.append(a)
            b, b_sock, b_addr = start_daemon(root, "b", gpu_b, shared_gpu("b", one_gpu))
            procs.append(b)
            flow = Flow(a_sock, b_sock, b_addr)
        shape = ((1 if args.contiguous else 2) * args.blocks, args.block_bytes)

        def region(dev: str) -> list[torch.Tensor]:
            if cuda:
                # Random bytes, as the benchmark moves: with constant ones the 1 GiB case's
                # wire took ~2.9 ms here against ~3.6 ms in the benchmark.
                gen = torch.Generator(device=dev).manual_seed(1)
                return [torch.randint(0, 256, shape, dtype=torch.uint8, device=dev,
                                      generator=gen) for _ in range(args.tensors)]
            return [shared_zeros(shape, torch.uint8).fill_(i + 1) for i in range(args.tensors)]

        src, dst = region("cuda:0"), region("cuda:0" if one_gpu else "cuda:1")
        if cuda:
            torch.cuda.synchronize()
        r_src, r_dst = flow.tx.register("src", src), flow.rx.register("dst", dst)
        ids = list(range(args.blocks)) if args.contiguous else list(range(0, 2 * args.blocks, 2))
        once = (lambda: pull_once(flow, r_src, ids, r_dst, a_addr)) if args.pull else (
            lambda: flow.once(r_src, ids, r_dst, ids))
        once()  # warm-up: links, channels
        keys = [f"k{flow.n + 1 + i}" for i in range(args.repeat)]  # the keys once() uses
        totals = [once() * 1e6 for _ in keys]
        flow.close()
    finally:
        for proc in procs:
            stop_daemon(proc)
    timeline.stop()
    roles = {p.pid: role for p, role in zip(procs, "AB", strict=False)}
    per = offsets(tdir, {**roles, os.getpid(): "X"}, keys,
                  "pull.start" if args.pull else "put.start")
    shutil.rmtree(root)
    rows = sorted(((statistics.median(v), name, len(v)) for name, v in per.items()
                   if len(v) > args.repeat // 2))
    what = (("lend, then pull from the same daemon" if args.local else "lend on A, pull from B")
            if args.pull
            else "put -> waiting get" + (" (one daemon)" if args.local else ""))
    print(f"{what}, {args.device}, {args.tensors} tensor(s) x {args.blocks} "
          f"blocks of {args.block_bytes} B: median {statistics.median(totals):.0f} us over "
          f"{args.repeat}; mark offsets from its start (median us):")
    for med, name, n in rows:
        print(f"  {med:9.0f}  {name}" + ("" if n == args.repeat else f"  (in {n})"))
    hands = handoffs(per)
    if hands:
        print("hand-offs between loop and NCCL worker (median us"
              + (", one GPU: NCCL over sockets" if one_gpu else "") + "):")
        for name, us in hands.items():
            print(f"  {us:9.1f}  {name}")
    if args.json:
        print(json.dumps({"device": args.device, "tensors": args.tensors,
                          "blocks": args.blocks, "block_bytes": args.block_bytes,
                          "repeat": args.repeat,
                          "one_gpu": one_gpu,
                          "total_median_us": round(statistics.median(totals), 1),
                          "handoffs_median_us": hands,
                          "marks_median_us": {name: round(med, 1) for med, name, _ in rows}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
