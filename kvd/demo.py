"""``kvd demo``: the whole path once, on this machine, with the bytes checked.

Starts a daemon as a subprocess on a private socket, then plays two inference processes:
a "prefill" client fills KV blocks with random data, offloads some to the daemon's host
pool and puts others to a "decode" client through the daemon; the decode client gets
them into different block slots. Every byte is compared at the far end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from kvd.client import KvdClient, shared_zeros
from kvd.errors import DaemonUnavailable, KvdError


def _wait_ready(proc: subprocess.Popen[bytes], socket_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DaemonUnavailable(f"daemon exited with code {proc.returncode} at startup")
        if os.path.exists(socket_path):
            try:
                with KvdClient(socket_path, timeout_s=5.0) as c:
                    c.ping()
                return
            except KvdError:  # not listening yet, or too busy to answer in time
                pass
        time.sleep(0.05)
    raise DaemonUnavailable(f"daemon did not come up on {socket_path} in {timeout_s:g}s")


def run_demo(args: argparse.Namespace) -> int:
    import torch

    num_blocks, layers = args.blocks, args.layers
    # One block of one layer: 16 tokens x 4 heads x (block_kib*1024/128) fp16 values.
    head_dim = args.block_kib * 1024 // (16 * 4 * 2)
    shape = (num_blocks, 16, 4, head_dim)
    with tempfile.TemporaryDirectory(prefix="kvd-demo-") as tmp:
        sock = os.path.join(tmp, "kvd.sock")
        cmd = [sys.executable, "-m", "kvd.cli", "serve", "--socket-path", sock,
               "--pool-size-bytes", "256MiB", "--http-port", "0", "--peer-port", "0",
               "--data-port", "0", "--log-level", "warning"]
        print(f"starting daemon: {' '.join(cmd[2:])}")
        # Its settings are all in its flags: whatever KVD_* variables this shell holds (for
        # another daemon, or a typo) are not the demo's, and do not reach its daemon.
        env = {name: value for name, value in os.environ.items()
               if not name.startswith("KVD_")}
        daemon = subprocess.Popen(cmd, env=env)
        try:
            _wait_ready(daemon, sock, 90.0)  # a loaded machine imports torch slowly
            with KvdClient(sock, name="prefill") as prefill, \
                    KvdClient(sock, name="decode") as decode:
                src = [shared_zeros(shape, torch.float16) for _ in range(layers)]
                dst = [shared_zeros(shape, torch.float16) for _ in range(layers)]
                for t in src:
                    t.copy_(torch.randn(shape, dtype=torch.float32).to(torch.float16))
                r_src = prefill.register("kv", src)
                r_dst = decode.register("kv", dst)
                print(f"registered 2 regions: {layers} tensors x {num_blocks} blocks of "
                      f"{r_src.layout[0].bytes_per_block // 1024} KiB")

                n = num_blocks // 4
                src_blocks = list(range(n))
                dst_blocks = list(range(num_blocks - 1, num_blocks - 1 - n, -1))
                t0 = time.perf_counter()
                moved = prefill.put("request-1", r_src, src_blocks).wait()
                got = decode.get("request-1", r_dst, dst_blocks, timeout_s=10)
                put_s = time.perf_counter() - t0
                assert moved == got, (moved, got)

                off_blocks = list(range(n, 2 * n))
                t0 = time.perf_counter()
                stored = prefill.offload("prefix-cache", r_src, off_blocks, ttl_s=60)
                decode.get("prefix-cache", r_dst, off_blocks, timeout_s=10)  # (same slots)
                off_s = time.perf_counter() - t0

                bad = 0
                for s, d in zip(src, dst, strict=True):
                    bad += int(not torch.equal(s[src_blocks], d[dst_blocks]))
                    bad += int(not torch.equal(s[off_blocks], d[off_blocks]))
                stats = prefill.stats()
                print(f"put    request-1:    {moved / 2**20:.1f} MiB from prefill blocks "
                      f"{src_blocks[0]}..{src_blocks[-1]} to decode blocks "
                      f"{dst_blocks[0]}..{dst_blocks[-1]} in {put_s * 1e3:.1f} ms")
                print(f"offload prefix-cache: {stored / 2**20:.1f} MiB into the host pool and "
                      f"back in {off_s * 1e3:.1f} ms")
                print(f"daemon: {stats['keys']} key(s), pool used "
                      f"{stats['pool']['used_bytes'] / 2**20:.1f} of "
                      f"{stats['pool']['capacity_bytes'] / 2**20:.0f} MiB")
                if bad:
                    print(f"FAILED: {bad} tensor(s) differ at the far end")
                    return 1
                print(f"bytes checked: all {layers * 2} tensor slices identical")
        finally:
            daemon.terminate()
            code = daemon.wait(30)
        print(f"daemon stopped (exit code {code})")
        return 0 if code == 0 else 1
