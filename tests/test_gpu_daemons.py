"""Two daemons on one host, one per GPU, treated as separate nodes: KV blocks move between
GPU regions over NCCL channels (skipped without a GPU and nccl4py; with one GPU both
daemons share it, see tests/gpu_nodes.py). Every transfer is
checked byte for byte; a peer killed mid-stream fails the sender within its bound, and a
restarted peer works again."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import kvd
from kvd.transport.nccl import nccl_available
from tests.gpu_nodes import Node, free_port, gpu_count, node_gpus, start_node, stop_node

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and nccl_available()), reason="needs a GPU and nccl4py")]
GPU_A, GPU_B = node_gpus()  # the daemons' GPUs (the same one on a one-GPU host)
DEV_A, DEV_B = f"cuda:{GPU_A}", f"cuda:{GPU_B}"  # as this process names them

WARM_UP_OFF = {"KVD_DEV": "nccl_warm_up=off"}  # channels made by transfers only
SMALL_CHUNKS = {"KVD_DEV": "nccl_chunk_bytes=1MiB"}  # many chunks per transfer
SHAPE = (128, 16, 8, 128)  # blocks, tokens, kv heads, head dim: 32 KiB per block in bf16
LAYERS = 8


@contextlib.contextmanager
def two_nodes(*extra: str, dev: str = "") -> Iterator[tuple[Node, Node]]:
    """Two daemons with flags ``extra`` and development settings ``dev`` (KVD_DEV)."""
    a = start_node(GPU_A, *extra, env={"KVD_DEV": dev})
    try:
        b = start_node(GPU_B, *extra, env={"KVD_DEV": dev})
        try:
            yield a, b
        finally:
            stop_node(b)
    finally:
        stop_node(a)


def kv_layers(device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen, device=device).to(torch.bfloat16)
            for _ in range(LAYERS)]


def zeros(device: str) -> list[torch.Tensor]:
    return [torch.zeros(SHAPE, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]


def assert_moved(src: list[torch.Tensor], src_ids: list[int], dst: list[torch.Tensor],
                 dst_ids: list[int]) -> None:
    torch.cuda.synchronize()
    others = [i for i in range(SHAPE[0]) if i not in dst_ids]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[dst_ids].cpu(), s[src_ids].cpu())
        assert torch.count_nonzero(d[others].float()) == 0


def nccl_stats(c: kvd.KvdClient) -> dict:
    return c.stats()["transfers"]["nccl"]


def test_put_get_pull_between_gpu_regions_over_nccl() -> None:
    """Channels made on demand (no warm-up): by the first transfer that needs each."""
    rng = torch.Generator().manual_seed(3)
    with two_nodes(dev="nccl_warm_up=off") as (a, b), \
            kvd.KvdClient(a.sock, timeout_s=60) as ca, \
            kvd.KvdClient(b.sock, timeout_s=60) as cb:
        src, dst = kv_layers(DEV_A, 1), zeros(DEV_B)
        torch.cuda.synchronize()
        r_src, r_dst = ca.register("src", src), cb.register("dst", dst)
        # 1. get waiting on B, then the put from A: straight into the get's blocks
        src_ids = torch.randperm(SHAPE[0], generator=rng)[:40].tolist()
        dst_ids = torch.randperm(SHAPE[0], generator=rng)[:40].tolist()
        result: dict[str, object] = {}
        with kvd.KvdClient(b.sock, timeout_s=60) as getter_client:
            r_getter = getter_client.register("dst-again", dst)  # same memory, 2nd client

            def get_k1() -> None:
                try:
                    result["n"] = getter_client.get("k1", r_getter, dst_ids, timeout_s=60)
                except BaseException as exc:  # reported below
                    result["err"] = exc

            getter = threading.Thread(target=get_k1)
            getter.start()
            time.sleep(0.5)
            sent = ca.put("k1", r_src, src_ids, to=b.address).wait(60)
            getter.join(60)
        assert "cuda:0" in peer_devices(ca, b.address)
        assert "err" not in result, result
        assert sent == result["n"] == 40 * LAYERS * 32 * 1024
        assert_moved(src, src_ids, dst, dst_ids)
        stats = nccl_stats(ca)
        assert stats["created"] == 1 and stats["channels"][0]["direction"] == "send"

        # 2. put first: it waits in B's GPU staging, a later get takes it
        for d in dst:
            d.zero_()
        torch.cuda.synchronize()
        ids = list(range(64, 128))  # one run: sent straight from the region, no gather
        ca.put("k2", r_src, ids, to=b.address).wait(60)
        staged = cb.stats()["gpu_staging"]["cuda:0"]["used_bytes"]
        assert staged >= 64 * LAYERS * 32 * 1024
        cb.get("k2", r_dst, list(range(64)), timeout_s=60)
        assert_moved(src, ids, dst, list(range(64)))
        assert cb.stats()["gpu_staging"]["cuda:0"]["used_bytes"] == 0

        # 3. pull: B pulls a key A published (read in place from A's region)
        for d in dst:
            d.zero_()
        torch.cuda.synchronize()
        ca.publish("k3", r_src, [7, 3, 5])
        cb.pull("k3", a.address, r_dst, [100, 101, 102], timeout_s=60)
        assert_moved(src, [7, 3, 5], dst, [100, 101, 102])

        # 4. the other direction: B -> A, a new channel pair
        back = zeros(DEV_A)
        torch.cuda.synchronize()
        r_back = ca.register("back", back)
        cb.put("k4", r_dst, [100, 101, 102], to=a.address).wait(60)
        ca.get("k4", r_back, [0, 1, 2], timeout_s=60)
        assert_moved(src, [7, 3, 5], back, [0, 1, 2])
        assert nccl_stats(ca)["created"] == 2  # one send channel, one receive channel


def test_channels_are_warmed_up_when_a_peer_links() -> None:
    """nccl_warm_up = matching (the default): when a link comes up (here at start, from
    ``peers``) each side makes its receive channel from the other's cuda:0 and both move
    one small message on it; the first transfers each way then use those channels."""
    b = start_node(GPU_B)
    try:
        a = start_node(GPU_A, "--peers", b.address)
        try:
            with kvd.KvdClient(a.sock, timeout_s=60) as ca, \
                    kvd.KvdClient(b.sock, timeout_s=60) as cb:
                def warm(c: kvd.KvdClient) -> bool:
                    s = nccl_stats(c)
                    return (s["warmed"] == 2 and len(s["channels"]) == 2
                            and all(ch["idle"] for ch in s["channels"]))

                deadline = time.monotonic() + 90
                while not (warm(ca) and warm(cb)):
                    assert time.monotonic() < deadline, (nccl_stats(ca), nccl_stats(cb))
                    time.sleep(0.2)
                for c in (ca, cb):
                    s = nccl_stats(c)
                    assert s["created"] == 2 and s["failed"] == 0
                    assert sorted(ch["direction"] for ch in s["channels"]) == ["recv", "send"]
                src, dst = kv_layers(DEV_A, 4), zeros(DEV_B)
                back = zeros(DEV_A)
                torch.cuda.synchronize()
                r_src, r_dst = ca.register("src", src), cb.register("dst", dst)
                r_back = ca.register("back", back)
                ca.put("k", r_src, [5, 1, 9], to=b.address).wait(60)
                cb.get("k", r_dst, [0, 2, 4], timeout_s=60)
                assert_moved(src, [5, 1, 9], dst, [0, 2, 4])
                cb.put("k-back", r_dst, [0, 2, 4], to=a.address).wait(60)
                ca.get("k-back", r_back, [7, 8, 9], timeout_s=60)
                assert_moved(src, [5, 1, 9], back, [7, 8, 9])
                for c in (ca, cb):  # no channel was made for these transfers
                    assert nccl_stats(c)["created"] == 2
        finally:
            stop_node(a)
    finally:
        stop_node(b)


def test_eager_sends_and_dropped_offers_keep_channels_in_step() -> None:
    """nccl_eager (the default): once a channel to the peer exists, a GPU put queues its
    bytes with the OFFER. An offer the receiver cannot take (no room: BUSY) is still
    received, into staging, and dropped; the sender offers again without sending first
    (BUSY again until its deadline here). The channels stay in step and in use: the next
    transfers are byte-exact and no channel was made again or failed."""
    flags = ("--gpu-staging-bytes", "2MiB", "--pool-size-bytes", "4MiB")
    b = start_node(GPU_B, *flags)
    a: Node | None = None
    try:
        a = start_node(GPU_A, *flags, "--peers", b.address)  # linked, channels warmed, at start
        with kvd.KvdClient(a.sock, timeout_s=60) as ca, \
                kvd.KvdClient(b.sock, timeout_s=60) as cb:
            _eager_and_dropped(b, ca, cb)
    finally:
        if a is not None:
            stop_node(a)
        stop_node(b)


def _eager_and_dropped(b: Node, ca: kvd.KvdClient, cb: kvd.KvdClient) -> None:
    wait_warm(ca, cb)
    src, dst = kv_layers(DEV_A, 5), zeros(DEV_B)
    torch.cuda.synchronize()
    r_src, r_dst = ca.register("src", src), cb.register("dst", dst)
    ca.put("k1", r_src, [3, 8, 1], to=b.address).wait(60)  # 768 KiB: GPU staging
    cb.get("k1", r_dst, [0, 1, 2], timeout_s=60)
    assert_moved(src, [3, 8, 1], dst, [0, 1, 2])
    assert ca.stats()["transfers"]["eager_nccl_sent"] == 1
    with pytest.raises(kvd.PoolExhausted):  # 16 MiB: no room on B at all
        ca.put("huge", r_src, list(range(64, 128)), to=b.address, timeout_s=2).wait(60)
    stats = cb.stats()["transfers"]
    assert stats["eager_nccl_dropped"] == 1 and stats["busy_replies"] >= 2
    for d in dst:
        d.zero_()
    torch.cuda.synchronize()
    ca.put("k2", r_src, [9, 4], to=b.address).wait(60)
    cb.get("k2", r_dst, [5, 6], timeout_s=60)
    assert_moved(src, [9, 4], dst, [5, 6])
    assert ca.stats()["transfers"]["eager_nccl_sent"] == 3
    for c in (ca, cb):
        s = nccl_stats(c)
        assert s["created"] == 2 and s["failed"] == 0, s


def test_staged_and_direct_jobs_share_channels() -> None:
    """Transfers whose blocks need no staging go as one NCCL group of all their chunks,
    others chunk by chunk through staging, and one side may do one while the other does
    the other: a grouped send meets receives issued one by one and the other way round.
    Eight puts at once, one of them staged, queue on the same two channels, each channel's
    worker running them in order, the next issued while the one before is in its tail.
    Every transfer is byte-exact, every job ran on the channels' workers and no channel
    fails."""
    b = start_node(GPU_B, env=SMALL_CHUNKS)
    a: Node | None = None
    try:
        a = start_node(GPU_A, "--peers", b.address, env=SMALL_CHUNKS)
        with kvd.KvdClient(a.sock, timeout_s=60) as ca, \
                kvd.KvdClient(b.sock, timeout_s=60) as cb:
            wait_warm(ca, cb)
            src, dst = kv_layers(DEV_A, 7), zeros(DEV_B)
            torch.cuda.synchronize()
            r_src, r_dst = ca.register("src", src), cb.register("dst", dst)
            run, scattered = list(range(32)), list(range(127, 63, -2))  # 32 blocks: 8 chunks
            cases = [(run, run), (run, scattered), (scattered, run)]
            for i, (src_ids, dst_ids) in enumerate(cases):  # a get waiting for each
                for d in dst:
                    d.zero_()
                torch.cuda.synchronize()
                got = waiting_get(cb, f"k{i}", r_dst, dst_ids)
                ca.put(f"k{i}", r_src, src_ids, to=b.address).wait(60)
                assert got() == 32 * LAYERS * 32 * 1024
                assert_moved(src, src_ids, dst, dst_ids)
            # Eight puts at once: later ones queue behind the first on the same channels.
            for d in dst:
                d.zero_()
            torch.cuda.synchronize()
            groups = [list(range(16 * j, 16 * j + 16)) for j in range(8)]
            groups[3] = groups[3][::-1]  # one of them gathered, not one run
            errors: list[BaseException] = []

            def put(j: int) -> None:
                try:
                    with kvd.KvdClient(a.sock, timeout_s=60) as c:
                        r = c.register(f"src{j}", src)
                        c.put(f"c{j}", r, groups[j], to=b.address).wait(60)
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=put, args=(j,)) for j in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors, errors
            for j in range(len(groups)):
                cb.get(f"c{j}", r_dst, list(range(16 * j, 16 * j + 16)), timeout_s=60)
            assert_moved(src, [i for g in groups for i in g], dst, list(range(128)))
            sent, received = nccl_stats(ca), nccl_stats(cb)
            for s in (sent, received):
                assert s["created"] == 2 and s["failed"] == 0, s
            send_ch = next(c for c in sent["channels"] if c["direction"] == "send")
            recv_ch = next(c for c in received["channels"] if c["direction"] == "recv")
            # one job per transfer on each end (3 + 8), all of them on the channels' workers
            print("overlapped", send_ch["jobs_overlapped"], recv_ch["jobs_overlapped"])
            for ch in (send_ch, recv_ch):
                assert ch["jobs"] == 11 and 0 <= ch["jobs_overlapped"] < 11, ch
                assert ch["idle"] is True, ch
            # two daemons of this build, NCCL 2.28+: both said so, both ends split
            assert send_ch["blocking_calls"] is True and recv_ch["blocking_calls"] is True
    finally:
        if a is not None:
            stop_node(a)
        stop_node(b)


def test_consecutive_transfers_overlap_on_a_channel() -> None:
    """A transfer's successor on the channel issues its work while the transfer's bytes
    still move (here: held behind ~0.4 s of the client's GPU work), on both ends, and the
    two share the channel's staging buffers: a gather into a buffer waits for the send
    of the job before that still reads it, a receive into one for that job's scatter.
    Eight puts at once, of blocks that need staging on either end, neither, or both (four
    1 MiB chunks each, so each job cycles through both buffers twice); every one of them
    byte-exact."""
    b = start_node(GPU_B, env=SMALL_CHUNKS)
    a: Node | None = None
    try:
        a = start_node(GPU_A, "--peers", b.address, env=SMALL_CHUNKS)
        with kvd.KvdClient(a.sock, timeout_s=60) as ca, \
                kvd.KvdClient(b.sock, timeout_s=60) as cb:
            wait_warm(ca, cb)
            src, dst = kv_layers(DEV_A, 11), zeros(DEV_B)
            torch.cuda.synchronize()
            r_src, r_dst = ca.register("src", src), cb.register("dst", dst)
            # One staged transfer first: the channels' staging grows (in their threads).
            got = waiting_get(cb, "grow", r_dst, list(range(15, -1, -1)))
            ca.put("grow", r_src, list(range(16, 32)[::-1]), to=b.address).wait(60)
            assert got() == 16 * LAYERS * 32 * 1024
            assert_moved(src, list(range(16, 32)[::-1]), dst, list(range(15, -1, -1)))
            for d in dst:
                d.zero_()
            torch.cuda.synchronize()
            gen = torch.Generator().manual_seed(3)
            src_perm = torch.randperm(128, generator=gen).tolist()
            srcs, dsts = [], []
            for j in range(8):
                run = list(range(16 * j, 16 * j + 16))
                scattered = src_perm[16 * j:16 * j + 16]
                srcs.append(scattered if j % 2 else run)  # staged on A when odd
                dsts.append(run[::-1] if j % 4 >= 2 else run)  # staged on B for 2, 3, 6, 7
            gets = [cb.start_get(f"o{j}", r_dst, dsts[j], timeout_s=60) for j in range(8)]
            cb.ping()  # (answered after the gets were taken)
            torch.cuda._sleep(800_000_000)  # ~0.4 s of GPU work before the puts' events
            puts = [ca.put(f"o{j}", r_src, srcs[j], to=b.address) for j in range(8)]
            for p in puts:
                p.wait(60)
            for g in gets:
                assert g.wait(60) == 16 * LAYERS * 32 * 1024
            assert_moved(src, [i for s in srcs for i in s], dst, [i for d in dsts for i in d])
            sent, received = nccl_stats(ca), nccl_stats(cb)
            for s in (sent, received):
                assert s["created"] == 2 and s["failed"] == 0, s
            send_ch = next(c for c in sent["channels"] if c["direction"] == "send")
            recv_ch = next(c for c in received["channels"] if c["direction"] == "recv")
            print("overlapped", send_ch["jobs_overlapped"], recv_ch["jobs_overlapped"])
            assert send_ch["jobs_overlapped"] >= 1, send_ch
            assert recv_ch["jobs_overlapped"] >= 1, recv_ch
    finally:
        if a is not None:
            stop_node(a)
        stop_node(b)


def wait_warm(ca: kvd.KvdClient, cb: kvd.KvdClient) -> None:
    """Until both daemons have their warmed-up channels (two each), idle."""
    deadline = time.monotonic() + 90
    while True:
        channels = nccl_stats(ca)["channels"] + nccl_stats(cb)["channels"]
        if len(channels) == 4 and all(ch["idle"] for ch in channels):
            return
        assert time.monotonic() < deadline, (nccl_stats(ca), nccl_stats(cb))
        time.sleep(0.2)


def waiting_get(c: kvd.KvdClient, key: str, region: Any, ids: list[int]
                ) -> Callable[[], object]:
    """Start a get of ``key`` in a thread, waiting before the put comes; returns a
    function that joins it and gives its result (or raises its error)."""
    result: dict[str, object] = {}

    def get() -> None:
        try:
            result["n"] = c.get(key, region, ids, timeout_s=60)
        except BaseException as exc:  # reported by the join
            result["err"] = exc

    thread = threading.Thread(target=get)
    thread.start()
    time.sleep(0.3)

    def join() -> object:
        thread.join(60)
        assert not thread.is_alive(), f"get of {key} did not return"
        if "err" in result:
            raise result["err"]  # type: ignore[misc]
        return result["n"]

    return join


def peer_devices(c: kvd.KvdClient, address: str) -> list[str]:
    """The devices a linked peer told us (empty until linked)."""
    for link in c.stats()["peer"]["links"]:
        if link["address"] == address:
            return list(link["devices"])
    return []


def test_channels_past_the_memory_budget_are_evicted_least_recently_used_first() -> None:
    """nccl_channel_memory_bytes room for one channel on A, which sends to B, then C, then B: each
    new send channel evicts the idle one before it (CHANNEL_DOWN to its peer, which drops
    its end), and every transfer is byte-exact. Then puts to B and C at once: a channel
    whose send has not been confirmed by its receiver is not idle, so neither is evicted
    under the other (the budget is passed instead, and counted), and nothing fails."""
    b = start_node(GPU_B, env=WARM_UP_OFF)
    c: Node | None = None
    a: Node | None = None
    try:
        c = start_node(GPU_B, env=WARM_UP_OFF)
        a = start_node(GPU_A, "--nccl-channel-memory-bytes", "40MiB", env=WARM_UP_OFF)
        with kvd.KvdClient(a.sock, timeout_s=60) as ca, \
                kvd.KvdClient(b.sock, timeout_s=60) as cb, \
                kvd.KvdClient(c.sock, timeout_s=60) as cc:
            src = kv_layers(DEV_A, 13)
            dsts = {b.address: zeros(DEV_B), c.address: zeros(DEV_B)}
            torch.cuda.synchronize()
            r_src = ca.register("src", src)
            clients = {b.address: cb, c.address: cc}
            regions = {addr: clients[addr].register("dst", d) for addr, d in dsts.items()}
            for i, node in enumerate((b, c, b)):
                ids = list(range(10 * i, 10 * i + 10))
                ca.put(f"k{i}", r_src, ids, to=node.address).wait(60)
                clients[node.address].get(f"k{i}", regions[node.address], ids, timeout_s=60)
                torch.cuda.synchronize()
                for s_, d in zip(src, dsts[node.address], strict=True):
                    assert torch.equal(d[ids].cpu(), s_[ids].cpu())
            s = nccl_stats(ca)
            assert (s["created"], s["evicted"], s["failed"], len(s["channels"])) == (3, 2, 0, 1), s
            for client in (cb, cc):  # the evicted ends were dropped there too
                assert len(nccl_stats(client)["channels"]) <= 1, nccl_stats(client)
            # At once: 32 MiB each, the second one's ACCEPT arrives while the first is out.
            ids = list(range(64, 128))
            puts = [ca.put(f"both-{n.address}", r_src, ids, to=n.address) for n in (c, b)]
            for p in puts:
                p.wait(60)
            for node in (b, c):
                clients[node.address].get(f"both-{node.address}", regions[node.address], ids,
                                          timeout_s=60)
                torch.cuda.synchronize()
                for s_, d in zip(src, dsts[node.address], strict=True):
                    assert torch.equal(d[ids].cpu(), s_[ids].cpu())
            assert nccl_stats(ca)["failed"] == 0, nccl_stats(ca)
            for client in (cb, cc):
                assert nccl_stats(client)["failed"] == 0, nccl_stats(client)
    finally:
        for started in (a, c, b):
            if started is not None:
                stop_node(started)


def test_many_chunks_and_spill_to_host_pool() -> None:
    # Small chunks (many per transfer, staging reused) and 2 MiB of GPU staging: the
    # second put does not fit there and goes to B's host pool, and is still byte-exact.
    with two_nodes("--gpu-staging-bytes", "2MiB", dev="nccl_chunk_bytes=1MiB") as (a, b), \
            kvd.KvdClient(a.sock, timeout_s=60) as ca, \
            kvd.KvdClient(b.sock, timeout_s=60) as cb:
        src, dst = kv_layers(DEV_A, 2), zeros(DEV_B)
        torch.cuda.synchronize()
        r_src, r_dst = ca.register("src", src), cb.register("dst", dst)
        ca.put("small", r_src, [9, 1], to=b.address).wait(60)  # 512 KiB: GPU staging
        big_src = list(range(127, 47, -1))  # 80 blocks, 20 MiB in 1 MiB chunks
        ca.put("big", r_src, big_src, to=b.address).wait(60)
        stats = cb.stats()
        assert stats["gpu_spills"] == 1
        assert stats["pool"]["used_bytes"] >= 80 * LAYERS * 32 * 1024
        cb.get("big", r_dst, list(range(80)), timeout_s=60)
        cb.get("small", r_dst, [100, 101], timeout_s=60)
        assert_moved(src, [*big_src, 9, 1], dst, [*range(80), 100, 101])
        assert cb.stats()["pool"]["used_bytes"] == 0


def fails_when_signalled(step: Callable[[], object], proc: subprocess.Popen[bytes],
                         sig: signal.Signals, what: str) -> None:
    """Run ``step`` again and again in a thread, send ``sig`` to ``proc`` after a second of
    it: the loop must end with the error of a lost peer, within 10 s of the signal."""
    failure: dict[str, object] = {}

    def loop() -> None:
        try:
            while True:
                step()
        except kvd.KvdError as exc:
            failure["err"], failure["at"] = exc, time.monotonic()

    worker = threading.Thread(target=loop)
    worker.start()
    time.sleep(1.0)
    proc.send_signal(sig)
    signalled = time.monotonic()
    worker.join(30)
    assert not worker.is_alive(), f"{what}: the loop did not notice"
    err = failure["err"]
    detected = float(failure["at"]) - signalled  # type: ignore[arg-type]
    print(f"\n{what}: failed after {detected:.3f}s with {type(err).__name__}: {err}")
    assert isinstance(err, kvd.PeerUnreachable | kvd.KvdTimeout | kvd.TransferFailed)
    assert detected < 10


def until_linked(call: Callable[[], object],
                 errors: tuple[type[BaseException], ...] = (kvd.PeerUnreachable,)) -> None:
    """``call`` again every 0.5 s while it fails with ``errors`` (a peer that is back is
    linked again, and its old channel dropped, within 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            call()
            return
        except errors:
            assert time.monotonic() < deadline
            time.sleep(0.5)


def test_peer_killed_mid_stream_then_restarted() -> None:
    b_ports = (free_port(), free_port())
    a = start_node(GPU_A)
    b = start_node(GPU_B, ports=b_ports)
    try:
        with kvd.KvdClient(a.sock, timeout_s=60) as ca:
            src = [torch.randint(0, 255, (64, 8 * 2**20), dtype=torch.uint8,
                                 device=DEV_A)]  # 512 MiB
            torch.cuda.synchronize()
            r_src = ca.register("src", src)
            ca.put("warm", r_src, [0], to=b.address).wait(60)  # channel up
            sent = iter(range(1 << 30))
            # B keeps every key: its pool fills, then BUSY, or death
            fails_when_signalled(
                lambda: ca.put(f"s{next(sent)}", r_src, list(range(64)), to=b.address,
                               ttl_s=1).wait(60),
                b.proc, signal.SIGKILL, "peer SIGKILLed mid-stream, the sender")
            # A restarted peer (same address) works again, on a new channel.
            b = start_node(GPU_B, ports=b_ports)
            with kvd.KvdClient(b.sock, timeout_s=60) as cb:
                dst = [torch.zeros_like(src[0], device=DEV_B)]
                torch.cuda.synchronize()
                r_dst = cb.register("dst", dst)
                until_linked(lambda: ca.put("again", r_src, list(range(8)),
                                            to=b.address).wait(60))
                cb.get("again", r_dst, list(range(8)), timeout_s=60)
                torch.cuda.synchronize()
                assert torch.equal(dst[0][:8].cpu(), src[0][:8].cpu())
            assert ca.stats()["transfers"]["nccl"]["created"] >= 2
    finally:
        stop_node(b)
        stop_node(a)


def test_lender_killed_mid_pull_then_restarted() -> None:
    """The other side of the test above: B pulls 512 MiB from A again and again, and A is
    SIGKILLed. B's pull fails within the bound (long before its 60 s timeout), B lets go of
    everything the pull held (the transfer, its NCCL channel, staging), and a restarted A
    at the same address serves B's pulls again, byte-exact."""
    a_ports = (free_port(), free_port())
    a = start_node(GPU_A, ports=a_ports)
    b = start_node(GPU_B)
    try:
        with kvd.KvdClient(a.sock, timeout_s=60) as ca, \
                kvd.KvdClient(b.sock, timeout_s=60) as cb:
            src = [torch.randint(0, 255, (64, 8 * 2**20), dtype=torch.uint8,
                                 device=DEV_A)]  # 512 MiB
            dst = [torch.zeros_like(src[0], device=DEV_B)]
            torch.cuda.synchronize()
            r_src, r_dst = ca.register("src", src), cb.register("dst", dst)
            ca.publish("big", r_src, list(range(64)))
            cb.pull("big", a.address, r_dst, list(range(64)), timeout_s=60)  # channel up
            fails_when_signalled(
                lambda: cb.pull("big", a.address, r_dst, list(range(64)), timeout_s=60),
                a.proc, signal.SIGKILL, "lender SIGKILLed mid-pull, the pull")
            deadline = time.monotonic() + 10
            while True:  # the channel's teardown runs off the loop (~0.5 s)
                stats = cb.stats()
                held = (stats["transfers"]["in_flight_in"], len(nccl_stats(cb)["channels"]),
                        stats["gpu_staging"]["cuda:0"]["used_bytes"],
                        stats["pool"]["used_bytes"])
                if held == (0, 0, 0, 0):
                    break
                assert time.monotonic() < deadline, stats
                time.sleep(0.1)
            a = start_node(GPU_A, ports=a_ports)
            with kvd.KvdClient(a.sock, timeout_s=60) as ca2:
                r_again = ca2.register("src", src)
                ca2.publish("again", r_again, [5, 6, 7])
                dst[0].zero_()
                torch.cuda.synchronize()
                until_linked(lambda: cb.pull("again", a.address, r_dst, [0, 1, 2],
                                             timeout_s=60))
                torch.cuda.synchronize()
                assert torch.equal(dst[0][:3].cpu(), src[0][5:8].cpu())
                assert torch.count_nonzero(dst[0][3:]) == 0
    finally:
        stop_node(b)
        stop_node(a)


def test_peer_frozen_mid_stream_then_resumed() -> None:
    """A peer that hangs (SIGSTOP: its sockets stay open, NCCL sees nothing wrong) while A
    streams to it: A's put fails once the heartbeats miss (grace 2 s), not at its 60 s
    deadline, and A aborts its channel. Resumed (SIGCONT), B drops its stale end too, and
    the next puts between the two are byte-exact."""
    a = start_node(GPU_A)
    b = start_node(GPU_B)
    stopped = False
    try:
        with kvd.KvdClient(a.sock, timeout_s=60) as ca, \
                kvd.KvdClient(b.sock, timeout_s=60) as cb:
            src = [torch.randint(0, 255, (64, 8 * 2**20), dtype=torch.uint8,
                                 device=DEV_A)]  # 512 MiB
            dst = [torch.zeros((8, 8 * 2**20), dtype=torch.uint8, device=DEV_B)]
            torch.cuda.synchronize()
            r_src, r_dst = ca.register("src", src), cb.register("dst", dst)
            ca.put("warm", r_src, [0], to=b.address).wait(60)  # channel up
            cb.delete("warm")
            sent = iter(range(1 << 30))
            stopped = True  # (from here on: SIGCONT on the way out)
            fails_when_signalled(
                lambda: ca.put(f"s{next(sent)}", r_src, list(range(64)), to=b.address,
                               ttl_s=1).wait(60),
                b.proc, signal.SIGSTOP, "peer SIGSTOPped mid-stream, the sender")
            b.proc.send_signal(signal.SIGCONT)
            stopped = False
            # relinks; B may still be dropping its end of the old channel
            until_linked(lambda: ca.put("again", r_src, [9, 3, 5], to=b.address).wait(60),
                         (kvd.PeerUnreachable, kvd.TransferFailed, kvd.KvdTimeout))
            cb.get("again", r_dst, [0, 1, 2], timeout_s=60)
            torch.cuda.synchronize()
            assert torch.equal(dst[0][:3].cpu(), src[0][[9, 3, 5]].cpu())
            assert nccl_stats(ca)["created"] >= 2  # the old channel went with the link
    finally:
        if stopped:
            b.proc.send_signal(signal.SIGCONT)
        stop_node(b)
        stop_node(a)


RECEIVER = """
import sys, torch, kvd
c = kvd.KvdClient(sys.argv[1], timeout_s=60); c.connect()
dst = [torch.zeros((64, 8 * 2**20), dtype=torch.uint8, device=sys.argv[2])]
torch.cuda.synchronize()
got = c.start_get("big", c.register("dst", dst), list(range(64)), timeout_s=60)
c.ping()  # (answered after the get was taken)
print("waiting", flush=True)
got.wait(60)
"""


def test_receiving_client_killed_mid_transfer() -> None:
    """The client whose get a 512 MiB put is landing in is SIGKILLed: its daemon keeps the
    region mapped until the receive has finished writing (the bytes cannot be stopped half
    way), then drops it; the put ends (either way) without hanging, and the daemon, its
    CUDA and the channel stay usable: the next put into a new client is byte-exact."""
    a = start_node(GPU_A)
    b = start_node(GPU_B)
    child = None
    try:
        with kvd.KvdClient(a.sock, timeout_s=60) as ca, \
                kvd.KvdClient(b.sock, timeout_s=60) as cb:
            src = [torch.randint(0, 255, (64, 8 * 2**20), dtype=torch.uint8, device=DEV_A)]
            torch.cuda.synchronize()
            r_src = ca.register("src", src)
            ca.put("warm", r_src, [0], to=b.address).wait(60)  # channel up
            cb.delete("warm")
            child = subprocess.Popen([sys.executable, "-c", RECEIVER, b.sock, DEV_B],
                                     stdout=subprocess.PIPE, text=True)
            assert child.stdout is not None and child.stdout.readline().strip() == "waiting"
            outcome: dict[str, object] = {}

            def put() -> None:
                try:
                    outcome["n"] = ca.put("big", r_src, list(range(64)), to=b.address).wait(60)
                except kvd.KvdError as exc:
                    outcome["err"] = exc

            sender = threading.Thread(target=put)
            sender.start()
            time.sleep(0.08)  # the bytes are on their way (~0.2 s over sockets on one GPU)
            child.kill()
            child.wait(10)
            sender.join(70)
            assert not sender.is_alive(), "the put did not end"
            print(f"\nreceiving client killed mid-transfer: the put ended with {outcome}")
            deadline = time.monotonic() + 30
            while True:
                stats = cb.stats()
                if stats["regions"] == 0 and stats["transfers"]["in_flight_in"] == 0:
                    break
                assert time.monotonic() < deadline, stats
                time.sleep(0.1)
            with kvd.KvdClient(b.sock, timeout_s=60) as again:
                dst = [torch.zeros((8, 8 * 2**20), dtype=torch.uint8, device=DEV_B)]
                torch.cuda.synchronize()
                r_dst = again.register("dst", dst)
                ca.put("after", r_src, [7, 1, 4], to=b.address).wait(60)
                again.get("after", r_dst, [0, 1, 2], timeout_s=60)
                torch.cuda.synchronize()
                assert torch.equal(dst[0][:3].cpu(), src[0][[7, 1, 4]].cpu())
    finally:
        if child is not None and child.poll() is None:
            child.kill()
        stop_node(b)
        stop_node(a)


def test_same_gpu_local_copy() -> None:
    """Within one daemon and GPU, between two clients: a put stored then got; a lent key
    pulled from the daemon's own address, as two engines sharing it pull; and such a pull
    that waits for its key."""
    node = start_node(GPU_A)
    try:
        with kvd.KvdClient(node.sock, timeout_s=60) as c, \
                kvd.KvdClient(node.sock, timeout_s=60) as other:
            src, dst = kv_layers(DEV_A, 5), zeros(DEV_A)
            torch.cuda.synchronize()
            r_src, r_dst = c.register("src", src), other.register("dst", dst)
            c.put("k", r_src, [1, 2, 3, 50], ttl_s=60).wait(60)
            other.get("k", r_dst, [4, 5, 6, 7], timeout_s=60)
            lent = c.lend("lent", r_src, [9, 60, 8], ttl_s=60)
            assert other.pull("lent", node.address, r_dst, [70, 20, 90], timeout_s=60) > 0
            early = other.start_pull("early", node.address, r_dst, [100, 101], timeout_s=60,
                                     wait_for_key_s=30)
            time.sleep(0.2)
            assert not early.done()
            lent_late = c.lend("early", r_src, [127, 0], ttl_s=60)
            assert early.wait(60) == lent_late.wait(60) > 0 and lent.wait(60) > 0
            assert_moved(src, [1, 2, 3, 50, 9, 60, 8, 127, 0], dst,
                         [4, 5, 6, 7, 70, 20, 90, 100, 101])
    finally:
        stop_node(node)


def test_one_launch_gather_and_scatter_on_gpu() -> None:
    """The one-launch kernel (transport.gpu_copy) against the per-tensor copies: blocks
    large enough to be split into pieces, small ones, two dtypes, many chunks."""
    from kvd.protocol import LayoutEntry
    from kvd.transport import gpu_copy
    from kvd.transport.chunks import BlockSet, plan_chunks

    if not gpu_copy.available():
        pytest.skip("no triton here")
    gen = torch.Generator(device=DEV_B).manual_seed(11)
    src = [torch.randint(0, 2**15, (96, 64, 1024), generator=gen, device=DEV_B,
                         dtype=torch.int16),  # 128 KiB blocks: two pieces each
           torch.randint(0, 255, (96, 40 * 1024), generator=gen, device=DEV_B,
                         dtype=torch.uint8)]  # 40 KiB blocks
    layout = tuple(LayoutEntry(t[0].numel() * t.element_size(), "uint8") for t in src)
    ids_in = torch.randperm(96, generator=torch.Generator().manual_seed(1))[:50].tolist()
    ids_out = torch.randperm(96, generator=torch.Generator().manual_seed(2))[:50].tolist()
    dst = [torch.zeros_like(t) for t in src]
    chunks = plan_chunks(layout, 50, 1 << 20)
    staging = torch.empty(max(c.nbytes for c in chunks), dtype=torch.uint8, device=DEV_B)
    reader, writer = BlockSet(src, np.array(ids_in)), BlockSet(dst, np.array(ids_out))
    for chunk in chunks:
        writer.store(chunk, reader.load(chunk, staging))
    torch.cuda.synchronize()
    assert reader._maps[torch.device(DEV_B)] is not None  # the kernel was used
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[ids_out], s[ids_in])
        others = [i for i in range(96) if i not in ids_out]
        assert torch.count_nonzero(d[others]) == 0


@pytest.mark.parametrize("pair", [("cuda:0", "cuda:1", True), ("cuda:1", "cuda:0", True),
                                  ("cuda:0", "cuda:1", False), ("cuda:1", "cuda:1", True)])
def test_local_copies_between_regions_of_one_node(pair: tuple[str, str, bool]) -> None:
    """The local transport's block copies (transport.local.copy_gpu_blocks_queued): across two GPUs
    pipelined over many small chunks (two staging buffers a side, some chunks straight
    from or into a run of blocks) — gathered by the source GPU into the destination's
    staging (NVLink stores), or (False) gathered, copied and scattered — and within one
    GPU in one launch."""
    from kvd.transport import local

    src_dev, dst_dev, peer = pair
    if gpu_count() < 2:  # the copy within one GPU still runs, on the only one
        if src_dev != dst_dev:
            pytest.skip("needs two GPUs")
        src_dev = dst_dev = "cuda:0"
    if src_dev != dst_dev and peer:
        from kvd.transport import gpu_copy

        assert gpu_copy.peer_stores(torch.device(src_dev), torch.device(dst_dev))
    gen = torch.Generator(device=src_dev).manual_seed(5)
    src = [torch.randint(-(2**15), 2**15 - 1, (64, 16, 8, 64), generator=gen, device=src_dev,
                         dtype=torch.int16),  # 16 KiB blocks
           torch.randint(0, 255, (64, 24 * 1024), generator=gen, device=src_dev,
                         dtype=torch.uint8)]  # 24 KiB blocks
    dst = [torch.zeros_like(t, device=dst_dev) for t in src]
    src_ids = list(range(8, 20)) + torch.randperm(64, generator=torch.Generator().manual_seed(
        3))[:30].tolist()
    src_ids = list(dict.fromkeys(src_ids))[:36]
    dst_ids = list(range(40, 52)) + torch.randperm(40, generator=torch.Generator().manual_seed(
        4))[: len(src_ids) - 12].tolist()
    torch.cuda.synchronize()
    old = local.CROSS_GPU_CHUNK_BYTES
    try:
        local.CROSS_GPU_CHUNK_BYTES = 64 * 1024  # many chunks; the first ones are one run
        if peer:  # as the daemon's loop queues it
            queued = local.copy_gpu_blocks_queued(src, torch.tensor(src_ids), dst,
                                                  torch.tensor(dst_ids))
            assert queued is not None
            nbytes, events = queued
            for event in events:
                event.synchronize()
        else:
            nbytes = local.copy_across_gpus(src, np.array(src_ids), dst, np.array(dst_ids),
                                            peer_stores=False)
    finally:
        local.CROSS_GPU_CHUNK_BYTES = old
    torch.cuda.synchronize()
    assert nbytes == len(src_ids) * (16 + 24) * 1024
    others = [i for i in range(64) if i not in dst_ids]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[dst_ids].cpu(), s[src_ids].cpu())
        assert torch.count_nonzero(d[others]) == 0


def test_reads_wait_for_the_clients_queued_writes() -> None:
    """No synchronize before put: the client library records an interprocess CUDA event,
    and the daemons' reads (a local copy, and an NCCL send) wait for it. The writes sit
    behind ~100 ms of GPU work, so reading early would see the previous values."""
    with two_nodes() as (a, b), kvd.KvdClient(a.sock, timeout_s=60) as ca, \
            kvd.KvdClient(b.sock, timeout_s=60) as cb:
        src = torch.zeros((16, 2**20), dtype=torch.uint8, device=DEV_A)
        here = torch.zeros_like(src)
        there = torch.zeros_like(src, device=DEV_B)
        torch.cuda.synchronize()
        r_src, r_here, r_there = (ca.register("src", [src]), ca.register("here", [here]),
                                  cb.register("there", [there]))
        blocks = list(range(16))
        for trial in range(1, 4):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the write
            src.fill_(trial)
            ca.put(f"local{trial}", r_src, blocks, ttl_s=60).wait(60)
            ca.get(f"local{trial}", r_here, blocks, timeout_s=60)
            torch.cuda._sleep(200_000_000)
            src.fill_(trial + 10)
            ca.put(f"remote{trial}", r_src, blocks, to=b.address).wait(60)
            cb.get(f"remote{trial}", r_there, blocks, timeout_s=60)
            torch.cuda.synchronize()
            assert bool((here == trial).all()), f"local read before the write ({trial})"
            assert bool((there == trial + 10).all()), f"NCCL read before the write ({trial})"
