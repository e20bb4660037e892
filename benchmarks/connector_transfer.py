"""The vLLM connector's data path (``kvd.integrations.kv_mover.KvMover``) against a raw
baseline of the same bytes, measured in the same run.

Run: ``python benchmarks/connector_transfer.py [--json] [--repeat N] [--blocks N]
[--concurrent N] [--device cpu|cuda] [--daemon-flag=--FLAG=VALUE]...`` (cuda: two GPUs,
one daemon each; ``bash .ci/gpu bench`` runs it).

Two ``kvd serve`` daemons, a prefill engine's and a decode engine's KV cache laid out as
vLLM 0.32 lays it out (one allocation, a view per layer, blocks on dim 0): by default a
Llama-3-8B-shaped cache, 32 layers of ``[num_blocks, 8 kv heads, 16 tokens, 2 x 128]`` bf16
(64 KiB per block per layer, 2 MiB per block over all layers). One request of ``--blocks``
random blocks moves from prefill's blocks to other random blocks of decode, timed from the
connector's ``send`` on prefill to decode's ``loaded`` (what a decode request waits for),
both movers polled every 0.5 ms as an engine's steps would:

* **pull** (the default flow): prefill lends the blocks, decode's daemon pulls them.
* **push, decode waiting**: decode has posted its load first; prefill puts to it.
* **pull, decode first**: decode starts its pull ``EARLY_S`` before prefill lends (as in
  vLLM, where prefill lends one engine step after it answered), timed from the lend.
* **pull, N at once** (``--concurrent``, 8 by default, 0 to skip): N such requests, to
  distinct blocks, lent and pulled in the same step, timed from the first ``send`` to the
  last ``loaded``; what a decode engine sees when many prompts finish prefill together.
  Its baseline is one raw transfer of all N requests' bytes.

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
EARLY_S = 0.005  # pull_early: decode's pull goes out this long before prefill lends
LAYERS, PAGE, DTYPE = 32, (8, 16, 256), torch.bfloat16


def engine_kv(num_blocks: int, device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    whole = torch.randn((LAYERS, num_blocks, *PAGE), generator=gen, device=device).to(DTYPE)
    return [whole[i] for i in range(LAYERS)]


def transfer_time(p: KvMover, d: KvMover, keys: list[str], t0: float,
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
                raise RuntimeError(f"load failed: {got.failed}")
            seen.released |= got.released
            seen.loaded |= got.loaded
            if loaded_at is None and seen.loaded.issuperset(keys):
                loaded_at = time.perf_counter()
        time.sleep(POLL_S)
    return loaded_at - t0


def same(p: KvMover, p_ids: list[int], d: KvMover, d_ids: list[int]) -> bool:
    if p.direct:
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
    return all(torch.equal(dl[d_ids].cpu(), pl[p_ids].cpu())
               for pl, dl in zip(p.layers, d.layers, strict=True))


def flows(concurrent: int) -> list[tuple[str, int]]:
    """(name, requests at once) of each flow measured."""
    return [("pull", 1), ("push", 1), ("pull_early", 1)] + ([(f"pull_x{concurrent}", concurrent)]
                                          if concurrent > 0 else [])


def kvd_side(device: str, num_blocks: int, n: int, concurrent: int, repeat: int, root: str,
             flags: list[str]) -> dict[str, Any]:
    procs = []
    try:
        if device == "cuda":
            import gpu_transfer
            from gpu_transfer import start_daemon as start_gpu_daemon

            gpu_transfer.EXTRA_FLAGS.extend(flags)

            pa, sock_a, addr_a = start_gpu_daemon(root, "prefill", "0")
            procs.append(pa)
            pb, sock_b, addr_b = start_gpu_daemon(root, "decode", "1")
            procs.append(pb)
            devs = ("cuda:0", "cuda:1")
        else:
            from tcp_transfer import start_daemon as start_cpu_daemon

            pool = 2 * n * max(concurrent, 1) * LAYERS * 64 * 1024 + 64 * MiB
            pa, sock_a = start_cpu_daemon(root, "prefill", pool, *flags)
            procs.append(pa)
            pb, sock_b = start_cpu_daemon(root, "decode", pool, *flags)
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
        staging = n * max(concurrent, 1)
        p = KvMover(clients[0], engine_kv(num_blocks, devs[0], 1), num_blocks, staging)
        d = KvMover(clients[1], engine_kv(num_blocks, devs[1], 2), num_blocks, staging)
        gen = torch.Generator().manual_seed(0)
        results: dict[str, Any] = {"bytes": n * p.block_bytes}
        for flow, at_once in flows(concurrent):
            times = []
            retries_before = d.stats.pull_retries
            for i in range(repeat + 1):  # the first run warms up and is checked
                # Distinct blocks for the requests that run at once, on both ends.
                src = torch.randperm(num_blocks, generator=gen)[:n * at_once].view(at_once, n)
                dst = torch.randperm(num_blocks, generator=gen)[:n * at_once].view(at_once, n)
                keys = [f"{flow}-{i}-{j}" for j in range(at_once)]
                t0 = time.perf_counter()
                if flow == "pull_early":
                    d.load(LoadOrder(keys[0], keys[0], addr_a, n, 0, dst[0].tolist(),
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
                                     push_to=addr_b))
                else:
                    for key, s_ids in zip(keys, src.tolist(), strict=True):
                        p.send(SendOrder(key, key, s_ids, lease_s=60))
                    for key, d_ids in zip(keys, dst.tolist(), strict=True):
                        d.load(LoadOrder(key, key, addr_a, n, 0, d_ids, timeout_s=60))
                elapsed = transfer_time(p, d, keys, t0)
                if i == 0:
                    if not same(p, src.flatten().tolist(), d, dst.flatten().tolist()):
                        raise RuntimeError(f"{flow}: decode's blocks differ from prefill's")
                else:
                    times.append(elapsed)
            results[flow] = times
            # A pull that reaches prefill before its lend is tried again 10 ms later.
            results[f"{flow}_pull_retries"] = d.stats.pull_retries - retries_before
        p.close()
        d.close()
        return results
    finally:
        for proc in procs:
            stop_daemon(proc)


def raw_side(device: str, sizes: list[int], repeat: int) -> dict[int, dict[str, Any]]:
    """The raw baseline of each byte count."""
    if device == "cuda":
        from gpu_raw import measure_raw_nccl

        raw = measure_raw_nccl({str(n): n for n in sizes}, iters=max(repeat, 5))["sizes"]
        return {n: {"what": "raw NCCL send/recv (torch.distributed)",
                    "best_s": raw[str(n)]["best_s"], "median_s": raw[str(n)]["median_s"]}
                for n in sizes}
    from tcp_transfer import raw_bench

    times = raw_bench(sizes, repeat)
    return {n: {"what": "raw loopback TCP, 4 MiB chunks", "best_s": min(times[n]),
                "median_s": statistics.median(times[n])} for n in sizes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=64, help="blocks in the request")
    ap.add_argument("--concurrent", type=int, default=8,
                    help="requests pulled at once in the last flow (0: skip it)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    ap.add_argument("--daemon-flag", action="append", default=[],
                    help="an extra operator flag for both kvd serve, e.g. "
                         "--daemon-flag=--gpu-staging-bytes=2GiB (development settings: "
                         "KVD_DEV in this environment, which the daemons inherit)")
    args = ap.parse_args()
    if args.blocks < 1 or args.repeat < 1 or args.concurrent < 0:
        ap.error("--blocks and --repeat must be at least 1, --concurrent at least 0")
    device = args.device or ("cuda" if torch.cuda.is_available()
                             and torch.cuda.device_count() >= 2 else "cpu")
    num_blocks = max(4 * args.blocks, 2 * args.blocks * args.concurrent, 256)
    with tempfile.TemporaryDirectory(prefix="kvd-conn-bench-") as root:
        kv = kvd_side(device, num_blocks, args.blocks, args.concurrent, args.repeat, root,
                      args.daemon_flag)
    nbytes = kv["bytes"]
    measured = flows(args.concurrent)
    raws = raw_side(device, sorted({nbytes * at_once for _, at_once in measured}),
                    args.repeat)
    raw = raws[nbytes]
    out: dict[str, Any] = {"device": device, "bytes": nbytes, "blocks": args.blocks,
                           "layers": LAYERS, "repeat": args.repeat,
                           "daemon_flags": args.daemon_flag,
                           "concurrent": args.concurrent, "raw": raw}
    print(f"connector data path, {device}: requests of {args.blocks} blocks x {LAYERS} "
          f"layers = {nbytes / MiB:.0f} MiB, {args.repeat} runs, GB/s best / median")
    labels = {"pull": "kvd pull (lend + pull)", "push": "kvd push (decode waiting)",
              "pull_early": "kvd pull, decode first (from the lend)"}
    for flow, at_once in measured:
        moved = nbytes * at_once
        r = raws[moved]
        raw_gbps = (moved / r["best_s"] / 1e9, moved / r["median_s"] / 1e9)
        if flow == "pull" or at_once > 1:
            what = f"{r['what']}, {moved / MiB:.0f} MiB"
            print(f"  {what:<46} {raw_gbps[0]:7.2f} / {raw_gbps[1]:7.2f}")
        t = kv[flow]
        best, median = min(t), statistics.median(t)
        o = out[flow] = {"requests": at_once, "bytes": moved, "best_s": best,
                         "median_s": median, "best_gbps": moved / best / 1e9,
                         "median_gbps": moved / median / 1e9,
                         "raw_best_s": r["best_s"], "raw_median_s": r["median_s"],
                         "pull_retries": kv[f"{flow}_pull_retries"]}
        o["ratio_best"] = o["best_gbps"] / raw_gbps[0]
        o["ratio_median"] = o["median_gbps"] / raw_gbps[1]
        label = labels.get(flow, f"kvd pull, {at_once} requests at once")
        print(f"  {label:<46} {o['best_gbps']:7.2f} / {o['median_gbps']:7.2f}   "
              f"kvd/raw {o['ratio_best']:.2f} / {o['ratio_median']:.2f}   "
              f"({o['median_s'] * 1e3:.1f} ms median"
              + (f", {o['pull_retries']} pulls retried)" if o["pull_retries"] else ")"))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
