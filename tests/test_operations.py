"""Operations inside one node, through a real daemon in the test's loop, async client."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

import kvd
from kvd import AsyncKvdClient, shared_empty, shared_zeros
from tests.conftest import RunningDaemon, in_process_only

SHAPE = (32, 16, 2, 64)  # blocks, tokens, heads, head_dim: 4 KiB per block in fp16


def random_tensors(n: int, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = shared_empty(shape, torch.float16)
        t.copy_(torch.randn(shape, generator=gen).to(torch.float16))
        out.append(t)
    return out


async def client(d: RunningDaemon, name: str = "") -> AsyncKvdClient:
    c = AsyncKvdClient(d.socket_path, name=name, timeout_s=10)
    await c.connect()
    return c


async def test_offload_get_round_trip(daemon: RunningDaemon) -> None:
    async with AsyncKvdClient(daemon.socket_path) as c:
        src = random_tensors(3, seed=1)
        dst = [shared_zeros(SHAPE, torch.float16) for _ in range(3)]
        r_src = await c.register("src", src)
        r_dst = await c.register("dst", dst)
        stored = await c.offload("k", r_src, [3, 1, 4, 1, 5])  # a source may repeat blocks
        assert stored == 3 * 5 * SHAPE[1] * SHAPE[2] * SHAPE[3] * 2
        got = await c.get("k", r_dst, [10, 11, 12, 13, 14], timeout_s=1)
        assert got == stored
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[10:15], s[[3, 1, 4, 1, 5]])
            assert torch.count_nonzero(d[:10]) == 0
        # An offloaded key stays for further gets until deleted.
        await c.get("k", r_dst, [0, 1, 2, 3, 4], timeout_s=1)
        assert torch.equal(dst[0][0:5], src[0][[3, 1, 4, 1, 5]])
        stats = await c.stats()
        assert stats["keys"] == 1 and stats["pool"]["used_bytes"] > 0
        await c.delete("k")
        stats = await c.stats()
        assert stats["keys"] == 0 and stats["pool"]["used_bytes"] == 0


@in_process_only
async def test_block_dim_not_first(daemon: RunningDaemon) -> None:
    # FlashAttention-style [2, num_blocks, block, heads, dim] with blocks on dim 1.
    shape = (2, 8, 4, 2, 16)
    async with AsyncKvdClient(daemon.socket_path) as c:
        src = random_tensors(2, shape, seed=2)
        dst = [shared_zeros(shape, torch.float16) for _ in range(2)]
        r_src = await c.register("src", src, block_dim=1)
        r_dst = await c.register("dst", dst, block_dim=1)
        assert r_src.num_blocks == 8
        await c.offload("k", r_src, [7, 0])
        await c.get("k", r_dst, [1, 2], timeout_s=1)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, 1], s[:, 7]) and torch.equal(d[:, 2], s[:, 0])
            assert torch.count_nonzero(d[:, 3:]) == 0


async def test_put_between_two_clients_get_first(daemon: RunningDaemon) -> None:
    a, b = await client(daemon, "prefill"), await client(daemon, "decode")
    try:
        src = random_tensors(2, seed=3)
        dst = [shared_zeros(SHAPE, torch.float16) for _ in range(2)]
        r_src, r_dst = await a.register("kv", src), await b.register("kv", dst)
        waiting = asyncio.create_task(b.get("req-1", r_dst, [20, 21, 22], timeout_s=5))
        await asyncio.sleep(0.05)  # the get is parked in the daemon
        assert (await a.stats())["waiting_gets"] == 1
        transfer = await a.put("req-1", r_src, [0, 1, 2])
        assert await transfer.wait(5) == await waiting
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[20:23], s[0:3])
        stats = await a.stats()
        # Delivered straight into the waiting blocks: nothing stayed in the pool.
        assert stats["keys"] == 0 and stats["pool"]["used_bytes"] == 0
    finally:
        await a.aclose()
        await b.aclose()


@in_process_only
async def test_put_before_get_is_consumed_once(daemon: RunningDaemon) -> None:
    a, b = await client(daemon), await client(daemon)
    try:
        src = random_tensors(1, seed=4)
        dst = [shared_zeros(SHAPE, torch.float16)]
        r_src, r_dst = await a.register("kv", src), await b.register("kv", dst)
        await (await a.put("req-2", r_src, [5, 6], to="local")).wait(5)
        assert (await a.stats())["keys"] == 1
        await b.get("req-2", r_dst, [0, 1], timeout_s=1)
        assert torch.equal(dst[0][0:2], src[0][5:7])
        stats = await b.stats()
        assert stats["keys"] == 0 and stats["pool"]["used_bytes"] == 0
        with pytest.raises(kvd.KvdTimeout):
            await b.get("req-2", r_dst, [0, 1], timeout_s=0.1)
    finally:
        await a.aclose()
        await b.aclose()


async def test_publish_is_read_in_place(daemon: RunningDaemon) -> None:
    a, b = await client(daemon), await client(daemon)
    try:
        src = random_tensors(2, seed=5)
        dst = [shared_zeros(SHAPE, torch.float16) for _ in range(2)]
        r_src, r_dst = await a.register("kv", src), await b.register("kv", dst)
        await a.publish("prefix", r_src, [8, 9])
        # Written after publishing: a published key is read at get time, not copied.
        for t in src:
            t[8].fill_(1.5)
        await b.get("prefix", r_dst, [30, 31], timeout_s=1)
        assert torch.all(dst[0][30] == 1.5) and torch.equal(dst[1][31], src[1][9])
        assert (await b.stats())["pool"]["used_bytes"] == 0
        with pytest.raises(kvd.BadRequest, match="another client"):
            await b.unpublish("prefix")
        await a.unpublish("prefix")
        with pytest.raises(kvd.UnknownKey):
            await a.unpublish("prefix")
    finally:
        await a.aclose()
        await b.aclose()


@in_process_only
async def test_ttl_expiry_frees_pool(daemon: RunningDaemon) -> None:
    async with AsyncKvdClient(daemon.socket_path) as c:
        r = await c.register("kv", random_tensors(1, seed=6))
        free0 = (await c.stats())["pool"]["free_bytes"]
        await c.offload("short", r, [0, 1], ttl_s=0.2)
        await c.offload("long", r, [2], ttl_s=60)
        assert (await c.stats())["keys"] == 2
        await asyncio.sleep(0.5)
        stats = await c.stats()
        assert stats["keys"] == 1 and stats["expired_keys"] == 1
        await c.delete("long")
        assert (await c.stats())["pool"]["free_bytes"] == free0
        with pytest.raises(kvd.UnknownKey):
            await c.get("short", r, [0, 1], timeout_s=0)


async def test_get_timeout_and_cancel(daemon: RunningDaemon) -> None:
    async with AsyncKvdClient(daemon.socket_path) as c:
        r = await c.register("kv", random_tensors(1, seed=7))
        with pytest.raises(kvd.KvdTimeout, match="never"):
            await c.get("never", r, [0], timeout_s=0.1)
        task = asyncio.create_task(c.get("later", r, [0], timeout_s=30))
        await asyncio.sleep(0.05)
        assert (await c.stats())["waiting_gets"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if (await c.stats())["waiting_gets"] == 0:
                break
            await asyncio.sleep(0.01)
        assert (await c.stats())["waiting_gets"] == 0
        # A put after the cancelled get is stored, not written into the cancelled blocks.
        before = r.tensors[0][0].clone()
        other = await c.register("other", random_tensors(1, seed=8))
        await (await c.put("later", other, [0])).wait(5)
        assert torch.equal(r.tensors[0][0], before)
        assert (await c.stats())["keys"] == 1


async def test_hundred_concurrent_ops_from_four_clients(daemon: RunningDaemon) -> None:
    clients = [await client(daemon, f"c{i}") for i in range(4)]
    try:
        regions, tensors = [], []
        for i, c in enumerate(clients):
            t = random_tensors(2, seed=10 + i)
            tensors.append(t)
            regions.append(await c.register("kv", t))
        dst = [[shared_zeros(SHAPE, torch.float16) for _ in range(2)] for _ in clients]
        dst_regions = [await c.register("dst", d) for c, d in zip(clients, dst, strict=True)]
        rng = random.Random(0)
        plan = []  # (client, key, src blocks, dst blocks)
        for n in range(25):
            for i in range(4):
                blocks = rng.sample(range(SHAPE[0]), 2)
                plan.append((i, f"c{i}-{n}", blocks, [n % SHAPE[0], (n + 16) % SHAPE[0]]))

        async def one(i: int, key: str, src_blocks: list[int]) -> None:
            c = clients[i]
            await c.offload(key, regions[i], src_blocks)

        await asyncio.gather(*(one(i, k, b) for i, k, b, _ in plan))
        assert (await clients[0].stats())["keys"] == 100
        # Each client reads back another client's keys (offloaded keys are shared).
        for i, key, src_blocks, dst_blocks in plan:
            reader = (i + 1) % 4
            await clients[reader].get(key, dst_regions[reader], dst_blocks, timeout_s=2)
            for s, d in zip(tensors[i], dst[reader], strict=True):
                assert torch.equal(d[dst_blocks], s[src_blocks])
        stats = await clients[0].stats()
        assert stats["ops"]["offload"] == 100 and stats["ops"]["get"] == 100
    finally:
        for c in clients:
            await c.aclose()
    # The offloads had no TTL: their owners are gone, so is the memory.
    async with AsyncKvdClient(daemon.socket_path) as c:
        for _ in range(200):
            stats = await c.stats()
            if stats["keys"] == 0:
                break
            await asyncio.sleep(0.01)
        assert stats["keys"] == 0 and stats["pool"]["used_bytes"] == 0 and stats["regions"] == 0


@in_process_only
async def test_pool_exhausted_is_retriable_error(daemon: RunningDaemon) -> None:
    async with AsyncKvdClient(daemon.socket_path) as c:
        big = shared_zeros((4, 8 * 2**20), torch.uint8)  # 4 blocks of 8 MiB
        r = await c.register("big", [big])
        for i in range(7):  # 64 MiB pool: 7 x 8 MiB fit
            await c.offload(f"k{i}", r, [i % 4])
        with pytest.raises(kvd.PoolExhausted) as info:
            await c.offload("k7", r, [0, 1])
        assert info.value.retriable
        assert (await c.stats())["keys"] == 7
        await c.delete("k0")
        await c.offload("k7", r, [0])


@in_process_only
async def test_unregister_fails_waiting_get(daemon: RunningDaemon) -> None:
    async with AsyncKvdClient(daemon.socket_path) as c:
        r = await c.register("kv", random_tensors(1, seed=9))
        task = asyncio.create_task(c.get("x", r, [0], timeout_s=30))
        await asyncio.sleep(0.05)
        await c.unregister(r)
        with pytest.raises(kvd.Cancelled, match="unregistered"):
            await task
        with pytest.raises(kvd.BadRequest, match="unknown region"):
            await c.offload("y", r, [0])
        assert (await c.stats())["regions"] == 0


async def test_daemon_unavailable_names_socket(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "nobody.sock")
    with pytest.raises(kvd.DaemonUnavailable, match=r"nobody\.sock"):
        await AsyncKvdClient(path, timeout_s=1).connect()
    # A socket file with no daemon behind it: refused within the timeout, no hang.
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(kvd.DaemonUnavailable, match=r"nobody\.sock"):
            await AsyncKvdClient(path, timeout_s=0.5).connect()
        assert loop.time() - t0 < 5
    finally:
        s.close()


@in_process_only
async def test_wrong_get_does_not_consume_a_put(daemon: RunningDaemon) -> None:
    a, b = await client(daemon), await client(daemon)
    try:
        src = random_tensors(1, seed=20)
        dst = [shared_zeros(SHAPE, torch.float16)]
        wrong = [shared_zeros((SHAPE[0], 3), torch.float16)]
        r_src, r_dst, r_wrong = (await a.register("kv", src), await b.register("kv", dst),
                                 await b.register("wrong", wrong))
        # A get parked with the wrong layout fails when the data arrives; the data stays.
        parked = asyncio.create_task(b.get("k1", r_wrong, [0], timeout_s=5))
        await asyncio.sleep(0.05)
        await (await a.put("k1", r_src, [4])).wait(5)
        with pytest.raises(kvd.LayoutMismatch, match="'wrong'"):
            await parked
        # A get with the wrong block count, or layout, after the data arrived: same.
        with pytest.raises(kvd.BadRequest, match="holds 1 blocks"):
            await b.get("k1", r_dst, [0, 1], timeout_s=1)
        with pytest.raises(kvd.LayoutMismatch):
            await b.get("k1", r_wrong, [0], timeout_s=1)
        await b.get("k1", r_dst, [9], timeout_s=1)
        assert torch.equal(dst[0][9], src[0][4])
        assert (await a.stats())["pool"]["used_bytes"] == 0
    finally:
        await a.aclose()
        await b.aclose()


async def test_cancel_a_running_put(daemon: RunningDaemon) -> None:
    async with AsyncKvdClient(daemon.socket_path) as c:
        big = shared_empty((2, 16 * 2**20), torch.uint8)  # 2 x 16 MiB: runs in the worker
        big.fill_(7)
        region = await c.register("big", [big])
        transfer = await c.put("big", region, [0, 1])
        await transfer.cancel()
        try:
            nbytes = await transfer.wait(5)
        except kvd.Cancelled:
            # Cancelled: nothing was stored and the pool memory is back.
            stats = await c.stats()
            assert stats["keys"] == 0 and stats["pool"]["used_bytes"] == 0
        else:  # finished before the cancel reached it: then it is all there
            assert nbytes == 32 * 2**20
            assert (await c.stats())["keys"] == 1
