"""The load of benchmarks/mesh.py: one worker process's share of the transfers.

A worker holds a client of every daemon (``AsyncKvdClient``, on uvloop), each with one
shared-memory region of ``2 * slots`` blocks (the first half sources, the second
destinations). It starts transfers open-loop at its share of the rate: transfer k is due at
``start + offset + k / rate`` whatever the ones before it are doing, and its latency runs
from that due time, so a daemon (or this worker) that falls behind shows in the figures
instead of slowing the load down (no coordinated omission). How late the starts were is
reported too (``lags``): a worker that cannot keep up says so.

Each transfer takes a fresh key, a random pair of distinct daemons (src, dst) and one of
two flows, both what a prefill and a decode worker do:

* put: a get on dst (``sender`` = src), then a put on src to dst; done when both returned;
* pull: a lend on src, then a pull on dst (waiting for the key); done when both returned.

The source block is filled with a pattern derived from the transfer's number (64-bit words
``seed + i``), and the destination block is checked against it, every byte. A block whose
transfer failed is not used again (the daemon may still be writing it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import kvd

PING_EVERY_S = 0.02


@dataclass(frozen=True)
class LoadPlan:
    worker: int
    sockets: list[str]
    addresses: list[str]
    rate: float  # this worker's transfers per second
    workers: int  # how many share the load (their first transfers are spread)
    seconds: float
    block_bytes: int
    slots: int  # source and destination blocks per daemon
    pull_share: float  # the fraction of transfers that lend -> pull
    timeout_s: float


@dataclass
class LoadResult:
    put_ms: list[float] = field(default_factory=list)
    pull_ms: list[float] = field(default_factory=list)
    ping_ms: list[float] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)  # start past due
    errors: Counter[str] = field(default_factory=Counter)
    first_errors: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    started: int = 0


class End:
    """One daemon as this worker sees it: a client, its region and its free blocks."""

    def __init__(self, client: kvd.AsyncKvdClient, address: str, slots: int,
                 block_bytes: int) -> None:
        import torch

        self.client = client
        self.address = address
        self.slots = slots
        self.tensor = kvd.shared_zeros((2 * slots, block_bytes), torch.uint8)
        self.words = self.tensor.numpy().view(np.uint64)  # (2 * slots, block_bytes / 8)
        self.region: kvd.Region | None = None
        self.free_src: asyncio.Queue[int] = asyncio.Queue()
        self.free_dst: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(slots):
            self.free_src.put_nowait(slot)
            self.free_dst.put_nowait(slots + slot)

    async def register(self, name: str) -> None:
        self.region = await self.client.register(name, [self.tensor])


class Load:
    def __init__(self, plan: LoadPlan) -> None:
        self.plan = plan
        self.result = LoadResult()
        self.rng = random.Random(plan.worker * 7919 + 1)
        self.ramp = np.arange(plan.block_bytes // 8, dtype=np.uint64)
        self.ends: list[End] = []

    async def open(self) -> None:
        plan = self.plan
        for i, (sock, address) in enumerate(zip(plan.sockets, plan.addresses, strict=True)):
            client = kvd.AsyncKvdClient(sock, name=f"mesh-w{plan.worker}-d{i}",
                                        timeout_s=plan.timeout_s)
            self.ends.append(End(client, address, plan.slots, plan.block_bytes))
        await asyncio.gather(*(end.client.connect() for end in self.ends))
        await asyncio.gather(*(end.register(f"mesh-w{plan.worker}") for end in self.ends))

    async def close(self) -> None:
        for end in self.ends:
            with contextlib.suppress(Exception):
                await end.client.aclose()

    async def run(self, start_at: float) -> LoadResult:
        """The load, its first transfer due at ``start_at`` (``time.monotonic()``, which is
        system-wide on Linux: the benchmark's clock)."""
        plan = self.plan
        interval = 1.0 / plan.rate
        end_at = start_at + plan.seconds
        tasks: set[asyncio.Task[None]] = set()
        pinger = asyncio.create_task(self.pings(end_at))
        k = 0
        while (due := start_at + k * interval) < end_at:
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self.result.lag_ms.append(1e3 * max(0.0, time.monotonic() - due))
            task = asyncio.create_task(self.one(k, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            k += 1
        self.result.started = k
        if tasks:
            _, left = await asyncio.wait(set(tasks), timeout=plan.timeout_s + 5)
            for task in left:
                task.cancel()
            self.result.errors["unfinished"] += len(left)
            await asyncio.gather(*left, return_exceptions=True)
        await pinger
        return self.result

    async def pings(self, end_at: float) -> None:
        """Control round trips beside the load, to each daemon in turn."""
        i = 0
        while time.monotonic() < end_at:
            end = self.ends[i % len(self.ends)]
            i += 1
            try:
                self.result.ping_ms.append(1e3 * await end.client.ping(timeout_s=5.0))
            except kvd.KvdError as exc:
                self.note(f"ping:{type(exc).__name__}", exc)
            await asyncio.sleep(PING_EVERY_S)

    def note(self, kind: str, exc: BaseException | str) -> None:
        self.result.errors[kind] += 1
        if len(self.result.first_errors) < 5:
            self.result.first_errors.append(f"{kind}: {exc}")

    async def one(self, k: int, due: float) -> None:
        plan = self.plan
        src, dst = (self.ends[i] for i in self.rng.sample(range(len(self.ends)), 2))
        pull = self.rng.random() < plan.pull_share
        src_block = await src.free_src.get()
        dst_block = await dst.free_dst.get()
        seed = np.uint64((plan.worker << 40) + k + 1)
        np.add(self.ramp, seed, out=src.words[src_block])
        key = f"mesh-w{plan.worker}-{k}"
        try:
            async with asyncio.timeout(plan.timeout_s):
                if pull:
                    await self.lend_then_pull(key, src, src_block, dst, dst_block)
                else:
                    await self.put_into_get(key, src, src_block, dst, dst_block)
        except kvd.KvdError as exc:
            self.note(type(exc).__name__, exc)
            return  # (the blocks are not used again)
        except TimeoutError:
            self.note("timeout", f"{key} not done in {plan.timeout_s:g}s")
            return
        latency_ms = 1e3 * (time.monotonic() - due)
        got = dst.words[dst_block]
        if not np.array_equal(got - self.ramp, np.full_like(got, seed)):
            self.note("corrupt", f"{key}: destination differs from the source")
        else:
            self.result.bytes_checked += plan.block_bytes
            (self.result.pull_ms if pull else self.result.put_ms).append(latency_ms)
        src.free_src.put_nowait(src_block)
        dst.free_dst.put_nowait(dst_block)

    async def put_into_get(self, key: str, src: End, src_block: int, dst: End,
                           dst_block: int) -> None:
        assert src.region is not None and dst.region is not None
        get = await dst.client.start_get(key, dst.region, [dst_block], sender=src.address)
        put = await src.client.put(key, src.region, [src_block], to=dst.address)
        await both(put.wait(), get.wait())

    async def lend_then_pull(self, key: str, src: End, src_block: int, dst: End,
                             dst_block: int) -> None:
        assert src.region is not None and dst.region is not None
        lend = await src.client.lend(key, src.region, [src_block], ttl_s=self.plan.timeout_s)
        pull = dst.client.pull(key, src.address, dst.region, [dst_block],
                               wait_for_key_s=self.plan.timeout_s)
        await both(pull, lend.wait())


async def both(*waits: Any) -> None:
    """Wait for all; raise the first failure once all have ended (none left unread)."""
    for outcome in await asyncio.gather(*waits, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


async def load(plan: LoadPlan, conn: Connection) -> LoadResult:
    """Connect and register with every daemon, say "ready", then run the load from the
    start time the benchmark answers: with 64 daemons the setting up takes seconds, and a
    start fixed before it made the first seconds' transfers late, started in a burst."""
    work = Load(plan)
    try:
        await work.open()
        conn.send("ready")
        start_at = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        return await work.run(start_at + plan.worker / (plan.rate * plan.workers))
    finally:
        await work.close()


def run_on_uvloop(plan: LoadPlan, conn: Connection) -> LoadResult:
    """The plan's load on uvloop (the loop kvd's own clients and daemon run on), else
    asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(load(plan, conn))
    return uvloop.run(load(plan, conn))


def worker_main(conn: Connection) -> None:
    """A worker process: runs each plan it is sent, answers its result; ``None`` ends it."""
    with contextlib.suppress(Exception):  # dies with the benchmark (PR_SET_PDEATHSIG)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the benchmark stops us)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while (plan := conn.recv()) is not None:
        try:
            conn.send(run_on_uvloop(plan, conn))
        except BaseException as exc:  # the benchmark reports it and stops
            conn.send(f"worker {plan.worker} failed: {exc!r}")
