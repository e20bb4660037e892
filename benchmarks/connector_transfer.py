"""The vLLM connector's data path (``kvd.integrations.kv_mover.KvMover``) against a raw
baseline of the same bytes, measured in the same run.

Run: ``python benchmarks/connector_transfer.py [--json] [--repeat N] [--blocks N]
[--concurrent N] [--device cpu|cuda] [--daemon-flag=--FLAG=VALUE]...`` (cuda: one GPU;
``bash .ci/gpu bench`` runs it).

A prefill engine's and a decode engine's KV cache laid out as vLLM 0.32 lays it out (one
allocation, a view per layer, blocks on dim 0): a Llama-3-8B-shaped cache, 32 layers of
``[num_blocks, 8 kv heads, 16 tokens, 2 x 128]`` bf16 (64 KiB per block per layer, 2 MiB
per block over all layers). One request of ``--blocks`` random blocks (on cuda by default
128: a prompt of 2,048 tokens, 256 MiB) moves from prefill's blocks to other random blocks
of decode, timed from the connector's ``send`` on prefill to decode's ``loaded`` (what a
decode request waits for):

* **pull** (the default flow): prefill lends the blocks, decode pulls them.
* **push, decode waiting**: decode has posted its load first; prefill puts to it.
* **pull, decode first**: decode starts its pull ``EARLY_S`` before prefill lends (as in
  vLLM, where prefill lends one engine step after it answered), timed from the lend.
* **pull, N at once** (``--concurrent``, 8 by default, 0 to skip): N such requests, to
  distinct blocks, lent and pulled in the same step, timed from the first ``send`` to the
  last ``loaded``; what a decode engine sees when many prompts finish prefill together.
  Its baseline moves all N requests' blocks at once.

**cuda** (one GPU): one ``kvd serve`` and two engines on GPU 0, each its own ``KvMover``
with its own ``KvdClient`` of that daemon, as two vLLM instances on one node use it. Their
KV is registered in place (CUDA IPC); decode pulls from the daemon's own peer address and
prefill pushes to it (what the connector does when both engines' ``kvd_address`` is that
daemon). The baseline is the floor of the same move: one launch of kvd's gather/scatter
kernel (``kvd.transport.gpu_copy``) from prefill's tensors straight into decode's, the same
blocks, in this process with no daemon, timed from the launch to ``torch.cuda.synchronize``
(its block maps made before the clock starts). Each kvd transfer is followed by its
baseline (the machine is noisy: alternated, both see the same moment). The movers are
polled back to back: an engine polls once per step, and the step's length is the engine's
time, not the data path's.

**cpu**: two ``kvd serve`` daemons over loopback TCP, one per engine, both movers polled
every ``CPU_POLL_S`` (the CI machine has 2 cores, which a spinning poller would take from
the daemons). The engine's KV is private memory: both ends copy through shared-memory
staging (as the connector does there), and the baseline is raw loopback TCP of the same
byte count (``tcp_transfer.py``'s), measured after the kvd transfers.

Ratios are raw seconds over kvd seconds (kvd GB/s over raw GB/s), of the best and of the
median of ``--repeat``; the goal on cuda is 0.8 (reported, never enforced). Every flow's
first transfer is a warm-up whose destination blocks are compared with the source.
``--json``: the last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from daemons import stop_daemon  # benchmarks/ is on sys.path when run as a script

import kvd
from kvd.integrations.kv_mover import KvMover, LoadOrder, Polled, SendOrder

MiB = 2**20
CPU_POLL_S = 0.0005  # cpu: how often the movers are polled (cuda: back to back)
EARLY_S = 0.005  # pull_early: decode's pull goes out this long before prefill lends
LAYERS, PAGE, DTYPE = 32, (8, 16, 256), torch.bfloat16
BLOCKS = {"cuda": 128, "cpu": 64}  # --blocks by default (cpu: the CI machine's memory)
GOAL = 0.8  # cuda: kvd / raw


def engine_kv(num_blocks: int, device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    whole = torch.randn((LAYERS, num_blocks, *PAGE), generator=gen, device=device).to(DTYPE)
    return [whole[i] for i in range(LAYERS)]


def transfer_time(p: KvMover, d: KvMover, keys: list[str], t0: float, poll_s: float,
                  timeout_s: float = 120.0) -> float:
    """Seconds from ``t0`` to decode's ``loaded`` of the last of ``keys``; returns once
    prefill has released them all too."""
    seen = Polled()
    loaded_at = None
    deadline = time.monotonic() + timeout_s
    while not seen.released.issuperset(keys) or loaded_at is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"transfer did not finish within {timeout_s}s: {seen}")
        for m in (p, d):
            got = m.poll()
            if got.failed:
                raise RuntimeError(f"load failed: {got.failed} {got.causes}")
            seen.released |= got.released
            seen.loaded |= got.loaded
            if loaded_at is None and seen.loaded.issuperset(keys):
                loaded_at = time.perf_counter()
        if poll_s:
            time.sleep(poll_s)
    return loaded_at - t0


def same(p: KvMover, p_ids: list[int], d: KvMover, d_ids: list[int]) -> bool:
    if p.direct:
        torch.cuda.synchronize(p.layers[0].device)
    return all(torch.equal(dl[d_ids].cpu(), pl[p_ids].cpu())
               for pl, dl in zip(p.layers, d.layers, strict=True))


class RawCopy:
    """The floor on one GPU: one launch of kvd's gather/scatter kernel between two sets of
    tensors in this process, from the launch to ``torch.cuda.synchronize``."""

    def __init__(self, device: torch.device) -> None:
        from kvd.transport import gpu_copy

        if not gpu_copy.available():
            raise SystemExit("--device cuda needs kvd's copy kernel (Triton) for its baseline")
        gpu_copy.warm_up(device)  # compiled, and launched as kvd launches it

    def time(self, src: list[torch.Tensor], src_ids: list[int], dst: list[torch.Tensor],
             dst_ids: list[int]) -> float:
        from kvd.transport import gpu_copy

        device = src[0].device
        reader = gpu_copy.BlockMap(src, np.array(src_ids), device)
        writer = gpu_copy.BlockMap(dst, np.array(dst_ids), device)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        gpu_copy.copy(0, reader.pieces(), src=reader, dst=writer)
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0


def flows(concurrent: int) -> list[tuple[str, int]]:
    """(name, requests at once) of each flow measured."""
    return [("pull", 1), ("push", 1), ("pull_early", 1)] + ([(f"pull_x{concurrent}", concurrent)]
                                          if concurrent > 0 else [])


def start_daemons(device: str, n: int, concurrent: int, root: str, flags: list[str],
                  procs: list[Any]) -> tuple[tuple[str, str], tuple[str, str]]:
    """(prefill's, decode's) daemon socket and (prefill's, decode's) peer address: on cuda
    one daemon for both, on cpu one each."""
    if device == "cuda":
        import gpu_transfer

        gpu_transfer.EXTRA_FLAGS.extend(flags)
        proc, sock, addr = gpu_transfer.start_daemon(root, "node", "0")
        procs.append(proc)
        return (sock, sock), (addr, addr)
    from tcp_transfer import start_daemon as start_cpu_daemon

    pool = 2 * n * max(concurrent, 1) * LAYERS * 64 * 1024 + 64 * MiB
    socks, addrs = [], []
    for name in ("prefill", "decode"):
        proc, sock = start_cpu_daemon(root, name, pool, *flags)
        procs.append(proc)
        with kvd.KvdClient(sock) as c:
            addrs.append(c.stats()["peer"]["address"])
        socks.append(sock)
    return (socks[0], socks[1]), (addrs[0], addrs[1])


def kvd_side(device: str, num_blocks: int, n: int, concurrent: int, repeat: int, root: str,
             flags: list[str]) -> dict[str, Any]:
    """Per flow, the seconds of each timed kvd transfer (``kvd``) and, on cuda, of the raw
    copy of the same blocks right after it (``raw``)."""
    procs: list[Any] = []
    try:
        (sock_p, sock_d), (addr_p, addr_d) = start_daemons(device, n, concurrent, root,
                                                           flags, procs)
        dev = "cuda:0" if device == "cuda" else "cpu"
        raw = RawCopy(torch.device(dev)) if device == "cuda" else None
        poll_s = 0.0 if device == "cuda" else CPU_POLL_S
        clients = [kvd.KvdClient(sock_p, name="prefill", timeout_s=120),
                   kvd.KvdClient(sock_d, name="decode", timeout_s=120)]
        for c in clients:
            c.connect()
        staging = n * max(concurrent, 1)
        p = KvMover(clients[0], engine_kv(num_blocks, dev, 1), num_blocks, staging)
        d = KvMover(clients[1], engine_kv(num_blocks, dev, 2), num_blocks, staging)
        gen = torch.Generator().manual_seed(0)
        results: dict[str, Any] = {"bytes": n * p.block_bytes}
        for flow, at_once in flows(concurrent):
            kvd_s, raw_s = [], []
            retries_before = d.stats.pull_retries
            for i in range(repeat + 1):  # the first run warms up and is checked
                # Distinct blocks for the requests that run at once, on both ends.
                src = torch.randperm(num_blocks, generator=gen)[:n * at_once].view(at_once, n)
                dst = torch.randperm(num_blocks, generator=gen)[:n * at_once].view(at_once, n)
                keys = [f"{flow}-{i}-{j}" for j in range(at_once)]
                t0 = time.perf_counter()
                if flow == "pull_early":
                    d.load(LoadOrder(keys[0], keys[0], addr_p, n, 0, dst[0].tolist(),
                                     timeout_s=60))
                    d.poll()  # decode's pull is out before prefill lends
                    time.sleep(EARLY_S)
                    d.poll()
                    t0 = time.perf_counter()
                    p.send(SendOrder(keys[0], keys[0], src[0].tolist(), lease_s=60))
                elif flow == "push":
                    d.load(LoadOrder(keys[0], keys[0], None, n, 0, dst[0].tolist(),
                                     timeout_s=60))
                    d.poll()  # decode's get is posted before prefill sends
                    t0 = time.perf_counter()
                    p.send(SendOrder(keys[0], keys[0], src[0].tolist(), lease_s=60,
                                     push_to=addr_d))
                else:
                    for key, s_ids in zip(keys, src.tolist(), strict=True):
                        p.send(SendOrder(key, key, s_ids, lease_s=60))
                    for key, d_ids in zip(keys, dst.tolist(), strict=True):
                        d.load(LoadOrder(key, key, addr_p, n, 0, d_ids, timeout_s=60))
                elapsed = transfer_time(p, d, keys, t0, poll_s)
                src_ids, dst_ids = src.flatten().tolist(), dst.flatten().tolist()
                if i == 0:
                    if not same(p, src_ids, d, dst_ids):
                        raise RuntimeError(f"{flow}: decode's blocks differ from prefill's")
                    if raw is not None:
                        raw.time(p.layers, src_ids, d.layers, dst_ids)  # (its warm-up)
                    continue
                kvd_s.append(elapsed)
                if raw is not None:
                    raw_s.append(raw.time(p.layers, src_ids, d.layers, dst_ids))
            results[flow] = {"kvd": kvd_s, "raw": raw_s}
            # A pull that reaches prefill before its lend is tried again 10 ms later.
            results[f"{flow}_pull_retries"] = d.stats.pull_retries - retries_before
        p.close()
        d.close()
        return results
    finally:
        for proc in procs:
            stop_daemon(proc)


def raw_tcp(sizes: list[int], repeat: int) -> dict[int, list[float]]:
    """cpu: the raw baseline of each byte count, after the kvd side."""
    from tcp_transfer import raw_bench

    return raw_bench(sizes, repeat)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=None,
                    help=f"blocks in the request (default: cuda {BLOCKS['cuda']}, "
                         f"cpu {BLOCKS['cpu']})")
    ap.add_argument("--concurrent", type=int, default=8,
                    help="requests pulled at once in the last flow (0: skip it)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    ap.add_argument("--daemon-flag", action="append", default=[],
                    help="an extra operator flag for the kvd serve(s), e.g. "
                         "--daemon-flag=--gpu-staging-bytes=2GiB (development settings: "
                         "KVD_DEV in this environment, which the daemons inherit)")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    blocks = BLOCKS[device] if args.blocks is None else args.blocks
    if blocks < 1 or args.repeat < 1 or args.concurrent < 0:
        ap.error("--blocks and --repeat must be at least 1, --concurrent at least 0")
    num_blocks = max(4 * blocks, 2 * blocks * args.concurrent, 256)
    with tempfile.TemporaryDirectory(prefix="kvd-conn-bench-") as root:
        kv = kvd_side(device, num_blocks, blocks, args.concurrent, args.repeat, root,
                      args.daemon_flag)
    nbytes = kv["bytes"]
    measured = flows(args.concurrent)
    if device == "cpu":
        tcp = raw_tcp(sorted({nbytes * at_once for _, at_once in measured}), args.repeat)
        for flow, at_once in measured:
            kv[flow]["raw"] = tcp[nbytes * at_once]
    raw_what = ("one launch of kvd's gather/scatter kernel, same blocks, no daemon"
                if device == "cuda" else "raw loopback TCP, 4 MiB chunks")
    out: dict[str, Any] = {"device": device, "bytes": nbytes, "blocks": blocks,
                           "layers": LAYERS, "repeat": args.repeat,
                           "daemons": 1 if device == "cuda" else 2,
                           "daemon_flags": args.daemon_flag, "concurrent": args.concurrent,
                           "raw": raw_what, "goal": GOAL if device == "cuda" else None}
    print(f"connector data path, {device}: requests of {blocks} blocks x {LAYERS} layers = "
          f"{nbytes / MiB:.0f} MiB, {args.repeat} runs, {out['daemons']} daemon(s); raw: "
          f"{raw_what}")
    print(f"  {'flow':<40} {'kvd GB/s':>17} {'raw GB/s':>17} {'kvd/raw':>11}  best / median")
    labels = {"pull": "pull (lend + pull)", "push": "push (decode waiting)",
              "pull_early": "pull, decode first (from the lend)"}
    for flow, at_once in measured:
        moved = nbytes * at_once
        k, r = kv[flow]["kvd"], kv[flow]["raw"]
        o = out[flow] = {"requests": at_once, "bytes": moved,
                         "best_s": min(k), "median_s": statistics.median(k),
                         "raw_best_s": min(r), "raw_median_s": statistics.median(r),
                         "pull_retries": kv[f"{flow}_pull_retries"]}
        for what in ("best", "median"):
            o[f"{what}_gbps"] = moved / o[f"{what}_s"] / 1e9
            o[f"raw_{what}_gbps"] = moved / o[f"raw_{what}_s"] / 1e9
            o[f"ratio_{what}"] = o[f"raw_{what}_s"] / o[f"{what}_s"]
        label = labels.get(flow, f"pull, {at_once} requests at once")
        print(f"  {label:<40} {o['best_gbps']:7.1f} / {o['median_gbps']:7.1f} "
              f"{o['raw_best_gbps']:7.1f} / {o['raw_median_gbps']:7.1f} "
              f"{o['ratio_best']:5.2f} / {o['ratio_median']:.2f}  "
              f"({o['median_s'] * 1e3:.2f} against {o['raw_median_s'] * 1e3:.2f} ms median"
              + (f", {o['pull_retries']} pulls retried)" if o["pull_retries"] else ")"))
    if device == "cuda":
        print(f"  goal: kvd/raw >= {GOAL} (pull, median: {out['pull']['ratio_median']:.2f})")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
