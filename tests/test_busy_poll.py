"""busy_poll: the loop spins for a window after each message, not while a thread works,
and never when it is off; daemons that spin still move every byte (over TCP, whose
threads need the GIL the spinning loop holds)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator

import pytest
import torch
import uvloop

from kvd import KvdClient, shared_zeros
from kvd.daemon.busy_poll import BusyPoll
from tests.conftest import wait_until
from tests.test_peers import BLOCK, Node, Nodes, random_region


async def no_turns_for(busy: BusyPoll, seconds: float) -> None:
    turns = busy.turns
    await asyncio.sleep(seconds)
    assert busy.turns == turns


def test_spins_for_the_window_after_a_touch_then_sleeps() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        long = BusyPoll(loop, 5.0)  # long enough for a loaded machine
        long.touch()
        assert long.spinning
        await asyncio.sleep(0.01)
        assert long.spinning and long.turns > 0  # the loop kept turning meanwhile
        long.thread_work(concurrent.futures.Future())  # stops it at its next turn

        busy = BusyPoll(loop, 0.05)
        busy.touch()
        await asyncio.sleep(0.3)
        assert not busy.spinning and busy.turns > 0
        await no_turns_for(busy, 0.05)  # idle after the window
        busy.touch()
        assert busy.spinning

    uvloop.run(main())


def test_work_handed_to_a_thread_pauses_the_spinning() -> None:
    async def main() -> None:
        busy = BusyPoll(asyncio.get_running_loop(), 1.0)
        work: concurrent.futures.Future[int] = concurrent.futures.Future()
        busy.thread_work(work)
        busy.touch()
        assert not busy.spinning  # the thread would wait for the GIL at every step
        thread = threading.Thread(target=work.set_result, args=(1,))
        thread.start()
        thread.join()
        busy.touch()
        assert busy.spinning
        # work handed over while spinning stops it at the next turn
        more: concurrent.futures.Future[int] = concurrent.futures.Future()
        busy.thread_work(more)
        await asyncio.sleep(0.01)
        assert not busy.spinning
        await no_turns_for(busy, 0.01)
        more.cancel()  # cancelled work counts as finished too
        busy.touch()
        assert busy.spinning

    uvloop.run(main())


def test_off_never_spins() -> None:
    async def main() -> None:
        busy = BusyPoll(asyncio.get_running_loop(), 0.0)
        busy.touch()
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        busy.thread_work(done)
        await asyncio.sleep(0.01)
        assert not busy.enabled and not busy.spinning and busy.turns == 0

    uvloop.run(main())


@pytest.fixture
def spinning_pair(sock_dir: str) -> Iterator[list[Node]]:
    nodes = Nodes(sock_dir, env={"KVD_DEV": "busy_poll=on,busy_poll_window_s=0.05"})
    yield nodes(2)  # (if one is not ready in time, it stops both)
    nodes.stop_all(codes=(0,))


def test_spinning_daemons_move_every_byte_over_tcp(spinning_pair: list[Node]) -> None:
    a, b = spinning_pair
    blocks = 64  # 4 MiB: the data connection's threads carry it in several chunks
    src = random_region(blocks, 7)
    r_src = a.client.register("kv", [src])
    with KvdClient(b.proc.socket_path) as waiter:
        dst = shared_zeros((blocks, BLOCK), torch.uint8)
        r_dst = waiter.register("kv", [dst])
        for round_ in range(5):
            ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(round_))
            key = f"spin-{round_}"
            result: dict[str, int] = {}
            t = threading.Thread(target=lambda k=key, out=result: out.setdefault(
                "n", waiter.get(k, r_dst, list(range(blocks)), timeout_s=10)))
            t.start()
            wait_until(lambda: b.client.stats()["waiting_gets"] == 1)
            assert a.client.put(key, r_src, ids.tolist(), to=b.address).wait(10) \
                == blocks * BLOCK
            t.join(10)
            assert result["n"] == blocks * BLOCK
            assert torch.equal(dst, src[ids])
            dst.zero_()
    for node in (a, b):
        spin = node.client.stats()["busy_poll"]
        assert spin["window_s"] == 0.05 and spin["turns"] > 0
        assert spin["threads_working"] == 0  # every send / receive thread's work came back


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is on where there is a GPU")
def test_auto_is_off_without_a_gpu(sock_dir: str) -> None:
    node = Node(sock_dir, "cpu-only")
    try:
        node.client.stats()
        assert node.client.stats()["busy_poll"] == {"window_s": 0.0, "turns": 0,
                                                    "threads_working": 0}
    finally:
        assert node.stop() == 0
