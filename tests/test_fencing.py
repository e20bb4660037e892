"""Fencing: once a call that moves bytes in a client's blocks has ended — its task
cancelled, its ``Transfer`` cancelled, its timeout run out, an exception in the caller, its
client closed — no byte lands in those blocks (nor is read from them) any more.

Two `kvd serve` daemons linked over loopback TCP: ``a`` holds the source, ``b`` the
destination. A transfer is 128 MiB, tens of milliseconds on loopback: each call is ended
once its first bytes have landed, so the rest is still on the wire. Right after the call
returns the destination is copied; it must not change within the next half second, and
the daemons then serve another transfer byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import kvd
import kvd.client.base
from kvd import AsyncKvdClient, KvdClient, shared_empty, shared_zeros
from tests.conftest import ProcessDaemon, wait_until

MiB = 2**20
BLOCK = 2 * MiB
BLOCKS = 64  # 128 MiB a transfer
ALL = range(BLOCKS)
SETTLE_S = 0.5  # how long the destination must stay as the call left it
OVERWRITE = 255  # what a source holds once the call that read it has returned
FROZEN_S = 0.4  # how long a sender is stopped half way (its peer's grace is 3 s)
SAMPLES = [*range(0, BLOCK, 64 * 1024), BLOCK - 1]  # bytes of each block checked first


def pattern(blocks: int) -> torch.Tensor:
    """Block i holds (i % 251) + 1: never 0 (unwritten) nor OVERWRITE."""
    t = shared_empty((blocks, BLOCK), torch.uint8)
    t.copy_((torch.arange(blocks) % 251 + 1).to(torch.uint8)[:, None].expand(blocks, BLOCK))
    return t


@contextlib.contextmanager
def two_daemons(root: str, pool: str) -> Iterator[tuple[ProcessDaemon, ProcessDaemon]]:
    """`kvd serve` as ``a`` and ``b``; both stopped on the way out, whatever happened."""
    daemons: list[ProcessDaemon] = []
    try:
        for name in ("a", "b"):
            path = os.path.join(root, name)
            os.makedirs(path)
            daemons.append(ProcessDaemon(path, "--node-id", name, "--pool-size-bytes", pool))
        for d in daemons:
            d.wait_ready()
        yield daemons[0], daemons[1]
    finally:
        codes = [d.stop() for d in daemons]
    assert codes == [0, 0], "\n".join(d.log() for d in daemons)


@dataclass
class Pair:
    a: ProcessDaemon
    b: ProcessDaemon
    ca: KvdClient  # the test's own clients, for feeding, stats and round trips
    cb: KvdClient
    a_address: str
    b_address: str
    src: torch.Tensor  # BLOCKS blocks on a, published as "pub"
    r_src: kvd.Region
    small_src: torch.Tensor
    r_small_src: kvd.Region
    small_dst: torch.Tensor
    r_small_dst: kvd.Region
    rounds: int = 0

    def put(self, key: str) -> kvd.Transfer:
        """The whole source, from a to b under ``key``."""
        return self.ca.put(key, self.r_src, ALL, to=self.b_address, timeout_s=30)

    def settle(self, key: str, transfer: kvd.Transfer | None = None) -> None:
        """The case's transfers over, nothing of it left in b's pool."""
        if transfer is not None:
            with contextlib.suppress(kvd.KvdError):
                transfer.wait(30)
        for c in (self.ca, self.cb):
            wait_until(lambda c=c: not any(c.stats()["transfers"][k]
                                           for k in ("in_flight_in", "in_flight_out")))
        with contextlib.suppress(kvd.UnknownKey):
            self.cb.delete(key)

    def still_serves(self) -> None:
        """A put from a and a get on b after it, byte for byte."""
        self.rounds += 1
        gen = torch.Generator().manual_seed(self.rounds)
        self.small_src.copy_(torch.randint(0, 256, self.small_src.shape, dtype=torch.uint8,
                                           generator=gen))
        key = f"round-{self.rounds}"
        sent = self.ca.put(key, self.r_small_src, [0, 1, 2, 3], to=self.b_address).wait(10)
        assert self.cb.get(key, self.r_small_dst, [3, 2, 1, 0], timeout_s=10) == sent
        assert torch.equal(self.small_dst.flip(0), self.small_src)
        assert self.cb.stats()["pool"]["used_bytes"] == 0


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    root = tempfile.mkdtemp(prefix="kvd-f-", dir="/tmp")
    try:
        with two_daemons(root, "256MiB") as (a, b), KvdClient(a.socket_path) as ca, \
                KvdClient(b.socket_path) as cb:
            src = pattern(BLOCKS)
            r_src = ca.register("src", [src])
            ca.publish("pub", r_src, ALL)
            small_src = shared_zeros((4, 64 * 1024), torch.uint8)
            small_dst = shared_zeros((4, 64 * 1024), torch.uint8)
            yield Pair(a, b, ca, cb, ca.stats()["peer"]["address"],
                       cb.stats()["peer"]["address"], src, r_src, small_src,
                       ca.register("small", [small_src]), small_dst,
                       cb.register("small", [small_dst]))
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def until_waiting(pair: Pair) -> None:
    """b has a get waiting."""
    deadline = time.monotonic() + 10
    while pair.cb.stats()["waiting_gets"] < 1:
        assert time.monotonic() < deadline, "the get never waited"
        await asyncio.sleep(0.002)


def landing(dst: torch.Tensor, timeout_s: float = 10) -> None:
    """Bytes of the transfer have begun to land in ``dst`` (block 0 goes first)."""
    deadline = time.monotonic() + timeout_s
    while not bool(dst[0].any()):
        assert time.monotonic() < deadline, "no bytes landed"
        time.sleep(0.0005)


async def until_landing(dst: torch.Tensor) -> None:
    deadline = time.monotonic() + 10
    while not bool(dst[0].any()):
        assert time.monotonic() < deadline, "no bytes landed"
        await asyncio.sleep(0.0005)


class Snapshot:
    """Taken right after a call returned: ``unchanged`` then says that its blocks stayed as
    they were. A few bytes of each block are copied first, in microseconds, so that bytes
    landing just after the return are seen; then the whole of it."""

    def __init__(self, dst: torch.Tensor) -> None:
        self.dst = dst
        self.marks = dst[:, SAMPLES].clone()
        self.full = dst.clone()

    def unchanged(self) -> int:
        """Asserts; returns how many blocks had landed. (It blocks the test's loop for
        SETTLE_S: nothing there has to run meanwhile.)"""
        time.sleep(SETTLE_S)
        changed = ((self.dst[:, SAMPLES] != self.marks).any(dim=1)
                   | (self.dst != self.full).any(dim=1))
        landed = int(self.marks.any(dim=1).sum())
        assert not bool(changed.any()), (
            f"{int(changed.sum())} of {BLOCKS} blocks changed after the call returned "
            f"({landed} had begun to land by then)")
        return landed


def lands_nothing_after(dst: torch.Tensor) -> int:
    return Snapshot(dst).unchanged()


@contextlib.contextmanager
def frozen(daemon: ProcessDaemon, for_s: float, dst: torch.Tensor) -> Iterator[None]:
    """``daemon``, sending into ``dst``, stopped (SIGSTOP) for ``for_s``, or until the body
    is done if that is later: the transfer stalls half way. It is stopped again until the
    receiver has stalled in the middle of a chunk (4 MiB, two blocks here: part of the
    sampled bytes of a chunk landed), where a stop cannot wait for a chunk boundary."""
    for _ in range(10):
        daemon.signal(signal.SIGSTOP)
        time.sleep(0.03)  # what was on its way lands
        landed = int((dst[:, SAMPLES] != 0).sum())
        if landed % (2 * len(SAMPLES)) or landed == dst.shape[0] * len(SAMPLES):
            break
        daemon.signal(signal.SIGCONT)
        time.sleep(0.002)
    timer = threading.Timer(for_s, daemon.signal, (signal.SIGCONT,))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        daemon.signal(signal.SIGCONT)


class Interrupted(Exception):
    """What a signal handler raises in the caller of a blocking call (a Ctrl-C)."""


# ------------------------------------------------------------------ get


@pytest.mark.parametrize("end", ["task_cancel", "timeout", "interrupt", "transfer_cancel",
                                 "async_transfer_cancel", "close"])
async def test_a_get_ended_mid_transfer_lands_nothing_after(
        pair: Pair, end: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A get waits on b; a's put of 128 MiB goes straight into its blocks, and the get
    ends while it does: async (task cancel, the client's timeout, AsyncTransfer.cancel of
    a start_get, aclose) and sync (KeyboardInterrupt-like exception, Transfer.cancel of a
    start_get)."""
    key = f"get-{end}"
    dst = shared_zeros((BLOCKS, BLOCK), torch.uint8)
    feed: kvd.Transfer | None = None
    if end == "interrupt":
        feed = _get_interrupted(pair, key, dst)
    elif end == "async_transfer_cancel":
        async with AsyncKvdClient(pair.b.socket_path) as ac:
            started = await ac.start_get(key, await ac.register("dst", [dst]), ALL,
                                         timeout_s=30)
            await until_waiting(pair)
            feed = pair.put(key)
            await until_landing(dst)
            await started.cancel()
            lands_nothing_after(dst)
            assert started.done()
            with contextlib.suppress(kvd.Cancelled):  # (or it had finished)
                assert await started.wait(5) == BLOCKS * BLOCK
    elif end == "transfer_cancel":
        with KvdClient(pair.b.socket_path) as c:
            get = c.start_get(key, c.register("dst", [dst]), ALL, timeout_s=30)
            await until_waiting(pair)
            feed = pair.put(key)
            await until_landing(dst)
            get.cancel()
            lands_nothing_after(dst)
            with contextlib.suppress(kvd.Cancelled):  # (or it had finished)
                assert get.wait(5) == BLOCKS * BLOCK
    elif end == "timeout":
        feed = await _get_timed_out(pair, key, dst, monkeypatch)
    else:
        ac = AsyncKvdClient(pair.b.socket_path)
        await ac.connect()
        try:
            task = asyncio.create_task(ac.get(key, await ac.register("dst", [dst]), ALL,
                                              timeout_s=30))
            await until_waiting(pair)
            feed = pair.put(key)
            await until_landing(dst)
            if end == "task_cancel":
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            else:
                await ac.aclose()
            lands_nothing_after(dst)
            if end == "close":
                with pytest.raises(kvd.DaemonUnavailable):
                    await task
        finally:
            await ac.aclose()
    pair.settle(key, feed)
    pair.still_serves()


def _get_interrupted(pair: Pair, key: str, dst: torch.Tensor) -> kvd.Transfer | None:
    """A blocking get, interrupted by an exception its signal handler raises once the
    bytes land (as Ctrl-C raises KeyboardInterrupt)."""
    main = threading.get_ident()
    fed: list[kvd.Transfer] = []
    errors: list[BaseException] = []

    def feeder() -> None:
        try:
            wait_until(lambda: pair.cb.stats()["waiting_gets"] >= 1, interval_s=0.002)
            fed.append(pair.put(key))
            landing(dst)
            signal.pthread_kill(main, signal.SIGUSR1)
        except BaseException as exc:  # the test fails on it, below
            errors.append(exc)

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    thread = threading.Thread(target=feeder)
    try:
        with KvdClient(pair.b.socket_path) as c:
            region = c.register("dst", [dst])
            thread.start()
            with pytest.raises(Interrupted):
                c.get(key, region, ALL, timeout_s=30)
            lands_nothing_after(dst)
    finally:
        thread.join(30)
        signal.signal(signal.SIGUSR1, previous)
    assert not errors, errors
    return fed[0] if fed else None


async def _get_timed_out(pair: Pair, key: str, dst: torch.Tensor,
                         monkeypatch: pytest.MonkeyPatch) -> kvd.Transfer:
    """The client's timeout runs out while the bytes come, the sender frozen half way.
    (Without a reply margin the client gives up as the daemon's own timeout fires; the
    daemon then waits for the bytes on their way, and answers after them.)"""
    monkeypatch.setattr(kvd.client.base, "REPLY_MARGIN_S", 0.0)
    timeout_s = 1.0
    async with AsyncKvdClient(pair.b.socket_path) as c:
        region = await c.register("dst", [dst])
        started = time.monotonic()
        task = asyncio.create_task(c.get(key, region, ALL, timeout_s=timeout_s))
        await until_waiting(pair)
        feed = pair.put(key)
        await until_landing(dst)
        with frozen(pair.a, started + timeout_s + 0.3 - time.monotonic(), dst):
            with contextlib.suppress(kvd.KvdError):  # timed out (or done, if that came first)
                await task
            snapshot = Snapshot(dst)
        snapshot.unchanged()
    return feed


async def test_a_cancel_the_daemon_cannot_confirm_closes_the_client(
        pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    """The daemon is frozen: the cancel of a get gets no answer. Past the client's timeout
    the cancelled call returns all the same, the client drops its connection (so that the
    daemon, once it runs, stops the session's requests before it lets go of the regions)
    and says why, at once and on every later call; the daemon then serves on."""
    dst = shared_zeros((4, BLOCK), torch.uint8)
    async with AsyncKvdClient(pair.b.socket_path, timeout_s=1.0) as c:
        task = asyncio.create_task(c.get("never", await c.register("dst", [dst]),
                                         range(4), timeout_s=20))
        await until_waiting(pair)
        pair.b.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert 0.9 < time.monotonic() - started < 5
            with pytest.raises(kvd.DaemonUnavailable, match="did not confirm"):
                await c.ping()
        finally:
            pair.b.signal(signal.SIGCONT)
    assert "did not confirm that request" in caplog.text
    wait_until(lambda: pair.cb.stats()["clients"] == 1)  # only the test's own
    pair.still_serves()


# ------------------------------------------------------------------ pull


@pytest.mark.parametrize("end", ["task_cancel", "async_transfer_cancel", "transfer_cancel",
                                 "close"])
async def test_a_pull_ended_mid_transfer_lands_nothing_after(pair: Pair, end: str) -> None:
    """b pulls 128 MiB that a publishes, and the pull ends while a is frozen half way
    through sending them (b is in the middle of a chunk): async task cancel, async
    AsyncTransfer.cancel of a start_pull, sync Transfer.cancel of a start_pull, sync close
    of the client."""
    dst = shared_zeros((BLOCKS, BLOCK), torch.uint8)
    if end == "async_transfer_cancel":
        async with AsyncKvdClient(pair.b.socket_path) as ac:
            started = await ac.start_pull("pub", pair.a_address,
                                          await ac.register("dst", [dst]), ALL, timeout_s=30)
            await until_landing(dst)
            with frozen(pair.a, FROZEN_S, dst):
                await started.cancel()
                snapshot = Snapshot(dst)
            snapshot.unchanged()
            assert started.done()
            with contextlib.suppress(kvd.Cancelled):  # (or it had finished)
                assert await started.wait(5) == BLOCKS * BLOCK
    elif end == "task_cancel":
        async with AsyncKvdClient(pair.b.socket_path) as ac:
            task = asyncio.create_task(ac.pull("pub", pair.a_address,
                                               await ac.register("dst", [dst]), ALL,
                                               timeout_s=30))
            await until_landing(dst)
            with frozen(pair.a, FROZEN_S, dst):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                snapshot = Snapshot(dst)
            snapshot.unchanged()
    else:
        c = KvdClient(pair.b.socket_path)
        c.connect()
        try:
            pull = c.start_pull("pub", pair.a_address, c.register("dst", [dst]), ALL,
                                timeout_s=30)
            await until_landing(dst)
            with frozen(pair.a, FROZEN_S, dst):
                if end == "transfer_cancel":
                    pull.cancel()
                else:
                    c.close()
                snapshot = Snapshot(dst)
            snapshot.unchanged()
        finally:
            c.close()
    pair.settle("pub")  # (a published key is not b's to delete: nothing is)
    pair.still_serves()


# ------------------------------------------------------------------ lend


@pytest.mark.parametrize("end", ["transfer_cancel", "close"])
async def test_a_lend_ended_mid_transfer_reads_nothing_after(pair: Pair, end: str) -> None:
    """a lends 128 MiB, b pulls them, and the lend ends (async Transfer.cancel, sync
    close of the lender) while they go. Right after it returns the lender overwrites its
    blocks: none of that may reach b."""
    key = f"lend-{end}"
    lent = pattern(BLOCKS)
    dst = shared_zeros((BLOCKS, BLOCK), torch.uint8)
    r_dst = pair.cb.register(key, [dst])
    try:
        if end == "transfer_cancel":
            async with AsyncKvdClient(pair.a.socket_path) as lender:
                loan = await lender.lend(key, await lender.register("lent", [lent]), ALL,
                                         ttl_s=30)
                pull = pair.cb.start_pull(key, pair.a_address, r_dst, ALL, timeout_s=30,
                                          wait_for_key_s=10)
                await until_landing(dst)
                await loan.cancel()
                lent.fill_(OVERWRITE)
        else:
            with KvdClient(pair.a.socket_path) as sync_lender:
                sync_lender.lend(key, sync_lender.register("lent", [lent]), ALL, ttl_s=30)
                pull = pair.cb.start_pull(key, pair.a_address, r_dst, ALL, timeout_s=30,
                                          wait_for_key_s=10)
                await until_landing(dst)
            lent.fill_(OVERWRITE)  # closed: the daemon reads the blocks no more
        with contextlib.suppress(kvd.KvdError):  # the pull fails, or it had all it needed
            pull.wait(30)
        overwritten = int((dst == OVERWRITE).any(dim=1).sum())
        assert overwritten == 0, f"{overwritten} blocks read after the lend ended"
    finally:
        pair.cb.unregister(r_dst)
    pair.settle(key)
    pair.still_serves()


# ------------------------------------------------------------------ put


def test_a_cancelled_put_is_delivered_only_if_it_reports_done(sock_dir: str) -> None:
    """Puts of 1 MiB to a peer, each cancelled at a random moment around its end: one that
    reports ``Cancelled`` left nothing at the receiver, one that reports its bytes left
    them all there, and none read its source after the cancel returned. Cancelled and
    refused puts leave no "Future exception was never retrieved" in either daemon."""
    rng = random.Random(25)
    with two_daemons(sock_dir, "64MiB") as (a, b), KvdClient(a.socket_path) as ca, \
            KvdClient(b.socket_path) as cb:
        to = cb.stats()["peer"]["address"]
        src = shared_zeros((4, 256 * 1024), torch.uint8)
        dst = shared_zeros((4, 256 * 1024), torch.uint8)
        r_src, r_dst = ca.register("src", [src]), cb.register("dst", [dst])
        took = []
        for i in range(5):  # how long one takes, once linked
            started = time.monotonic()
            ca.put(f"warm-{i}", r_src, range(4), to=to).wait(10)
            took.append(time.monotonic() - started)
            cb.get(f"warm-{i}", r_dst, range(4), timeout_s=5)
        typical_s = sorted(took)[2]
        seen: dict[tuple[str, bool], int] = {}
        for i in range(40):
            value = i % 200 + 1
            src.fill_(value)
            put = ca.put(f"p{i}", r_src, range(4), to=to, timeout_s=10)
            time.sleep(rng.uniform(0.3, 1.1) * typical_s)
            put.cancel()
            src.fill_(OVERWRITE)
            try:
                assert put.wait(10) == src.numel()
                reported = "done"
            except kvd.Cancelled:
                reported = "cancelled"
            wait_until(lambda: cb.stats()["transfers"]["in_flight_in"] == 0)
            try:
                cb.get(f"p{i}", r_dst, range(4), timeout_s=0)
                stored = True
                assert bool((dst == value).all()), f"put {i}: not its bytes"
            except kvd.UnknownKey:
                stored = False
            seen[(reported, stored)] = seen.get((reported, stored), 0) + 1
        assert set(seen) <= {("done", True), ("cancelled", False)}, seen
        ca.put("there", r_src, range(4), to=to).wait(10)
        with pytest.raises(kvd.BadRequest, match="already exists"):  # refused
            ca.put("there", r_src, range(4), to=to).wait(10)
        cb.delete("there")
        assert cb.stats()["pool"]["used_bytes"] == 0
    for d in (a, b):
        text = d.log()
        at = text.find("never retrieved")
        assert at < 0, text[max(0, at - 200):at + 1500]
