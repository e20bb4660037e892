"""The client twins: ``AsyncKvdClient`` is the reference, and ``KvdClient`` has the same
surface (``kvd/client/base.py`` builds their requests once). These tests hold the two
together: a method, a parameter, a default, a type or an attribute on one side only fails
here. Then ``start_get`` and ``start_pull`` of the async client, against real daemons, bytes
checked where they land (their cancels mid-transfer: tests/test_fencing.py).
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvd
from kvd import AsyncKvdClient, AsyncTransfer, KvdClient, Transfer, shared_empty, shared_zeros
from tests.conftest import start_daemons

# The names that differ by the asyncio convention only (``contextlib.aclosing`` looks for
# ``aclose``; ``async with`` for the a-dunders). Every other public name is the same.
ASYNC_TO_SYNC = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}
# Methods of the async twins that are not coroutines: the constructor, and ``done``, which
# never waits on either side.
PLAIN_ON_ASYNC = {"__init__", "done"}
PAIRS = [(AsyncKvdClient, KvdClient), (AsyncTransfer, Transfer)]
# Transfers are made by their client's methods, never by callers: their constructors take
# each shell's own plumbing (the async one a reply future), and are not compared.
MADE_BY_THE_CLIENT = {AsyncTransfer, Transfer}


def surface(cls: type) -> dict[str, Any]:
    """The public names ``cls`` defines (or inherits, short of ``object``), with the
    constructor and the context-manager dunders: what a caller can use."""
    dunders = {*ASYNC_TO_SYNC, *ASYNC_TO_SYNC.values()}
    if cls not in MADE_BY_THE_CLIENT:
        dunders.add("__init__")
    names: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):
        for name, member in vars(klass).items():
            if not name.startswith("_") or name in dunders:
                names[name] = member
    return names


def twin_name(annotation: str) -> str:
    """An async side's annotation as the sync side writes it."""
    return re.sub(r"\bAsync(KvdClient|Transfer)\b", r"\1", annotation)


def described(fn: Callable[..., Any], translate: bool) -> tuple[Any, ...]:
    """What a caller relies on in a method: each parameter's name, kind, default and type,
    and the return type (types as written; the async side's in the sync spelling)."""
    signature = inspect.signature(fn)
    same = twin_name if translate else str

    def spelled(annotation: Any) -> str:
        return same(str(annotation))

    params = tuple((p.name, p.kind, p.default, spelled(p.annotation))
                   for p in signature.parameters.values())
    return params, spelled(signature.return_annotation)


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS,
                         ids=[a.__name__ for a, _ in PAIRS])
def test_the_sync_twin_has_the_async_surface_and_nothing_more(async_cls: type,
                                                              sync_cls: type) -> None:
    async_side, sync_side = surface(async_cls), surface(sync_cls)
    expected = {ASYNC_TO_SYNC.get(name, name) for name in async_side}
    assert set(sync_side) - expected == set(), (
        f"{sync_cls.__name__} has names {async_cls.__name__} lacks")
    assert expected - set(sync_side) == set(), (
        f"{async_cls.__name__} has names {sync_cls.__name__} lacks")
    for name, member in async_side.items():
        twin = sync_side[ASYNC_TO_SYNC.get(name, name)]
        where = f"{async_cls.__name__}.{name}"
        assert type(member) is type(twin), f"{where}: {type(member)} vs {type(twin)}"
        if isinstance(member, property):
            assert member.fset is None and twin.fset is None, where  # read-only, both
            assert member.fget is not None and twin.fget is not None, where
            mine, theirs = described(member.fget, True), described(twin.fget, False)
            assert mine == theirs, f"{where}:\n {mine}\nvs\n {theirs}"
            continue
        assert inspect.isfunction(member), f"{where}: {type(member)}"
        mine, theirs = described(member, True), described(twin, False)
        assert mine == theirs, f"{where}:\n {mine}\nvs\n {theirs}"
        assert inspect.iscoroutinefunction(member) == (name not in PLAIN_ON_ASYNC), (
            f"{where}: a coroutine function unless it is one of {sorted(PLAIN_ON_ASYNC)}")
        assert not inspect.iscoroutinefunction(twin), f"{sync_cls.__name__}.{name}"


def test_the_surface_check_sees_a_drift() -> None:
    """The comparison itself: an added parameter, default or method on one side shows."""
    async def one(self: Any, key: str, *, timeout_s: float | None = None) -> AsyncTransfer:
        raise NotImplementedError

    def other(self: Any, key: str, *, timeout_s: float | None = 1.0) -> Transfer:
        raise NotImplementedError

    def more(self: Any, key: str, *, timeout_s: float | None = None,
             ttl_s: float | None = None) -> Transfer:
        raise NotImplementedError

    def same(self: Any, key: str, *, timeout_s: float | None = None) -> Transfer:
        raise NotImplementedError

    assert described(one, True) == described(same, False)
    assert described(one, True) != described(other, False)
    assert described(one, True) != described(more, False)
    extra = type("Drifted", (KvdClient,), {"start_put": same})
    assert "start_put" in surface(extra) and "start_put" not in surface(AsyncKvdClient)


# ------------------------------------------------------------------ with a daemon

BLOCK = 64 * 1024


def random_blocks(blocks: int, seed: int) -> torch.Tensor:
    t = shared_empty((blocks, BLOCK), torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (blocks, BLOCK), dtype=torch.uint8, generator=gen))
    return t


async def until(predicate: Callable[[], Any], what: str, timeout_s: float = 10) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.005)


async def test_async_start_get_ends_when_the_bytes_are_in(daemon: Any) -> None:
    """A start_get waits without holding up its caller; a put feeds it, and its transfer
    ends with the bytes in its blocks. One that finds nothing fails in its wait, and one
    cancelled stops waiting in the daemon."""
    src, dst = random_blocks(4, 1), shared_zeros((4, BLOCK), torch.uint8)
    async with AsyncKvdClient(daemon.socket_path) as waiter, \
            AsyncKvdClient(daemon.socket_path) as feeder:
        r_src = await feeder.register("src", [src])
        r_dst = await waiter.register("dst", [dst])

        async def gets_waiting(n: int) -> bool:
            return bool((await feeder.stats())["waiting_gets"] == n)

        get = await waiter.start_get("k", r_dst, [3, 1], timeout_s=10)
        assert isinstance(get, AsyncTransfer) and get.key == "k"
        await until(lambda: gets_waiting(1), "the get never waited")
        await asyncio.sleep(0.1)
        assert not get.done() and not bool(dst.any())
        assert await (await feeder.put("k", r_src, [0, 2])).wait(10) == 2 * BLOCK
        assert await get.wait(10) == 2 * BLOCK and get.done()
        assert torch.equal(dst[3], src[0]) and torch.equal(dst[1], src[2])
        assert not bool(dst[0].any()) and not bool(dst[2].any())

        missing = await waiter.start_get("none", r_dst, [0], timeout_s=0)
        with pytest.raises(kvd.UnknownKey):
            await missing.wait(5)

        never = await waiter.start_get("never", r_dst, [0], timeout_s=20)
        await until(lambda: gets_waiting(1), "the get never waited")
        await never.cancel()
        assert never.done()
        with pytest.raises(kvd.Cancelled):
            await never.wait(5)
        assert await gets_waiting(0)
        assert not bool(dst[0].any())
        assert await waiter.ping() > 0  # the client serves on


async def test_async_start_pull_ends_when_the_bytes_are_in(sock_dir: str) -> None:
    """b's async client pulls from daemon a: a published key at once, and a key that a
    lends while the pull waits for it (``wait_for_key_s``). A pull without a wait of a key
    a lacks fails in its wait; a bad ``wait_for_key_s`` is refused before anything goes."""
    a, b = await asyncio.to_thread(start_daemons, sock_dir, "a", "b")
    try:
        src, dst = random_blocks(6, 2), shared_zeros((6, BLOCK), torch.uint8)
        async with AsyncKvdClient(a.socket_path) as ca, \
                AsyncKvdClient(b.socket_path) as cb:
            address = (await ca.stats())["peer"]["address"]
            r_src = await ca.register("src", [src])
            r_dst = await cb.register("dst", [dst])
            await ca.publish("pub", r_src, [4, 5])
            pull = await cb.start_pull("pub", address, r_dst, [0, 1], timeout_s=10)
            assert isinstance(pull, AsyncTransfer) and pull.key == "pub"
            assert await pull.wait(10) == 2 * BLOCK and pull.done()
            assert torch.equal(dst[:2], src[4:6])

            early = await cb.start_pull("later", address, r_dst, [2, 3], timeout_s=20,
                                        wait_for_key_s=15)

            async def waiting_at_a() -> bool:
                stats = await ca.stats()
                return bool(stats["transfers"]["pulls_waiting_for_key"] == 1)

            await until(waiting_at_a, "the pull never waited at a")
            assert not early.done() and not bool(dst[2:].any())
            lent = await ca.lend("later", r_src, [1, 0], ttl_s=30)
            assert await early.wait(10) == 2 * BLOCK and await lent.wait(10) == 2 * BLOCK
            assert torch.equal(dst[2], src[1]) and torch.equal(dst[3], src[0])

            with pytest.raises(kvd.UnknownKey):
                await (await cb.start_pull("none", address, r_dst, [4], timeout_s=5)).wait(10)
            with pytest.raises(kvd.BadRequest, match="wait_for_key_s"):
                await cb.start_pull("none", address, r_dst, [4], timeout_s=1,
                                    wait_for_key_s=2)
            assert not bool(dst[4:].any())
    finally:
        codes = [await asyncio.to_thread(d.stop) for d in (a, b)]
    assert codes == [0, 0], "\n".join(d.log() for d in (a, b))


async def test_the_twins_carry_the_same_attributes(daemon: Any) -> None:
    """What ``__init__`` and ``connect`` set, seen on live objects: the clients' and their
    transfers' public attributes are the same on both sides."""
    dst = shared_zeros((1, BLOCK), torch.uint8)
    sync_client = KvdClient(daemon.socket_path)  # (in a thread: the daemon may be this loop's)
    await asyncio.to_thread(sync_client.connect)
    try:
        async with AsyncKvdClient(daemon.socket_path) as async_client:
            r_async = await async_client.register("a", [dst])
            r_sync = await asyncio.to_thread(sync_client.register, "s", [dst])
            async_get = await async_client.start_get("x", r_async, [0], timeout_s=0)
            sync_get = await asyncio.to_thread(sync_client.start_get, "x", r_sync, [0],
                                               timeout_s=0)
            assert public(async_client) == public(sync_client) == {"node_id", "epoch"}
            assert public(async_get) == public(sync_get) == {"req_id", "key"}
            with pytest.raises(kvd.UnknownKey):
                await async_get.wait(5)
            with pytest.raises(kvd.UnknownKey):
                await asyncio.to_thread(sync_get.wait, 5)
    finally:
        await asyncio.to_thread(sync_client.close)


def public(obj: object) -> set[str]:
    return {name for name in vars(obj) if not name.startswith("_")}

