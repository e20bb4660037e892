"""One blocking client shared between threads: each call waits only for its own reply.

A thread in a long ``get`` must hold up no other thread's call on the same client (a
ping, an offload, a get of another key, the put that the long get is waiting for), and
many threads calling at once each get their own bytes, promptly. Closing the client, the
daemon's death and a Ctrl-C in the main thread end the waits they should, at once, and
no other."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

import kvd
from kvd import KvdClient, shared_empty, shared_zeros
from tests.conftest import ProcessDaemon, wait_until

T = TypeVar("T")

BLOCK = 8192
# Each call here moves at most a few blocks on an idle daemon (milliseconds); a call that
# waits behind another thread's 20 s get takes 20 s. The bound leaves room for a loaded
# machine.
PROMPT_S = 3.0
LONG_GET_S = 20.0


def fill_random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    t = shared_empty(shape, torch.uint8)
    t.copy_(torch.randint(0, 256, shape, dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed)))
    return t


class Timed:
    """Every call's time, by name, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.times: list[tuple[str, float]] = []

    def __call__(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        started = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self.times.append((name, time.monotonic() - started))

    def slowest(self) -> tuple[str, float]:
        with self._lock:
            return max(self.times, key=lambda t: t[1])


def test_a_waiting_get_holds_up_no_other_thread(process_daemon: ProcessDaemon) -> None:
    """Thread A waits in a get for a key nobody has put. On the same client meanwhile:
    a ping, an offload and a get of another key (its bytes checked), a Transfer.done and
    the put A waits for: each returns at once, and A's get then has the put's bytes."""
    src, dst = fill_random((16, BLOCK), 1), shared_zeros((16, BLOCK), torch.uint8)
    results: list[Any] = []
    c = KvdClient(process_daemon.socket_path, timeout_s=10)
    c.connect()
    long_get = threading.Thread(target=lambda: None)
    try:
        with KvdClient(process_daemon.socket_path) as watcher:
            r_src, r_dst = c.register("src", [src]), c.register("dst", [dst])

            def wait_for_key() -> None:
                started = time.monotonic()
                try:
                    results.append(c.get("late", r_dst, [0, 1], timeout_s=LONG_GET_S))
                except BaseException as exc:  # the test fails on it, below
                    results.append(exc)
                results.append(time.monotonic() - started)

            long_get = threading.Thread(target=wait_for_key, name="long-get")
            long_get.start()
            wait_until(lambda: watcher.stats()["waiting_gets"] >= 1)
            timed = Timed()

            assert timed("ping", c.ping) < PROMPT_S
            assert timed("offload", c.offload, "other", r_src, [2, 3, 4]) == 3 * BLOCK
            assert timed("get", c.get, "other", r_dst, [5, 6, 7], timeout_s=5) == 3 * BLOCK
            assert torch.equal(dst[5:8], src[2:5])
            pending = timed("start_get", c.start_get, "pending", r_dst, [9], timeout_s=5)
            assert not timed("done", pending.done)
            put = timed("put", c.put, "late", r_src, [8, 9])
            assert timed("put.wait", put.wait, 5) == 2 * BLOCK
            slowest = timed.slowest()
            assert slowest[1] < PROMPT_S, f"{slowest[0]} waited {slowest[1]:.1f}s"

            long_get.join(PROMPT_S)
            assert not long_get.is_alive(), "the get did not take the put"
            assert results[0] == 2 * BLOCK, results
            assert torch.equal(dst[0:2], src[8:10])
            assert not dst[2:5].any() and not dst[8:].any()  # nothing else landed
            pending.cancel()
    finally:
        c.close()  # (ends a get still waiting)
        long_get.join(30)
    assert not long_get.is_alive()


def test_many_threads_calling_at_once(process_daemon: ProcessDaemon) -> None:
    """Eight threads on one client, five rounds each. In a pair, one thread gets a key
    the other puts after its own calls (ping, stats, an offload and a get of its own key,
    a start_get polled with done and fed by a put): every call is prompt and every byte
    lands where it was meant to."""
    threads_n, rounds = 8, 5
    per_thread = 8  # dst blocks of each thread
    src = fill_random((64, BLOCK), 2)
    dst = shared_zeros((threads_n * per_thread, BLOCK), torch.uint8)
    errors: list[BaseException] = []
    timed = Timed()

    def src_blocks(i: int, r: int) -> list[int]:
        return [(i * 7 + r * 3 + k) % 64 for k in range(3)]

    with KvdClient(process_daemon.socket_path, timeout_s=10) as c:
        r_src, r_dst = c.register("src", [src]), c.register("dst", [dst])

        def getter(i: int) -> None:  # gets what thread i + 1 puts
            mine = list(range(i * per_thread, i * per_thread + 3))
            for r in range(rounds):
                n = timed("pair get", c.get, f"pair-{i}-{r}", r_dst, mine,
                          timeout_s=LONG_GET_S)
                assert n == 3 * BLOCK
                assert torch.equal(dst[mine], src[src_blocks(i + 1, r)]), (i, r)

        def putter(i: int) -> None:
            mine = list(range(i * per_thread, i * per_thread + 3))
            polled = [i * per_thread + 5]
            for r in range(rounds):
                timed("ping", c.ping)
                timed("stats", c.stats)
                key = f"own-{i}-{r}"
                assert timed("offload", c.offload, key, r_src, src_blocks(i, r)) == 3 * BLOCK
                assert timed("get", c.get, key, r_dst, mine, timeout_s=5) == 3 * BLOCK
                assert torch.equal(dst[mine], src[src_blocks(i, r)]), (i, r)
                fed = timed("start_get", c.start_get, f"fed-{i}-{r}", r_dst, polled,
                            timeout_s=5)
                feed = timed("put", c.put, f"fed-{i}-{r}", r_src, [r], timeout_s=5)
                deadline = time.monotonic() + PROMPT_S
                while not timed("done", fed.done) and time.monotonic() < deadline:
                    time.sleep(0.002)
                assert fed.wait(0) == BLOCK and feed.wait(5) == BLOCK
                assert torch.equal(dst[polled], src[[r]]), (i, r)
                pair = timed("pair put", c.put, f"pair-{i - 1}-{r}", r_src, src_blocks(i, r))
                assert timed("pair put.wait", pair.wait, 5) == 3 * BLOCK

        def run(work: Callable[[int], None], i: int) -> None:
            try:
                work(i)
            except BaseException as exc:  # the test fails on it, below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(putter if i % 2 else getter, i),
                                    name=f"caller-{i}") for i in range(threads_n)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(LONG_GET_S * rounds + 10)
        finally:
            if any(t.is_alive() for t in threads):
                c.close()  # ends the calls still waiting
            for t in threads:
                t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert len(timed.times) >= threads_n // 2 * rounds * 10  # (every call was made)
        slowest = timed.slowest()
        assert slowest[1] < PROMPT_S, f"{slowest[0]} waited {slowest[1]:.1f}s"


def _waiting_gets(c: KvdClient, region: Any, n: int) -> tuple[list[threading.Thread],
                                                              list[tuple[Any, float]]]:
    """``n`` threads, each in a get on ``c`` of a key nobody puts (into block i); each
    records what its get raised or returned, and when (time.monotonic())."""
    ended: list[tuple[Any, float]] = []

    def wait(i: int) -> None:
        try:
            ended.append((c.get(f"never-{i}", region, [i], timeout_s=LONG_GET_S),
                          time.monotonic()))
        except BaseException as exc:  # checked by the test
            ended.append((exc, time.monotonic()))

    threads = [threading.Thread(target=wait, args=(i,), name=f"get-{i}") for i in range(n)]
    for t in threads:
        t.start()
    return threads, ended


def test_close_ends_the_calls_of_other_threads(process_daemon: ProcessDaemon) -> None:
    """Closing a client that other threads wait on returns at once; their gets end
    with it, and a key that comes after lands nothing in their blocks."""
    src, dst = fill_random((4, BLOCK), 3), shared_zeros((4, BLOCK), torch.uint8)
    c = KvdClient(process_daemon.socket_path, timeout_s=10)
    c.connect()
    threads: list[threading.Thread] = []
    try:
        with KvdClient(process_daemon.socket_path) as watcher:
            threads, ended = _waiting_gets(c, c.register("dst", [dst]), 3)
            wait_until(lambda: watcher.stats()["waiting_gets"] >= 3)
            started = time.monotonic()
            c.close()
            closed = time.monotonic()
            assert closed - started < PROMPT_S
            for t in threads:
                t.join(PROMPT_S)
            assert len(ended) == 3 and all(
                isinstance(result, (kvd.Cancelled, kvd.DaemonUnavailable))
                for result, _ in ended), ended
            assert max(at for _, at in ended) - started < PROMPT_S
            with pytest.raises(kvd.DaemonUnavailable):
                c.ping()
            r_src = watcher.register("src", [src])
            assert watcher.put("never-0", r_src, [0]).wait(5) == BLOCK  # stored: no get
            time.sleep(0.2)
            assert not dst.any()
    finally:
        c.close()
        for t in threads:
            t.join(30)


def test_a_daemon_that_dies_fails_every_waiting_thread(sock_dir: str) -> None:
    """SIGKILL of the daemon while four threads wait on one client (three gets and a
    Transfer.wait): each raises DaemonUnavailable at once, the reader and those asleep."""
    d = ProcessDaemon(sock_dir)
    threads: list[threading.Thread] = []
    try:
        d.wait_ready()
        with KvdClient(d.socket_path, timeout_s=10) as c:
            region = c.register("dst", [shared_zeros((4, BLOCK), torch.uint8)])
            transfer = c.start_get("never-3", region, [3], timeout_s=LONG_GET_S)
            threads, ended = _waiting_gets(c, region, 3)

            def wait_transfer() -> None:
                try:
                    ended.append((transfer.wait(LONG_GET_S), time.monotonic()))
                except BaseException as exc:  # checked by the test
                    ended.append((exc, time.monotonic()))

            threads.append(threading.Thread(target=wait_transfer, name="transfer-wait"))
            threads[-1].start()
            wait_until(lambda: c.stats()["waiting_gets"] >= 4)
            d.proc.kill()
            killed = time.monotonic()
            for t in threads:
                t.join(PROMPT_S)
            assert len(ended) == 4 and all(
                isinstance(result, kvd.DaemonUnavailable) for result, _ in ended), ended
            assert max(at for _, at in ended) - killed < PROMPT_S
            with pytest.raises(kvd.DaemonUnavailable):
                c.ping()
    finally:
        d.stop(timeout_s=0)
        for t in threads:
            t.join(30)


class Interrupted(Exception):
    """What a signal handler raises in the main thread (as Ctrl-C raises
    KeyboardInterrupt)."""


def test_an_interrupted_main_thread_loses_no_reply_of_another(
        process_daemon: ProcessDaemon) -> None:
    """A signal handler's exception ends the main thread's get, 500 times, at random
    moments, while three other threads ping on the same client. It may strike the main
    thread between reading replies and keeping them: no other thread's reply may be in
    what it reads. Each interrupt ends only the get, in the daemon too; no ping is lost
    or held up."""
    main = threading.get_ident()
    rng = random.Random(5)
    timed, errors = Timed(), list[BaseException]()
    stop = threading.Event()

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    def ping() -> None:
        try:
            while not stop.is_set():
                timed("ping", c.ping)
        except BaseException as exc:  # the test fails on it, below
            errors.append(exc)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with KvdClient(process_daemon.socket_path, timeout_s=10) as c:
            region = c.register("dst", [shared_zeros((1, BLOCK), torch.uint8)])
            pingers = [threading.Thread(target=ping, name=f"ping-{i}") for i in range(3)]
            for t in pingers:
                t.start()
            try:
                for n in range(500):
                    kick = threading.Timer(rng.random() * 0.004, signal.pthread_kill,
                                           (main, signal.SIGUSR1))
                    with pytest.raises(Interrupted):
                        kick.start()
                        c.get(f"never-{n}", region, [0], timeout_s=5)
                    kick.join(5)
            finally:
                stop.set()
                for t in pingers:
                    t.join(30)
            assert not errors, errors[:3]
            slowest = timed.slowest()
            assert slowest[1] < PROMPT_S, f"{slowest[0]} waited {slowest[1]:.1f}s"
            assert c.ping() < PROMPT_S
            # However it struck (once its get had gone, before its wait), the interrupt
            # stopped that get in the daemon: none still waits to land bytes.
            assert c.stats()["waiting_gets"] == 0
    finally:
        signal.signal(signal.SIGUSR1, previous)
