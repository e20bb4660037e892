"""The vLLM connector's data path without vLLM: two `kvd serve` daemons, an engine's KV
tensors (private CPU memory, paged like vLLM's CPU backend) on each side, requests' blocks
lent and pulled, or pushed, through staging; bytes checked block by block."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvd import KvdClient
from kvd.errors import BadRequest
from kvd.integrations.kv_mover import (
    DiscardOrder,
    KvMover,
    LoadOrder,
    Polled,
    ReleaseOrder,
    RenewOrder,
    SendOrder,
    block_dim_of,
)
from kvd.integrations.kv_ranks import heads_of, lender_of, lends, reads
from tests.conftest import ProcessDaemon, start_daemons

NUM_BLOCKS, LAYERS = 24, 3
PAGE = (2, 4, 16)  # kv heads, block size, 2 * head size: vLLM's [B, H, N, 2C] per layer


def engine_kv(seed: int) -> list[torch.Tensor]:
    """One allocation, a view per layer (as vLLM allocates it), random contents."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn((LAYERS, NUM_BLOCKS, *PAGE), generator=gen)
    return [storage[i] for i in range(LAYERS)]


class Side:
    """An engine on its own ready daemon (``proc``, named ``name``)."""

    def __init__(self, proc: ProcessDaemon, name: str, seed: int,
                 staging_blocks: int = 16) -> None:
        self.proc = proc
        self.kv = engine_kv(seed)
        client = KvdClient(self.proc.socket_path, name=f"engine-{name}")
        client.connect()
        self.address = client.stats()["peer"]["address"]
        self.mover = KvMover(client, self.kv, NUM_BLOCKS, staging_blocks)
        self.seen = Polled()

    def poll(self) -> Polled:
        got = self.mover.poll()
        self.seen.released |= got.released
        self.seen.loaded |= got.loaded
        self.seen.failed.update(got.failed)
        self.seen.causes.update(got.causes)
        return got

    def block(self, i: int) -> list[torch.Tensor]:
        return [layer[i].clone() for layer in self.kv]

    def close(self) -> None:
        """Close the mover, then stop the daemon (even if the close raises): exit code 0."""
        try:
            self.mover.close()
        finally:
            code = self.proc.stop()
        assert code == 0, self.proc.log()


@contextlib.contextmanager
def started_sides(root: str, *specs: tuple[str, int, int]) -> Iterator[list[Side]]:
    """A side per (name, seed, staging blocks), their daemons started side by side. At the
    end every side closes, each whatever the others' close raised."""
    with contextlib.ExitStack() as stack:
        procs = start_daemons(root, *(name for name, _, _ in specs))
        for proc in procs:  # (a daemon's second stop does nothing)
            stack.callback(proc.stop)
        found = []
        for proc, (name, seed, staging_blocks) in zip(procs, specs, strict=True):
            found.append(Side(proc, name, seed, staging_blocks))
            stack.callback(found[-1].close)  # (its proc then, which a test may replace)
        yield found


@pytest.fixture
def sides(sock_dir: str) -> Iterator[tuple[Side, Side]]:
    with started_sides(sock_dir, ("prefill", 1, 16), ("decode", 2, 16)) as (p, d):
        yield p, d


def drive(*sides: Side, until: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():  # type: ignore[operator]
        assert time.monotonic() < deadline, [s.seen for s in sides]
        for side in sides:
            side.poll()
        time.sleep(0.002)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_pull_flow_whole_and_prefix_hit(sides: tuple[Side, Side]) -> None:
    p, d = sides
    want = {i: p.block(i) for i in (3, 7, 1)}
    p.mover.send(SendOrder("r1", "key-r1", [3, 7, 1], lease_s=10))
    # Staged: the engine may free its blocks at once, before anyone pulls.
    assert p.poll().released == {"r1"}
    untouched = d.block(0)
    d.mover.load(LoadOrder("r1", "key-r1", p.address, 3, 0, [2, 5, 9], timeout_s=10))
    drive(p, d, until=lambda: "r1" in d.seen.loaded)
    assert same(d.block(2), want[3]) and same(d.block(5), want[7]) and same(d.block(9), want[1])
    assert same(d.block(0), untouched)
    drive(p, d, until=lambda: p.mover.stats.sends == 1)  # the loan ended: staging is free
    assert p.mover.stats.bytes_sent == d.mover.stats.bytes_received == 3 * p.mover.block_bytes
    assert p.mover.groups[0].slots.free == 16 and d.mover.groups[0].slots.free == 16

    # Decode has the first block cached: only blocks 1.. of the key are written.
    p.mover.send(SendOrder("r2", "key-r2", [10, 11, 12], lease_s=10))
    before = d.block(20)
    d.mover.load(LoadOrder("r2", "key-r2", p.address, 3, 1, [13, 14], timeout_s=10))
    drive(p, d, until=lambda: "r2" in d.seen.loaded)
    assert same(d.block(13), p.block(11)) and same(d.block(14), p.block(12))
    assert same(d.block(20), before)


def test_decode_asks_before_prefill_lends_and_push_flow(sides: tuple[Side, Side]) -> None:
    p, d = sides
    d.mover.load(LoadOrder("early", "key-early", p.address, 2, 0, [0, 1], timeout_s=10))
    # The pull finds no key yet: prefill's daemon holds it until the key is lent.
    drive(d, until=lambda: p.mover.client.stats()["transfers"]["pulls_waiting_for_key"])
    for _ in range(5):
        d.poll()
        time.sleep(0.01)
    assert not d.seen.loaded and not d.seen.failed
    p.mover.send(SendOrder("early", "key-early", [4, 5], lease_s=10))
    drive(p, d, until=lambda: "early" in d.seen.loaded)
    assert same(d.block(0), p.block(4)) and same(d.block(1), p.block(5))
    assert d.mover.stats.pull_retries == 0  # served when lent, not asked again

    # Push: decode waits on its own daemon, prefill puts to it.
    d.mover.load(LoadOrder("pushed", "key-pushed", None, 2, 0, [6, 7], timeout_s=10))
    p.mover.send(SendOrder("pushed", "key-pushed", [8, 9], lease_s=10, push_to=d.address))
    drive(p, d, until=lambda: "pushed" in d.seen.loaded)
    assert same(d.block(6), p.block(8)) and same(d.block(7), p.block(9))
    drive(p, d, until=lambda: p.mover.stats.sends == 2)
    assert p.mover.stats.send_failures == 0 and p.mover.stats.sends_unread == 0


def test_two_engines_on_one_daemon_name_it_by_its_own_address(sock_dir: str) -> None:
    """Prefill and decode share one daemon (two vLLM instances on one node): each gives
    the other that daemon's peer address, as between nodes. A pull from it and a put to
    it stay within the daemon."""
    (proc,) = start_daemons(sock_dir, "node")
    p, d = Side(proc, "prefill", 1), Side(proc, "decode", 2)
    try:
        assert p.address == d.address
        p.mover.send(SendOrder("r1", "key-r1", [3, 7], lease_s=10))
        d.mover.load(LoadOrder("r1", "key-r1", p.address, 2, 0, [2, 5], timeout_s=10))
        drive(p, d, until=lambda: "r1" in d.seen.loaded)
        assert same(d.block(2), p.block(3)) and same(d.block(5), p.block(7))

        d.mover.load(LoadOrder("r2", "key-r2", None, 2, 0, [8, 9], timeout_s=10))
        p.mover.send(SendOrder("r2", "key-r2", [10, 11], lease_s=10, push_to=d.address))
        drive(p, d, until=lambda: "r2" in d.seen.loaded and p.mover.stats.sends == 2)
        assert same(d.block(8), p.block(10)) and same(d.block(9), p.block(11))
        assert p.mover.stats.send_failures == 0 and d.mover.stats.load_failures == 0
    finally:
        d.mover.close()
        p.close()


def test_failures_are_reported_with_their_blocks(sides: tuple[Side, Side]) -> None:
    p, d = sides
    d.mover.load(LoadOrder("never", "key-never", p.address, 2, 0, [3, 4], timeout_s=0.5))
    d.mover.load(LoadOrder("nopush", "key-nopush", None, 1, 0, [5], timeout_s=0.5))
    d.mover.load(LoadOrder("wrong", "key-wrong", p.address, 3, 0, [5], timeout_s=5))
    drive(p, d, until=lambda: len(d.seen.failed) == 3)
    assert d.seen.failed == {"never": [3, 4], "nopush": [5], "wrong": [5]}
    assert "no key 'key-nopush' arrived" in d.seen.causes["nopush"]
    assert d.seen.causes["wrong"] == "bad load order for key 'key-wrong'"
    assert d.mover.stats.load_failures == 3 and not d.seen.loaded

    # Lent and never pulled: the lease ends the loan, the staging comes back.
    p.mover.send(SendOrder("unread", "key-unread", [1, 2], lease_s=0.3))
    drive(p, d, until=lambda: p.mover.stats.sends_unread == 1)
    assert p.mover.groups[0].slots.free == 16

    # Decode queued past prefill's lease: its load fails at once, not at its timeout
    # (the key is gone from prefill's daemon, and waiting would not bring it back).
    started, retries = time.monotonic(), d.mover.stats.pull_retries
    d.mover.load(LoadOrder("late", "key-unread", p.address, 2, 0, [6, 7], timeout_s=20))
    drive(p, d, until=lambda: "late" in d.seen.failed)
    assert time.monotonic() - started < 1.0 and "was expired" in d.seen.causes["late"]
    assert d.mover.stats.pull_retries == retries

    # More blocks than staging holds: a clear failure, and the engine's blocks come back.
    p.mover.send(SendOrder("huge", "key-huge", list(range(17)), lease_s=5))
    assert "huge" in p.poll().released and p.mover.stats.send_failures == 1


def test_leases_renewed_while_queued_and_released_when_not_loaded(
        sides: tuple[Side, Side]) -> None:
    """Prefill lends for 0.6 s. Decode renews the loan every 0.3 s for 1.5 s (its request
    waits in its queue), then loads it. A request decode will not load releases its key:
    prefill's send ends at once, counted as released, and a pull that still waits for a
    released key fails at once, quietly (the request is gone); a load that fails releases
    its key by itself."""
    p, d = sides
    p.mover.send(SendOrder("queued", "key-queued", [3, 4], lease_s=0.6))
    p.poll()
    started = time.monotonic()
    while time.monotonic() - started < 1.5:
        d.mover.renew(RenewOrder("queued", "key-queued", p.address, 0.6))
        pause = time.monotonic() + 0.3
        drive(p, d, until=lambda pause=pause: time.monotonic() >= pause)
    d.mover.load(LoadOrder("queued", "key-queued", p.address, 2, 0, [0, 1], timeout_s=10))
    drive(p, d, until=lambda: "queued" in d.seen.loaded)
    assert same(d.block(0), p.block(3)) and same(d.block(1), p.block(4))
    assert d.mover.stats.leases_renewed >= 4 and p.mover.stats.sends_unread == 0

    # Will not load it: released; prefill's send ends now, not in 30 s.
    p.mover.send(SendOrder("aborted", "key-aborted", [5], lease_s=30))
    drive(p, until=lambda: p.mover.client.stats()["keys"] == 1)
    d.mover.release(ReleaseOrder("aborted", "key-aborted", p.address))
    drive(p, d, until=lambda: p.mover.stats.sends_released == 1, timeout_s=1.0)
    # (Decode hears its daemon's answer when it next polls, maybe after prefill heard.)
    drive(d, until=lambda: d.mover.stats.leases_released == 1, timeout_s=1.0)
    assert p.mover.groups[0].slots.free == 16

    # Its pull waits at prefill (nothing lent yet) when the request goes: quiet failure.
    d.mover.load(LoadOrder("gone", "key-gone", p.address, 1, 0, [2], timeout_s=10))
    drive(d, until=lambda: p.mover.client.stats()["transfers"]["pulls_waiting_for_key"])
    d.mover.release(ReleaseOrder("gone", "key-gone", p.address))
    aborted: set[str] = set()

    def heard() -> bool:
        aborted.update(d.poll().aborted)
        return "gone" in aborted

    drive(d, until=heard, timeout_s=1.0)
    p.mover.send(SendOrder("gone", "key-gone", [6], lease_s=30))  # lent late: answered now
    drive(p, until=lambda: p.mover.stats.sends_released == 2, timeout_s=1.0)

    # A load that fails (it expects 2 blocks, 1 was lent) frees prefill's key too.
    p.mover.send(SendOrder("bad", "key-bad", [7], lease_s=30))
    d.mover.load(LoadOrder("bad", "key-bad", p.address, 2, 0, [3, 4], timeout_s=10))
    drive(p, d, until=lambda: p.mover.stats.sends_released == 3, timeout_s=2.0)
    assert p.mover.client.stats()["keys"] == 0


def test_a_request_in_parts(sides: tuple[Side, Side]) -> None:
    """Push while prefill still runs: parts go as their blocks are written, the request is
    released once its final part is done; decode's request is loaded once every part is
    in, or reported with the blocks of the parts that failed once none can write."""
    p, d = sides
    loads = [LoadOrder("r", f"r#p{i}", None, 2, 0, [20 + 2 * i, 21 + 2 * i], 10, parts=2)
             for i in range(2)]
    for order in loads:
        d.mover.load(order)
    p.mover.send(SendOrder("r", "r#p0", [0, 1], 10, d.address, final=False, stage=True))
    drive(p, d, until=lambda: p.mover.stats.sends == 1)
    assert not p.seen.released and not d.seen.loaded  # one part of two
    p.mover.send(SendOrder("r", "r#p1", [2, 3], 10, d.address))
    drive(p, d, until=lambda: "r" in d.seen.loaded and "r" in p.seen.released)
    assert all(same(d.block(20 + i), p.block(i)) for i in range(4))
    assert d.mover.stats.loads == 1

    # The second part never comes: the first part's blocks are valid, the second's not.
    for i in range(2):
        d.mover.load(LoadOrder("q", f"q#p{i}", None, 1, 0, [12 + i], 0.5 if i else 10,
                               parts=2))
    p.mover.send(SendOrder("q", "q#p0", [5], 10, d.address, final=False))
    drive(p, d, until=lambda: "q" in d.seen.failed)
    assert d.seen.failed["q"] == [13] and "q" not in d.seen.loaded
    assert same(d.block(12), p.block(5))

    # Block ids the engine does not have: refused up front, not an IndexError in a poll.
    d.mover.load(LoadOrder("bad", "bad", None, 1, 0, [NUM_BLOCKS], 5))
    p.mover.send(SendOrder("bad", "bad", [-1], 5, d.address))
    assert d.poll().failed == {"bad": [NUM_BLOCKS]} and "bad" in p.poll().released
    # A key already in flight: the second order fails alone, the first carries on.
    d.mover.load(LoadOrder("one", "same", None, 1, 0, [14], 10))
    d.mover.load(LoadOrder("two", "same", None, 1, 0, [15], 10))
    assert d.poll().failed == {"two": [15]}
    p.mover.send(SendOrder("one", "same", [6], 10, d.address))
    drive(p, d, until=lambda: "one" in d.seen.loaded)
    assert same(d.block(14), p.block(6))


def test_keys_the_engine_does_not_need_never_cross_the_wire(sides: tuple[Side, Side],
                                                            ) -> None:
    """Parts of a prompt that decode has cached, discarded (released) by decode: one
    discarded before prefill pushes it, its sender known, is never sent (prefill's send
    ends released, decode's daemon takes in no byte); one discarded with no sender known is
    refused as it arrives; one already in decode's daemon is dropped at once. None waits
    in the pool for its lease. The engine's blocks and a load beside them are untouched."""
    p, d = sides
    client = d.mover.client

    def arrived() -> tuple[int, int, int]:
        st = client.stats()
        return st["bytes_in"], st["keys"], st["pool"]["used_bytes"]

    untouched = [d.block(i) for i in range(NUM_BLOCKS)]
    d.mover.discard(DiscardOrder("r", "r#p0", sender=p.address))
    d.mover.discard(DiscardOrder("r", "r#p1"))
    drive(p, d, until=lambda: len(d.mover._leases) == 0)
    p.mover.send(SendOrder("r", "r#p0", [0, 1], 30, d.address, final=False))
    p.mover.send(SendOrder("r", "r#p1", [2, 3], 30, d.address, final=False))
    drive(p, d, until=lambda: p.mover.stats.sends_released == 2)
    assert arrived() == (0, 0, 0) and p.mover.stats.send_failures == 0

    p.mover.send(SendOrder("r", "r#p2", [4, 5], 30, d.address, final=False))
    drive(p, d, until=lambda: client.stats()["keys"] == 1)
    d.mover.discard(DiscardOrder("r", "r#p2", sender=p.address))  # there already
    d.mover.load(LoadOrder("r", "r#p3", None, 2, 0, [20, 21], 10))
    p.mover.send(SendOrder("r", "r#p3", [6, 7], 30, d.address))
    drive(p, d, until=lambda: "r" in d.seen.loaded and "r" in p.seen.released)
    assert arrived()[1:] == (0, 0) and d.mover.stats.parts_dropped == 3
    assert same(d.block(20), p.block(6)) and same(d.block(21), p.block(7))
    assert all(same(d.block(i), untouched[i]) for i in range(NUM_BLOCKS) if i not in (20, 21))
    d.mover.load(LoadOrder("s", "s#p0", None, 1, 0, [9], 10))
    d.mover.discard(DiscardOrder("s", "s#p0"))  # being loaded: refused, logged, dropped
    assert d.mover.stats.parts_dropped == 3


def test_a_restarted_daemon_is_found_again(sides: tuple[Side, Side]) -> None:
    """kvd restarts under a running engine: what was in flight fails (decode recomputes),
    new work fails fast meanwhile, and once the daemon is back the mover registers again
    by itself and moves bytes."""
    p, d = sides
    d.mover.load(LoadOrder("before", "key-before", p.address, 1, 0, [3], timeout_s=30))
    d.poll()
    assert d.proc.stop() == 0
    drive(p, d, until=lambda: "before" in d.seen.failed)
    assert not d.mover.connected
    d.mover.load(LoadOrder("down", "key-down", p.address, 1, 0, [4], timeout_s=30))
    assert "down" in d.poll().failed  # at once, not at its timeout

    d.proc = ProcessDaemon(os.path.dirname(d.proc.socket_path), "--node-id",
                           "decode").wait_ready()
    drive(p, d, until=lambda: d.mover.connected)
    p.mover.send(SendOrder("after", "key-after", [7, 8], lease_s=10))
    d.mover.load(LoadOrder("after", "key-after", p.address, 2, 0, [9, 10], timeout_s=10))
    drive(p, d, until=lambda: "after" in d.seen.loaded)
    assert same(d.block(9), p.block(7)) and same(d.block(10), p.block(8))
    # A restart is a restart to the new daemon, not bad input: the engine's old session
    # never reaches it (its ROUTER connects only to clients that came through its door).
    with KvdClient(d.proc.socket_path) as c:
        assert c.stats()["bad_messages"] == {}


def movers_of(p: Side, d: Side, make_kv: Callable[[int], list[torch.Tensor]], name: str,
              ) -> list[tuple[KvMover, list[torch.Tensor]]]:
    """A second engine beside each side's (its KV from ``make_kv(seed)``, 8 staging
    blocks), on the same daemons; the caller closes the movers."""
    movers = []
    for side, seed in ((p, 5), (d, 6)):
        kv = make_kv(seed)
        client = KvdClient(side.proc.socket_path, name=f"{name}-{seed}")
        client.connect()
        movers.append((KvMover(client, kv, NUM_BLOCKS, 8, name=name), kv))
    return movers


def test_blocks_on_dim_1_whose_blocks_are_not_one_run(sides: tuple[Side, Side]) -> None:
    """The older FlashAttention layout, [2, N, block, heads, dim] per layer: a block's K and
    V halves lie apart, so staging copies them as they are."""
    p, d = sides

    def fa_kv(seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn((2, NUM_BLOCKS, 4, 2, 8), generator=gen) for _ in range(LAYERS)]

    (mp, p_kv), (md, d_kv) = movers_of(p, d, fa_kv, "fa")
    try:
        mp.send(SendOrder("fa", "key-fa", [1, 9, 4], lease_s=10))
        md.load(LoadOrder("fa", "key-fa", p.address, 3, 0, [0, 2, 3], timeout_s=10))
        deadline = time.monotonic() + 10
        while "fa" not in md.poll().loaded:
            mp.poll()
            assert time.monotonic() < deadline
        for src, dst in zip(p_kv, d_kv, strict=True):
            assert torch.equal(dst[:, [0, 2, 3]], src[:, [1, 9, 4]])
    finally:
        mp.close()
        md.close()


def test_full_staging_waits_for_room(sock_dir: str) -> None:
    with started_sides(sock_dir, ("p", 3, 4), ("d", 4, 16)) as (p, d):
        p.mover.send(SendOrder("a", "key-a", [0, 1, 2], lease_s=10))
        p.mover.send(SendOrder("b", "key-b", [3, 4, 5], lease_s=10))
        assert p.poll().released == {"a"}  # b waits: one slot left
        d.mover.load(LoadOrder("a", "key-a", p.address, 3, 0, [0, 1, 2], timeout_s=10))
        drive(p, d, until=lambda: "b" in p.seen.released)
        d.mover.load(LoadOrder("b", "key-b", p.address, 3, 0, [3, 4, 5], timeout_s=10))
        drive(p, d, until=lambda: "b" in d.seen.loaded)
        assert all(same(d.block(i), p.block(i)) for i in range(6))


def test_block_dim_is_found_or_refused() -> None:
    assert block_dim_of(torch.empty(5, 2, 3), 5) == 0
    assert block_dim_of(torch.empty(2, 5, 3), 5) == 1  # FlashAttention's [2, N, ...]
    with pytest.raises(BadRequest, match="no dimension of 7 blocks"):
        block_dim_of(torch.empty(2, 5, 7), 7)


def test_mla_shaped_caches_move_whole(sides: tuple[Side, Side]) -> None:
    """MLA's latent cache (DeepSeek: one bf16 tensor per layer, [N, block, 512 + 64], no K
    and V halves) moves like any other: a request's blocks, and the part past a local
    prefix hit."""
    p, d = sides

    def mla_kv(seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        whole = torch.randn((LAYERS, NUM_BLOCKS, 16, 576), generator=gen).to(torch.bfloat16)
        return [whole[i] for i in range(LAYERS)]

    (mp, p_kv), (md, d_kv) = movers_of(p, d, mla_kv, "mla")
    try:
        mp.send(SendOrder("m1", "key-m1", [4, 11, 2], lease_s=10))
        md.load(LoadOrder("m1", "key-m1", p.address, 3, 0, [0, 5, 6], timeout_s=10))
        mp.send(SendOrder("m2", "key-m2", [7, 8, 9], lease_s=10))
        md.load(LoadOrder("m2", "key-m2", p.address, 3, 2, [12], timeout_s=10))
        loaded: set[str] = set()
        deadline = time.monotonic() + 10
        while loaded != {"m1", "m2"}:
            mp.poll()
            loaded |= md.poll().loaded
            assert time.monotonic() < deadline
        for src, dst in zip(p_kv, d_kv, strict=True):
            assert torch.equal(dst[[0, 5, 6]], src[[4, 11, 2]])
            assert torch.equal(dst[12], src[9])
    finally:
        mp.close()
        md.close()


def rank_kv(heads: int, seed: int) -> list[torch.Tensor]:
    """One rank's KV: ``heads`` of the model's 4, [N, heads, block, 2 x head] per layer."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn((LAYERS, NUM_BLOCKS, heads, 4, 16), generator=gen)
    return [storage[i] for i in range(LAYERS)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"),
                         [(2, 1, 4), (1, 2, 4), (4, 2, 4), (1, 2, 1)])
def test_mixed_tensor_parallel_ranks(sides: tuple[Side, Side], prefill_tp: int,
                                     decode_tp: int, heads: int) -> None:
    """Prefill and decode with their KV heads split over other numbers of ranks (one mover
    per rank, prefill's on one daemon, decode's on the other), as the connector orders it
    (``kv_ranks``): prefill's lending ranks lend their blocks, each decode rank reads its
    heads of them into its blocks, past a prefix it has cached, in pull and push flow. With
    one head (an MLA latent cache), prefill's one lender is read whole by both decode
    ranks. Each lend ends once all of it is read."""
    p, d = sides
    made: list[KvdClient] = []

    def ranks(side: Side, tp: int, seed: int) -> list[KvMover]:
        out = []
        for r in range(tp):
            client = KvdClient(side.proc.socket_path, name=f"rank-{seed}-{r}")
            client.connect()
            made.append(client)
            out.append(KvMover(client, rank_kv(max(1, heads // tp), seed + r), NUM_BLOCKS, 8))
        return out

    prefill, decode = ranks(p, prefill_tp, 10), ranks(d, decode_tp, 20)
    try:
        lenders = [r for r in range(prefill_tp) if lends(r, prefill_tp, heads)]
        assert len(lenders) == (1 if heads == 1 else prefill_tp)
        src, dst = [3, 8, 5, 1], [2, 4, 6, 7]
        for flow, key in (("pull", "tp-pull"), ("push", "tp-push")):
            for r in range(prefill_tp):
                order = SendOrder(flow, f"{key}#tp{r}", src, lease_s=10,
                                  push_to=d.address if flow == "push" else None)
                (prefill[r].send if r in lenders else prefill[r].skip)(order)
            for r, mover in enumerate(decode):
                taken = reads(r, decode_tp, prefill_tp, heads)
                for read in taken:
                    mover.load(LoadOrder(
                        flow, f"{key}#tp{read.rank}", p.address if flow == "pull" else None,
                        4, 1, dst[1:], timeout_s=10, parts=len(taken), part=read.part,
                        readers=read.readers, into=read.into))
            loaded, released = [False] * decode_tp, [False] * prefill_tp
            deadline = time.monotonic() + 10
            while not (all(loaded) and all(released)):
                assert time.monotonic() < deadline, (flow, loaded, released)
                for r, mover in enumerate(prefill):
                    released[r] |= flow in mover.poll().released
                for r, mover in enumerate(decode):
                    got = mover.poll()
                    assert not got.failed, got.causes
                    loaded[r] |= flow in got.loaded
                time.sleep(0.002)
            # Each decode rank holds its heads of prefill's blocks past the first one.
            for r, mover in enumerate(decode):
                first, count = heads_of(r, decode_tp, heads)
                for layer in range(LAYERS):
                    want = torch.cat([prefill[lender_of(h, prefill_tp, heads)].layers[layer][
                        src[1:], h - heads_of(lender_of(h, prefill_tp, heads), prefill_tp,
                                              heads)[0]].unsqueeze(1)
                        for h in range(first, first + count)], dim=1)
                    assert torch.equal(mover.layers[layer][dst[1:]], want), (flow, r, layer)
        for c in made:
            assert c.stats()["keys"] == 0
    finally:
        for mover in (*prefill, *decode):
            mover.close()
