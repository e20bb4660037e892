"""The vLLM connector's data path (``kvd.integrations.kv_mover.KvMover``) against a raw
baseline of the same bytes, measured in the same run.

Run: ``python benchmarks/connector_transfer.py [--json] [--repeat N] [--blocks N]
[--device cpu|cuda]`` (cuda: two GPUs, one daemon each; ``bash .ci/gpu bench`` runs it).

Two ``kvd serve`` daemons, a prefill engine's and a decode engine's KV cache laid out as
vLLM 0.32 lays it out (one allocation, a view per layer, blocks on dim 0): by default a
Llama-3-8B-shaped cache, 32 layers of ``[num_blocks, 8 kv heads, 16 tokens, 2 x 128]`` bf16
(64 KiB per block per layer, 2 MiB per block over all layers). One request of ``--blocks``
random blocks moves from prefill's blocks to other random blocks of decode, timed from the
connector's ``send`` on prefill to decode's ``loaded`` (what a decode request waits for),
both movers polled every 0.5 ms as an engine's steps would:

* **pull** (the default flow): prefill lends the blocks, decode's daemon pulls them.
* **push, decode waiting**: decode has posted its load first; prefill puts to it.

On CPU the engine's KV is private memory: both ends copy through shared-memory staging (as
the connector does there), and the baseline is raw loopback TCP of the same byte count
(``tcp_transfer.py``'s). On GPU the KV is registered in place, and the baseline is raw
NCCL send/recv of the same byte count between two processes (``gpu_raw.py``'s). Ratios are
kvd GB/s over raw GB/s, best and median of ``--repeat``; nothing is enforced. Every
transfer's destination blocks are compared with the source before timing starts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from daemons import stop_daemon  # benchmarks/ is on sys.path when run as a script

import kvd
from kvd.integrations.kv_mover import KvMover, LoadOrder, Polled, SendOrder

MiB = 2**20
POLL_S = 0.0005  # how often the movers are polled: an engine polls once per step
LAYERS, PAGE, DTYPE = 32, (8, 16, 256), torch.bfloat16


def engine_kv(num_blocks: int, device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    whole = torch.randn((LAYERS, num_blocks, *PAGE), generator=gen, device=device).to(DTYPE)
    return [whole[i] for i in range(LAYERS)]


def transfer_time(p: KvMover, d: KvMover, key: str, t0: float, timeout_s: float = 120.0,
                  ) -> float:
    """Seconds from ``t0`` to decode's ``loaded``; returns once prefill has released too."""
    seen = Polled()
    loaded_at = None
    deadline = time.monotonic() + timeout_s
    while key not in seen.released or loaded_at is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"transfer did not finish within {timeout_s}s: {seen}")
        for m in (p, d):
            got = m.poll()
            if got.failed:
                raise RuntimeError(f"load failed: {got.failed}")
            seen.released |= got.released
            if key in got.loaded and loaded_at is None:
                loaded_at = time.perf_counter()
        time.sleep(POLL_S)
    return loaded_at - t0


def same(p: KvMover, p_ids: list[int], d: KvMover, d_ids: list[int]) -> bool:
    if p.direct:
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
    return all(torch.equal(dl[d_ids].cpu(), pl[p_ids].cpu())
               for pl, dl in zip(p.layers, d.layers, strict=True))


def kvd_side(device: str, num_blocks: int, n: int, repeat: int, root: str) -> dict[str, Any]:
    procs = []
    try:
        if device == "cuda":
            from gpu_transfer import start_daemon as start_gpu_daemon

            pa, sock_a, addr_a = start_gpu_daemon(root, "prefill", "0")
            procs.append(pa)
            pb, sock_b, addr_b = start_gpu_daemon(root, "decode", "1")
            procs.append(pb)
            devs = ("cuda:0", "cuda:1")
        else:
            from tcp_transfer import start_daemon as start_cpu_daemon

            pool = 2 * n * LAYERS * 64 * 1024 + 64 * MiB
            pa, sock_a = start_cpu_daemon(root, "prefill", pool)
            procs.append(pa)
            pb, sock_b = start_cpu_daemon(root, "decode", pool)
            procs.append(pb)
            with kvd.KvdClient(sock_a) as c:
                addr_a = c.stats()["peer"]["address"]
            with kvd.KvdClient(sock_b) as c:
                addr_b = c.stats()["peer"]["address"]
            devs = ("cpu", "cpu")
        clients = [kvd.KvdClient(sock_a, name="prefill", timeout_s=120),
                   kvd.KvdClient(sock_b, name="decode", timeout_s=120)]
        for c in clients:
            c.connect()
        p = KvMover(clients[0], engine_kv(num_blocks, devs[0], 1), num_blocks, n)
        d = KvMover(clients[1], engine_kv(num_blocks, devs[1], 2), num_blocks, n)
        gen = torch.Generator().manual_seed(0)
        results: dict[str, Any] = {"bytes": n * p.block_bytes}
        for flow in ("pull", "push"):
            times = []
            for i in range(repeat + 1):  # the first run warms up and is checked
                src = torch.randperm(num_blocks, generator=gen)[:n].tolist()
                dst = torch.randperm(num_blocks, generator=gen)[:n].tolist()
                key = f"{flow}-{i}"
                t0 = time.perf_counter()
                if flow == "pull":
                    p.send(SendOrder(key, key, src, lease_s=60))
                    d.load(LoadOrder(key, key, addr_a, n, 0, dst, timeout_s=60))
                else:
                    d.load(LoadOrder(key, key, None, n, 0, dst, timeout_s=60))
                    d.poll()  # decode's get is posted before prefill sends
                    t0 = time.perf_counter()
                    p.send(SendOrder(key, key, src, lease_s=60, push_to=addr_b))
                elapsed = transfer_time(p, d, key, t0)
                if i == 0:
                    if not same(p, src, d, dst):
                        raise RuntimeError(f"{flow}: decode's blocks differ from prefill's")
                else:
                    times.append(elapsed)
            results[flow] = times
        p.close()
        d.close()
        return results
    finally:
        for proc in procs:
            stop_daemon(proc)


def raw_side(device: str, nbytes: int, repeat: int) -> dict[str, Any]:
    if device == "cuda":
        from gpu_raw import measure_raw_nccl

        raw = measure_raw_nccl({"request": nbytes}, iters=max(repeat, 5))["sizes"]["request"]
        return {"what": "raw NCCL send/recv (torch.distributed)", "best_s": raw["best_s"],
                "median_s": raw["median_s"]}
    from tcp_transfer import raw_bench

    times = raw_bench([nbytes], repeat)[nbytes]
    return {"what": "raw loopback TCP, 4 MiB chunks", "best_s": min(times),
            "median_s": statistics.median(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=64, help="blocks in the request")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available()
                             and torch.cuda.device_count() >= 2 else "cpu")
    num_blocks = max(4 * args.blocks, 256)
    with tempfile.TemporaryDirectory(prefix="kvd-conn-bench-") as root:
        kv = kvd_side(device, num_blocks, args.blocks, args.repeat, root)
    raw = raw_side(device, kv["bytes"], args.repeat)
    nbytes = kv["bytes"]
    out: dict[str, Any] = {"device": device, "bytes": nbytes, "blocks": args.blocks,
                           "layers": LAYERS, "repeat": args.repeat, "raw": raw}
    gbps = {"raw": (nbytes / raw["best_s"] / 1e9, nbytes / raw["median_s"] / 1e9)}
    for flow in ("pull", "push"):
        t = kv[flow]
        best, median = min(t), statistics.median(t)
        gbps[flow] = (nbytes / best / 1e9, nbytes / median / 1e9)
        out[flow] = {"best_s": best, "median_s": median, "best_gbps": gbps[flow][0],
                     "median_gbps": gbps[flow][1],
                     "ratio_best": gbps[flow][0] / gbps["raw"][0],
                     "ratio_median": gbps[flow][1] / gbps["raw"][1]}
    print(f"connector data path, {device}: one request of {args.blocks} blocks x {LAYERS} "
          f"layers = {nbytes / MiB:.0f} MiB, {args.repeat} runs, GB/s best / median")
    print(f"  {raw['what']:<42} {gbps['raw'][0]:7.2f} / {gbps['raw'][1]:7.2f}")
    for flow, label in (("pull", "kvd pull (lend + pull)"),
                        ("push", "kvd push (decode waiting)")):
        o = out[flow]
        print(f"  {label:<42} {o['best_gbps']:7.2f} / {o['median_gbps']:7.2f}   "
              f"kvd/raw {o['ratio_best']:.2f} / {o['ratio_median']:.2f}   "
              f"({o['median_s'] * 1e3:.1f} ms median)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
