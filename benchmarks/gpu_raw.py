"""Raw GPU-to-GPU baselines that kvd's GPU transfer benchmark is compared against.

Run: ``python benchmarks/gpu_raw.py [--json] [--smoke-cpu]``
Import: ``from gpu_raw import measure_raw_nccl, measure_raw_peer_copy, measure_raw_block_copy``
(``benchmarks/gpu_transfer.py`` does, so both sets of figures come from the same run).

What it measures, with nothing but torch between the bytes and the hardware:

* **send/recv** (``measure_raw_nccl``): two worker processes, rank r on GPU r, started with
  ``subprocess`` running this file in its hidden ``--worker`` mode (not ``multiprocessing``:
  the GPU host runs under gVisor, where its queues and semaphores fail). Each joins a
  2-rank ``torch.distributed`` group over ``tcp://127.0.0.1`` with eager initialisation
  (``device_id`` given, so the NCCL communicator exists before anything is timed). For each
  size, rank 0 ``dist.send``-s a seeded random uint8 buffer and rank 1 ``dist.recv``-s it:
  3 untimed warm-up transfers, a barrier, then

  - *loop*: ``iters`` transfers back to back, timed on the receiver from after the barrier
    and a ``synchronize`` to after a final ``synchronize``: GB/s = bytes * iters / seconds;
  - *each*: ``iters`` more transfers timed one by one on the receiver (zero the buffer,
    synchronize, barrier, start the clock, recv, synchronize, stop), the sender posting each
    send right after the same barrier, so neither side starts ahead: best and median
    seconds.

  The receiver then regenerates the bytes from the same seed and compares them with what
  the last timed transfer delivered (``equal``). Latency is a ping-pong of
  ``latency_bytes``: rank 1 sends, rank 0 sends the bytes straight back; each round trip is
  timed on rank 1 with a ``synchronize`` at both ends, and one-way latency is half of it.
  Rank 1 does every timing, so it alone writes the results (a JSON file in a temporary
  directory that the parent reads).
* **peer copy** (``measure_raw_peer_copy``): in this process, ``dst.copy_(src)`` from GPU 0
  to GPU 1, warm-up, then the same *loop* and *each* timings as above.
* **block copy** (``measure_raw_block_copy``): the same for a list of blocks, as a KV cache
  moves: ``num_blocks`` distinct random source and destination rows of pools of
  ``4 * num_blocks`` blocks, ``dst_pool.index_copy_(0, dst_idx,
  src_pool.index_select(0, src_idx).to(dst_device))`` (gather, one bulk copy, scatter).

All times are host clock (``time.perf_counter``) around work fenced by
``torch.cuda.synchronize``, so they include launch overheads, as an application would see
them. GB/s is 1e9 bytes per second of payload. ``--smoke-cpu`` runs the very same functions
with the gloo backend on CPU tensors and small sizes, to check the logic without a GPU; its
numbers mean nothing. Workers get ``NCCL_NVLS_ENABLE=0`` unless it is already set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
WARMUP_ITERS = 3  # untimed transfers per size: first-use costs (connections, buffers)
LATENCY_WARMUP_ROUND_TRIPS = 10
WORLD_SIZE = 2
SOURCE_RANK = 0  # sends the bulk transfers, echoes the ping-pong
TIMING_RANK = 1  # receives the bulk transfers, starts and times the ping-pong
WORKER_SHUTDOWN_S = 10.0  # how long a killed worker gets to go away
LOG_TAIL_CHARS = 3000
THIS_FILE = os.path.abspath(__file__)

DEFAULT_SIZES = {"1GiB": 1 * GiB, "512MiB": 512 * MiB}
DEFAULT_LATENCY_BYTES = 1 * MiB
DEFAULT_PEER_COPY_BYTES = 512 * MiB
DEFAULT_BLOCK_COPIES = ((64 * KiB, 8192), (2 * MiB, 256))  # (block_bytes, num_blocks)

SMOKE_SIZES = {"4MiB": 4 * MiB, "1MiB": 1 * MiB}
SMOKE_LATENCY_BYTES = 64 * KiB
SMOKE_PEER_COPY_BYTES = 4 * MiB
SMOKE_BLOCK_COPIES = ((16 * KiB, 64),)
SMOKE_ITERS = 3
SMOKE_LATENCY_ROUND_TRIPS = 20


# ---------------------------------------------------------------- shared helpers


def size_label(nbytes: int) -> str:
    """``1073741824`` -> ``"1GiB"``; sizes that are not a whole unit stay in bytes."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def latency_key(latency_bytes: int) -> str:
    """The key of the latency figures in ``measure_raw_nccl``'s result, e.g. ``latency_1MiB_us``."""
    return f"latency_{size_label(latency_bytes)}_us"


def default_device_type(backend: str) -> str:
    """NCCL moves GPU memory only; any other backend (gloo) runs the CPU smoke path."""
    return "cuda" if backend == "nccl" else "cpu"


def device_for_rank(rank: int, device_type: str) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def synchronize(*devices: torch.device) -> None:
    """Wait for all queued work on these devices; CPU work is already done when it returns."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def seeded_bytes(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` random bytes that depend on ``seed`` only, placed on ``device``.

    Generated on the CPU rather than with the device's generator: torch's CUDA random kernels
    lay out their output by the GPU's SM count, so two different GPUs could disagree, and
    the receiver's check must not depend on that. Drawing int64 over the full 64-bit range
    and viewing it as bytes is about four times faster than drawing bytes one by one.
    """
    generator = torch.Generator().manual_seed(seed)
    words = torch.empty((nbytes + 7) // 8, dtype=torch.int64)
    words.random_(-(2**63), None, generator=generator)  # the full range: every bit random
    return words.view(torch.uint8)[:nbytes].to(device)


def time_loop(step: Callable[[], object], iters: int, devices: Iterable[torch.device]) -> float:
    """Seconds for ``iters`` back-to-back ``step()`` calls, fenced by a synchronize each side."""
    devices = tuple(devices)
    synchronize(*devices)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    synchronize(*devices)
    return time.perf_counter() - start


def time_each(
    step: Callable[[], object],
    iters: int,
    devices: Iterable[torch.device],
    prepare: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of each of ``iters`` ``step()`` calls, each fenced by a synchronize each side.

    ``prepare`` runs before each step, outside the clock (e.g. zero the destination, so the
    check after the last step proves that step delivered the bytes).
    """
    devices = tuple(devices)
    seconds = []
    for _ in range(iters):
        if prepare is not None:
            prepare()
        synchronize(*devices)
        start = time.perf_counter()
        step()
        synchronize(*devices)
        seconds.append(time.perf_counter() - start)
    return seconds


def transfer_stats(
    nbytes: int, loop_s: float, iters: int, each_s: list[float], equal: bool
) -> dict[str, Any]:
    best_s, median_s = min(each_s), statistics.median(each_s)
    return {
        "bytes": nbytes,
        "iters": iters,
        "loop_s": loop_s,
        "gbps_loop": nbytes * iters / loop_s / 1e9,
        "best_s": best_s,
        "median_s": median_s,
        "gbps_best": nbytes / best_s / 1e9,
        "gbps_median": nbytes / median_s / 1e9,
        "equal": equal,
    }


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile: the smallest value with ``fraction`` of them at or below it."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(fraction * len(ordered))) - 1]


def check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


# ---------------------------------------------------------------- send/recv: workers


def nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a CPU-only torch build has no NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def send_recv_one_size(
    rank: int, device: torch.device, nbytes: int, seed: int, iters: int
) -> dict[str, Any] | None:
    """Bulk send/recv of one size; the stats on the timing rank, None on the source rank."""
    if rank == SOURCE_RANK:
        buffer = seeded_bytes(nbytes, seed, device)
    else:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def transfer() -> None:
        if rank == SOURCE_RANK:
            dist.send(buffer, dst=TIMING_RANK)
        else:
            dist.recv(buffer, src=SOURCE_RANK)

    for _ in range(WARMUP_ITERS):
        transfer()
    synchronize(device)
    dist.barrier()
    loop_s = time_loop(transfer, iters, (device,))  # both ranks start right after the barrier

    def line_up() -> None:
        # Both ranks post each single transfer together. With sends posted ahead, NCCL can
        # move part of the next one into the receiver's staging buffers before its clock
        # starts: on 2xH200 that showed 406 GB/s "best" at 1 GiB against 368 in the loop.
        if rank == TIMING_RANK:
            buffer.zero_()  # so the check below proves the last timed transfer's bytes
        synchronize(device)
        dist.barrier()

    each_s = time_each(transfer, iters, (device,), prepare=line_up)
    if rank == SOURCE_RANK:
        return None
    equal = torch.equal(buffer, seeded_bytes(nbytes, seed, device))
    return transfer_stats(nbytes, loop_s, iters, each_s, equal)


def ping_pong(
    rank: int, device: torch.device, nbytes: int, round_trips: int
) -> dict[str, Any] | None:
    """One-way latency as half a round trip, timed on the timing rank; None on the other."""
    payload = seeded_bytes(nbytes, seed=1, device=device)
    echo = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def round_trip() -> None:
        if rank == TIMING_RANK:
            dist.send(payload, dst=SOURCE_RANK)
            dist.recv(echo, src=SOURCE_RANK)
        else:  # send back exactly what came in, so the timing rank can check it
            dist.recv(echo, src=TIMING_RANK)
            dist.send(echo, dst=TIMING_RANK)

    for _ in range(LATENCY_WARMUP_ROUND_TRIPS):
        round_trip()
    synchronize(device)
    dist.barrier()
    if rank == SOURCE_RANK:
        for _ in range(round_trips):
            round_trip()
        synchronize(device)
        return None
    round_trip_s = time_each(round_trip, round_trips, (device,), prepare=echo.zero_)
    one_way_us = [seconds / 2 * 1e6 for seconds in round_trip_s]
    return {
        "bytes": nbytes,
        "round_trips": round_trips,
        "median": statistics.median(one_way_us),
        "p90": percentile(one_way_us, 0.9),
        "min": min(one_way_us),
        "equal": torch.equal(echo, payload),
    }


def worker_main(rank: int, config_path: str) -> int:
    """One rank of ``measure_raw_nccl``; the timing rank writes the result file."""
    with open(config_path) as f:
        config = json.load(f)
    backend, device_type = config["backend"], config["device_type"]
    device = device_for_rank(rank, device_type)
    init_args: dict[str, Any] = {
        "backend": backend,
        "rank": rank,
        "world_size": WORLD_SIZE,
        # A file, not a TCP port: a port picked free in the parent can be taken (by a
        # daemon's NCCL bootstrap, say) before rank 0 listens on it (EADDRINUSE, seen).
        "init_method": f"file://{config['rendezvous_path']}",
        "timeout": timedelta(seconds=config["timeout_s"]),
    }
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        init_args["device_id"] = device  # eager init: the communicator is built here, untimed
    dist.init_process_group(**init_args)
    try:
        sizes: dict[str, Any] = {}
        for index, (label, nbytes) in enumerate(config["sizes"].items()):
            sizes[label] = send_recv_one_size(rank, device, nbytes, 1000 + index, config["iters"])
        latency = ping_pong(rank, device, config["latency_bytes"], config["latency_iters"])
    finally:
        dist.destroy_process_group()
    if rank == TIMING_RANK:
        result = {
            "backend": backend,
            "nccl_version": nccl_version() if backend == "nccl" else None,
            "sender_device": str(device_for_rank(SOURCE_RANK, device_type)),
            "receiver_device": str(device),
            "sizes": sizes,
            "latency_bytes": config["latency_bytes"],
            latency_key(config["latency_bytes"]): latency,
        }
        partial = config["result_path"] + ".partial"
        with open(partial, "w") as f:
            json.dump(result, f)
        os.replace(partial, config["result_path"])  # the parent never sees half a file
    return 0


# ---------------------------------------------------------------- send/recv: parent


def log_tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-LOG_TAIL_CHARS:]
    except OSError as exc:
        return f"(no log: {exc})"


def kill_workers(workers: list[subprocess.Popen[bytes]]) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):  # killed: it cannot hold on long
            worker.wait(WORKER_SHUTDOWN_S)


def wait_for_workers(
    workers: list[subprocess.Popen[bytes]], log_paths: list[str], backend: str, timeout_s: float
) -> None:
    """Return once every worker exited 0; otherwise kill them all and raise with their logs.

    A worker that fails leaves its peer blocked in a send or recv, so one failure ends both.
    """
    deadline = time.monotonic() + timeout_s
    problem = None
    while problem is None:
        codes = [worker.poll() for worker in workers]
        if all(code == 0 for code in codes):
            return
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            problem = ", ".join(f"rank {rank} exited with code {code}" for rank, code in failed)
        elif time.monotonic() > deadline:
            problem = f"timed out after {timeout_s:g} s"
        else:
            time.sleep(0.05)
    kill_workers(workers)
    logs = "".join(
        f"\n--- rank {rank} output (tail) ---\n{log_tail(path)}"
        for rank, path in enumerate(log_paths)
    )
    raise RuntimeError(f"raw {backend} send/recv benchmark failed: {problem}{logs}")


def measure_raw_nccl(
    sizes: Mapping[str, int],
    latency_bytes: int = 1 * MiB,
    iters: int = 20,
    latency_iters: int = 200,
    backend: str = "nccl",
    timeout_s: float = 120,
    device_type: str | None = None,
) -> dict[str, Any]:
    """Raw ``torch.distributed`` send/recv between two worker processes, rank r on GPU r.

    ``sizes`` maps a label to a byte count. ``device_type`` defaults to "cuda" for nccl and
    "cpu" otherwise (the gloo smoke path). Returns::

        {"backend", "nccl_version" (None unless nccl), "sender_device", "receiver_device",
         "sizes": {label: {"bytes", "iters", "loop_s", "gbps_loop", "best_s", "median_s",
                           "gbps_best", "gbps_median", "equal"}},
         "latency_bytes",
         latency_key(latency_bytes): {"bytes", "round_trips", "median", "p90", "min",
                                      "equal"}}  # one-way microseconds

    Raises RuntimeError, with the tail of each worker's output, if a worker fails or the
    whole run takes longer than ``timeout_s``.
    """
    if not sizes:
        raise ValueError("sizes is empty")
    check_counts(iters=iters, latency_iters=latency_iters, latency_bytes=latency_bytes)
    check_counts(**{f"sizes[{label!r}]": nbytes for label, nbytes in sizes.items()})
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP multicast is not wanted for p2p
    with tempfile.TemporaryDirectory(prefix="kvd-gpu-raw-") as tmp:
        config = {
            "backend": backend,
            "device_type": device_type or default_device_type(backend),
            "rendezvous_path": os.path.join(tmp, "rendezvous"),
            "sizes": dict(sizes),
            "iters": iters,
            "latency_bytes": latency_bytes,
            "latency_iters": latency_iters,
            "timeout_s": timeout_s,
            "result_path": os.path.join(tmp, "result.json"),
        }
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        log_paths = [os.path.join(tmp, f"rank{rank}.log") for rank in range(WORLD_SIZE)]
        workers: list[subprocess.Popen[bytes]] = []
        try:
            for rank, log_path in enumerate(log_paths):
                command = [
                    sys.executable,
                    THIS_FILE,
                    "--worker",
                    str(rank),
                    "--config",
                    config_path,
                ]
                with open(log_path, "wb") as log:  # the child keeps its own copy of the fd
                    workers.append(
                        subprocess.Popen(
                            command,
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=env,
                        )
                    )
            wait_for_workers(workers, log_paths, backend, timeout_s)
        finally:
            kill_workers(workers)  # no-op after a clean run; never leave a worker behind
        try:
            with open(config["result_path"]) as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            raise RuntimeError(
                f"raw {backend} send/recv benchmark: both workers exited 0 but the result "
                f"could not be read ({exc}); rank {TIMING_RANK} output:\n"
                f"{log_tail(log_paths[TIMING_RANK])}"
            ) from exc


# ---------------------------------------------------------------- copies in this process


def measure_raw_peer_copy(
    nbytes: int,
    iters: int = 10,
    src_device: torch.device | str = "cuda:0",
    dst_device: torch.device | str = "cuda:1",
) -> dict[str, Any]:
    """``dst.copy_(src)`` between two devices in this process.

    Returns ``{"src_device", "dst_device", "bytes", "iters", "loop_s", "gbps_loop", "best_s",
    "median_s", "gbps_best", "gbps_median", "equal"}``.
    """
    check_counts(nbytes=nbytes, iters=iters)
    src_device, dst_device = torch.device(src_device), torch.device(dst_device)
    seed = 2000
    src = seeded_bytes(nbytes, seed, src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    devices = (src_device, dst_device)

    def copy() -> None:
        dst.copy_(src)

    for _ in range(WARMUP_ITERS):
        copy()
    loop_s = time_loop(copy, iters, devices)
    each_s = time_each(copy, iters, devices, prepare=dst.zero_)
    equal = torch.equal(dst, seeded_bytes(nbytes, seed, dst_device))
    return {
        "src_device": str(src_device),
        "dst_device": str(dst_device),
        **transfer_stats(nbytes, loop_s, iters, each_s, equal),
    }


def measure_raw_block_copy(
    block_bytes: int,
    num_blocks: int,
    iters: int = 10,
    src_device: torch.device | str = "cuda:0",
    dst_device: torch.device | str = "cuda:1",
) -> dict[str, Any]:
    """Copy ``num_blocks`` scattered blocks between block pools on two devices.

    Source and destination indices are distinct random rows of pools of ``4 * num_blocks``
    blocks; one step is ``dst_pool.index_copy_(0, dst_idx, src_pool.index_select(0,
    src_idx).to(dst_device))``. ``bytes`` is the payload, ``block_bytes * num_blocks``.
    Returns ``{"src_device", "dst_device", "block_bytes", "num_blocks", "pool_blocks",
    "bytes", "iters", "loop_s", "gbps_loop", "best_s", "median_s", "gbps_best",
    "gbps_median", "equal"}``; ``equal`` means the chosen destination blocks hold the chosen
    source blocks and every other destination block is still zero.
    """
    check_counts(block_bytes=block_bytes, num_blocks=num_blocks, iters=iters)
    src_device, dst_device = torch.device(src_device), torch.device(dst_device)
    seed = 3000
    pool_blocks = 4 * num_blocks
    src_pool = seeded_bytes(pool_blocks * block_bytes, seed, src_device).view(pool_blocks, -1)
    dst_pool = torch.zeros(pool_blocks, block_bytes, dtype=torch.uint8, device=dst_device)
    index_generator = torch.Generator().manual_seed(seed + 1)
    src_idx_cpu = torch.randperm(pool_blocks, generator=index_generator)[:num_blocks]
    dst_idx_cpu = torch.randperm(pool_blocks, generator=index_generator)[:num_blocks]
    src_idx, dst_idx = src_idx_cpu.to(src_device), dst_idx_cpu.to(dst_device)
    devices = (src_device, dst_device)

    def copy_blocks() -> None:
        dst_pool.index_copy_(0, dst_idx, src_pool.index_select(0, src_idx).to(dst_device))

    for _ in range(WARMUP_ITERS):  # also lets the caching allocator keep the staging buffers
        copy_blocks()
    loop_s = time_loop(copy_blocks, iters, devices)
    each_s = time_each(copy_blocks, iters, devices, prepare=dst_pool.zero_)
    # Check on the CPU against blocks regenerated from the seed, independent of the copy path.
    expected = seeded_bytes(pool_blocks * block_bytes, seed, torch.device("cpu"))
    expected_blocks = expected.view(pool_blocks, -1)[src_idx_cpu]
    blocks_equal = torch.equal(dst_pool.index_select(0, dst_idx).cpu(), expected_blocks)
    # Bytes are never negative, so equal sums with equal chosen blocks mean the rest is zero.
    pool_sum = int(dst_pool.sum(dtype=torch.int64))
    rest_zero = pool_sum == int(expected_blocks.sum(dtype=torch.int64))
    return {
        "src_device": str(src_device),
        "dst_device": str(dst_device),
        "block_bytes": block_bytes,
        "num_blocks": num_blocks,
        "pool_blocks": pool_blocks,
        **transfer_stats(
            block_bytes * num_blocks, loop_s, iters, each_s, blocks_equal and rest_zero
        ),
    }


# ---------------------------------------------------------------- command line


def block_copy_label(block_bytes: int, num_blocks: int) -> str:
    return f"{num_blocks}x{size_label(block_bytes)}"


def print_table(results: dict[str, Any]) -> None:
    send_recv = results["send_recv"]
    nccl = send_recv["nccl_version"]
    print(
        f"raw baselines ({results['mode']}): backend {send_recv['backend']}"
        + (f" (NCCL {nccl})" if nccl else "")
        + f", torch {results['torch']}, devices: {', '.join(results['devices']) or 'cpu'}"
    )
    print("GB/s = 1e9 bytes/s; loop = back-to-back iterations; best / median of single ones")
    print(f"\n{'what':<34}{'loop GB/s':>11}{'best GB/s':>11}{'best ms':>10}{'median ms':>11}  ok")
    rows: list[tuple[str, dict[str, Any]]] = [
        (f"send/recv {send_recv['sender_device']} -> {send_recv['receiver_device']} {label}", s)
        for label, s in send_recv["sizes"].items()
    ]
    peer = results["peer_copy"]
    rows.append(
        (f"copy_ {peer['src_device']} -> {peer['dst_device']} {size_label(peer['bytes'])}", peer)
    )
    for label, block in results["block_copy"].items():
        rows.append((f"block copy {label} ({size_label(block['bytes'])})", block))
    for name, s in rows:
        ok = "yes" if s["equal"] else "NO"
        print(
            f"{name:<34}{s['gbps_loop']:>11.2f}{s['gbps_best']:>11.2f}"
            f"{s['best_s'] * 1e3:>10.3f}{s['median_s'] * 1e3:>11.3f}  {ok}"
        )
    latency = send_recv[latency_key(send_recv["latency_bytes"])]
    print(
        f"\nping-pong {size_label(latency['bytes'])}, one way (round trip / 2, "
        f"{latency['round_trips']} round trips): median {latency['median']:.1f} us, "
        f"p90 {latency['p90']:.1f} us, min {latency['min']:.1f} us, "
        f"echo {'ok' if latency['equal'] else 'WRONG'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    parser.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="gloo on CPU tensors, small sizes: checks the logic, the numbers mean nothing",
    )
    parser.add_argument("--worker", type=int, choices=range(WORLD_SIZE), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        if not args.config:
            parser.error("--worker needs --config")
        return worker_main(args.worker, args.config)

    if args.smoke_cpu:
        mode, backend, src, dst = "smoke-cpu", "gloo", "cpu", "cpu"
        sizes, latency_bytes, peer_bytes = SMOKE_SIZES, SMOKE_LATENCY_BYTES, SMOKE_PEER_COPY_BYTES
        block_copies, iters = SMOKE_BLOCK_COPIES, SMOKE_ITERS
        latency_iters = SMOKE_LATENCY_ROUND_TRIPS
        copy_iters = SMOKE_ITERS
        devices: list[str] = []
    else:
        if torch.cuda.device_count() < WORLD_SIZE:
            parser.error(
                f"needs {WORLD_SIZE} GPUs, found {torch.cuda.device_count()} "
                "(--smoke-cpu checks the logic without one)"
            )
        mode, backend, src, dst = "gpu", "nccl", "cuda:0", "cuda:1"
        sizes, latency_bytes, peer_bytes = (
            DEFAULT_SIZES,
            DEFAULT_LATENCY_BYTES,
            DEFAULT_PEER_COPY_BYTES,
        )
        block_copies, iters, latency_iters, copy_iters = DEFAULT_BLOCK_COPIES, 20, 200, 10
        devices = [torch.cuda.get_device_name(i) for i in range(WORLD_SIZE)]

    print(
        f"send/recv ({backend}): {', '.join(sizes)}, latency {size_label(latency_bytes)}",
        file=sys.stderr,
    )
    send_recv = measure_raw_nccl(sizes, latency_bytes, iters, latency_iters, backend=backend)
    print(f"peer copy: {size_label(peer_bytes)}", file=sys.stderr)
    peer_copy = measure_raw_peer_copy(peer_bytes, copy_iters, src, dst)
    block_copy = {}
    for block_bytes, num_blocks in block_copies:
        label = block_copy_label(block_bytes, num_blocks)
        print(f"block copy: {label}", file=sys.stderr)
        block_copy[label] = measure_raw_block_copy(block_bytes, num_blocks, copy_iters, src, dst)

    results = {
        "mode": mode,
        "torch": torch.__version__,
        "devices": devices,
        "send_recv": send_recv,
        "peer_copy": peer_copy,
        "block_copy": block_copy,
    }
    print_table(results)
    if args.json:
        print(json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
