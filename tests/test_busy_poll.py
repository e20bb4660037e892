"""Busy polling: the loop spins for a window after each message, not while a thread works,
and never when it is off (where the daemon sees no GPU); daemons that spin still move
every byte (over TCP, whose threads need the GIL the spinning loop holds)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Iterator

import pytest
import torch
import uvloop

from kvd import KvdClient, shared_zeros
from kvd.daemon import service
from kvd.daemon.busy_poll import BusyPoll
from tests.conftest import ThreadDaemon, make_config, wait_until
from tests.test_peers import BLOCK, Node, random_region


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
def spinning_pair(sock_dir: str, monkeypatch: pytest.MonkeyPatch
                  ) -> Iterator[list[ThreadDaemon]]:
    """Two daemons in this process that spin 50 ms after each message, as where a daemon
    sees a GPU (the daemon asks ``service.busy_poll_window_s`` at start; this machine may
    have none). Their loops, the TCP channels' threads and the test share one GIL."""
    monkeypatch.setattr(service, "busy_poll_window_s", lambda sees_gpu: 0.05)
    daemons: list[ThreadDaemon] = []
    try:
        for name in ("a", "b"):
            path = os.path.join(sock_dir, name)
            os.makedirs(path)
            daemons.append(ThreadDaemon(make_config(path, node_id=name)).start())
        yield daemons
    finally:
        for d in reversed(daemons):
            d.stop()


def test_spinning_daemons_move_every_byte_over_tcp(spinning_pair: list[ThreadDaemon]
                                                   ) -> None:
    a, b = spinning_pair
    with KvdClient(a.socket_path) as ca, KvdClient(b.socket_path) as cb:
        _move_every_byte(ca, cb, cb.stats()["peer"]["address"], b.socket_path)
        for client in (ca, cb):
            spin = client.stats()["busy_poll"]
            assert spin["window_s"] == 0.05 and spin["turns"] > 0
            assert spin["threads_working"] == 0  # every send / receive thread's work came back


def _move_every_byte(ca: KvdClient, cb: KvdClient, b_address: str, b_sock: str) -> None:
    blocks = 64  # 4 MiB: the data connection's threads carry it in several chunks
    src = random_region(blocks, 7)
    r_src = ca.register("kv", [src])
    with KvdClient(b_sock) as waiter:
        dst = shared_zeros((blocks, BLOCK), torch.uint8)
        r_dst = waiter.register("kv", [dst])
        for round_ in range(5):
            ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(round_))
            key = f"spin-{round_}"
            result: dict[str, int] = {}
            t = threading.Thread(target=lambda k=key, out=result: out.setdefault(
                "n", waiter.get(k, r_dst, list(range(blocks)), timeout_s=10)))
            t.start()
            wait_until(lambda: cb.stats()["waiting_gets"] == 1)
            assert ca.put(key, r_src, ids.tolist(), to=b_address).wait(10) == blocks * BLOCK
            t.join(10)
            assert result["n"] == blocks * BLOCK
            assert torch.equal(dst, src[ids])
            dst.zero_()


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is on where there is a GPU")
def test_auto_is_off_without_a_gpu(sock_dir: str) -> None:
    node = Node(sock_dir, "cpu-only")
    try:
        node.client.stats()
        assert node.client.stats()["busy_poll"] == {"window_s": 0.0, "turns": 0,
                                                    "threads_working": 0}
    finally:
        assert node.stop() == 0
