"""Tests for the buddy allocator and the host pool built on it.

The allocator's state must be a pure function of which ranges are live, so the
stateful test drives random alloc/free sequences against a plain-dict model and
checks after every step that the two agree and that the allocator's own invariants
hold; the example tests pin down the sizing promises (exact budget, no power-of-two
rounding of allocations) that the daemon's pool sizing relies on.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvd.errors import BadRequest, InvalidFree, KvdError, PoolExhausted
from kvd.memory.buddy import BuddyAllocator
from kvd.memory.pool import HostPool, PoolBlock

KiB = 1024
MiB = 1024 * KiB


def _snapshot(a: BuddyAllocator) -> tuple[object, ...]:
    return (a.free_blocks(), a.allocations(), a.stats(), a.allocation_count)


def _longest_run(free_blocks: list[tuple[int, int]]) -> int:
    """The longest contiguous free range, from scratch: what any placement could use."""
    longest, run_start, run_end = 0, 0, -1
    for off, size in free_blocks:
        if off != run_end:
            run_start = off
        run_end = off + size
        longest = max(longest, run_end - run_start)
    return longest


# -- stateful property test ----------------------------------------------------------


class BuddyMachine(RuleBasedStateMachine):
    """Random alloc/free against random pool shapes, checked against a dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc_: BuddyAllocator
        self.min_block = 1
        self.capacity = 0
        self.live: dict[int, int] = {}  # offset -> requested bytes

    @initialize(
        min_shift=st.integers(min_value=0, max_value=12),
        units=st.one_of(
            st.integers(min_value=0, max_value=300),
            st.sampled_from([1, 2, 64, 256, 255, 257, 1000]),
        ),
        slack=st.integers(min_value=0, max_value=4095),
    )
    def setup(self, min_shift: int, units: int, slack: int) -> None:
        self.min_block = 1 << min_shift
        capacity_bytes = units * self.min_block + slack % self.min_block
        self.alloc_ = BuddyAllocator(capacity_bytes, self.min_block)
        self.capacity = units * self.min_block
        assert self.alloc_.capacity_bytes == self.capacity
        self.initial_free = self.alloc_.free_blocks()
        # The exact budget: top-level blocks are the binary decomposition of the
        # capacity, largest first, each aligned to its own size.
        expected, pos = [], 0
        for bit in reversed(range(units.bit_length())):
            if units >> bit & 1:
                size = (1 << bit) * self.min_block
                expected.append((pos, size))
                pos += size
        assert self.initial_free == expected
        assert self.alloc_.top_level_blocks() == expected

    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.min_block) * self.min_block

    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        upper = max(self.capacity + 2 * self.min_block, 1)
        nbytes = data.draw(
            st.one_of(
                st.integers(min_value=1, max_value=4 * self.min_block),
                st.integers(min_value=1, max_value=upper),
            ),
            label="nbytes",
        )
        rounded = self._rounded(nbytes)
        fits = _longest_run(self.alloc_.free_blocks()) >= rounded
        before = _snapshot(self.alloc_)
        try:
            off = self.alloc_.alloc(nbytes)
        except PoolExhausted as exc:
            assert not fits, f"{nbytes} B failed with a large enough free block"
            assert str(nbytes) in str(exc)
            assert _snapshot(self.alloc_) == before
            return
        assert fits
        assert off % self.min_block == 0
        assert off >= 0 and off + rounded <= self.capacity
        assert self.alloc_.size_of(off) == rounded
        for other, other_n in self.live.items():
            other_end = other + self._rounded(other_n)
            assert off + rounded <= other or other_end <= off, "allocations overlap"
        assert off not in self.live
        self.live[off] = nbytes

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)), label="offset")
        self.alloc_.free(off)
        del self.live[off]
        with pytest.raises(InvalidFree):
            self.alloc_.free(off)

    @rule(data=st.data())
    def free_bogus(self, data: st.DataObject) -> None:
        off = data.draw(
            st.integers(min_value=-self.min_block, max_value=self.capacity + self.min_block),
            label="offset",
        )
        if off in self.live:
            return
        before = _snapshot(self.alloc_)
        with pytest.raises(InvalidFree):
            self.alloc_.free(off)
        assert _snapshot(self.alloc_) == before

    @rule(nbytes=st.integers(max_value=0))
    def alloc_nonpositive(self, nbytes: int) -> None:
        before = _snapshot(self.alloc_)
        with pytest.raises(BadRequest):
            self.alloc_.alloc(nbytes)
        assert _snapshot(self.alloc_) == before

    @rule()
    def free_all(self) -> None:
        for off in list(self.live):
            self.alloc_.free(off)
        self.live.clear()
        assert self.alloc_.free_bytes == self.capacity
        assert self.alloc_.free_blocks() == self.initial_free

    @invariant()
    def consistent(self) -> None:
        self.alloc_.check_invariants()
        stats = self.alloc_.stats()
        used = sum(self._rounded(n) for n in self.live.values())
        assert stats["used_bytes"] == self.alloc_.used_bytes == used
        assert stats["used_bytes"] + stats["free_bytes"] == stats["capacity_bytes"]
        assert self.alloc_.allocation_count == len(self.live)
        assert self.alloc_.allocations() == sorted(
            (off, self._rounded(n)) for off, n in self.live.items()
        )
        longest = _longest_run(self.alloc_.free_blocks())
        assert stats["largest_free_bytes"] == self.alloc_.largest_free_bytes == longest

    def teardown(self) -> None:
        if hasattr(self, "alloc_"):
            self.free_all()
            self.alloc_.check_invariants()


BuddyMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBuddyMachine = BuddyMachine.TestCase


# -- examples ------------------------------------------------------------------------


def test_budget_is_exact_not_a_power_of_two() -> None:
    a = BuddyAllocator(3 * 4096, 4096)
    assert a.capacity_bytes == 3 * 4096
    assert a.free_blocks() == [(0, 2 * 4096), (2 * 4096, 4096)]
    offs = [a.alloc(4096) for _ in range(3)]
    assert sorted(offs) == [0, 4096, 2 * 4096]
    with pytest.raises(PoolExhausted):
        a.alloc(1)


def test_capacity_rounds_down_to_min_block() -> None:
    a = BuddyAllocator(10 * 4096 + 4095, 4096)
    assert a.capacity_bytes == 10 * 4096
    assert a.free_bytes == 10 * 4096


def test_capacity_below_min_block_is_empty() -> None:
    a = BuddyAllocator(4095, 4096)
    assert a.capacity_bytes == a.free_bytes == a.largest_free_bytes == 0
    with pytest.raises(PoolExhausted):
        a.alloc(1)
    a.check_invariants()


@pytest.mark.parametrize("min_block", [0, -4096, 3, 4097, 6000])
def test_min_block_must_be_power_of_two(min_block: int) -> None:
    with pytest.raises(BadRequest):
        BuddyAllocator(1 * MiB, min_block)


def test_negative_capacity_is_bad_request() -> None:
    with pytest.raises(BadRequest):
        BuddyAllocator(-1)


@pytest.mark.parametrize("nbytes", [0, -1, -4096])
def test_nonpositive_alloc_is_bad_request(nbytes: int) -> None:
    with pytest.raises(BadRequest):
        BuddyAllocator(1 * MiB).alloc(nbytes)


def test_non_integer_alloc_is_bad_request() -> None:
    with pytest.raises(BadRequest):
        BuddyAllocator(1 * MiB).alloc(1.5)  # type: ignore[arg-type]


def test_non_power_of_two_sizes_do_not_waste_half() -> None:
    a = BuddyAllocator(1 * MiB, 4 * KiB)
    offs = [a.alloc(320 * KiB) for _ in range(3)]
    assert a.used_bytes == 960 * KiB
    assert a.free_bytes == 64 * KiB
    for off in offs:
        assert a.size_of(off) == 320 * KiB
    a.check_invariants()
    for off in offs:
        a.free(off)
    assert a.free_blocks() == [(0, 1 * MiB)]


def test_rounding_wastes_less_than_min_block() -> None:
    a = BuddyAllocator(1 * MiB, 4 * KiB)
    off = a.alloc(5 * KiB + 1)
    assert a.size_of(off) == 8 * KiB
    assert a.used_bytes - (5 * KiB + 1) < 4 * KiB


def test_power_of_two_capacity_frees_back_to_one_block() -> None:
    a = BuddyAllocator(1 * MiB, 4 * KiB)
    rng = random.Random(7)
    offs = []
    while True:
        try:
            offs.append(a.alloc(rng.randint(1, 96 * KiB)))
        except PoolExhausted:
            break
    rng.shuffle(offs)
    for off in offs:
        a.free(off)
    assert a.free_blocks() == [(0, 1 * MiB)]
    assert a.largest_free_bytes == a.free_bytes == 1 * MiB


def test_lowest_address_first() -> None:
    a = BuddyAllocator(64 * KiB, 4 * KiB)
    assert [a.alloc(4 * KiB) for _ in range(4)] == [0, 4 * KiB, 8 * KiB, 12 * KiB]
    a.free(4 * KiB)
    assert a.alloc(4 * KiB) == 4 * KiB


def test_best_fit_takes_the_shortest_run_that_fits() -> None:
    a = BuddyAllocator(64 * KiB, 4 * KiB)
    offs = [a.alloc(n * 4 * KiB) for n in (3, 1, 2, 1, 3, 1)]  # holes to be: 3, 2, 3 units
    for i in (0, 2, 4):
        a.free(offs[i])
    assert a.alloc(8 * KiB) == offs[2]  # the 2-unit hole, not the first 3-unit one
    assert a.alloc(12 * KiB) == offs[0]  # lowest address among equal fits
    a.check_invariants()


def test_exhaustion_message_and_state_unchanged() -> None:
    a = BuddyAllocator(1 * MiB, 4 * KiB)
    a.alloc(768 * KiB)
    before = _snapshot(a)
    with pytest.raises(PoolExhausted) as info:
        a.alloc(512 * KiB)
    assert info.value.retriable
    msg = str(info.value)
    assert str(512 * KiB) in msg and str(256 * KiB) in msg
    assert _snapshot(a) == before


def test_double_and_foreign_free() -> None:
    a = BuddyAllocator(1 * MiB, 4 * KiB)
    off = a.alloc(8 * KiB)
    with pytest.raises(InvalidFree):
        a.free(off + 4 * KiB)  # inside an allocation, but not its start
    with pytest.raises(InvalidFree):
        a.free(12345)
    a.free(off)
    with pytest.raises(InvalidFree):
        a.free(off)
    with pytest.raises(BadRequest):
        a.size_of(off)


def test_many_live_allocations_stay_fast() -> None:
    a = BuddyAllocator(1 << 30, 4 * KiB)
    rng = random.Random(1)
    start = time.monotonic()
    offs = [a.alloc(rng.choice([4, 8, 12, 20]) * KiB) for _ in range(20_000)]
    rng.shuffle(offs)
    for off in offs[:10_000]:
        a.free(off)
    for _ in range(10_000):
        offs.append(a.alloc(rng.choice([4, 8, 12, 20]) * KiB))
    assert time.monotonic() - start < 5.0
    a.check_invariants()


def test_threads_share_one_allocator() -> None:
    a = BuddyAllocator(4 * MiB + 12 * KiB, 4 * KiB)
    stop_at = time.monotonic() + 1.0
    errors: list[BaseException] = []
    kept: list[list[int]] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        try:
            while time.monotonic() < stop_at:
                if mine and rng.random() < 0.45:
                    a.free(mine.pop(rng.randrange(len(mine))))
                else:
                    try:
                        mine.append(a.alloc(rng.randint(1, 256 * KiB)))
                    except PoolExhausted:
                        if mine:
                            a.free(mine.pop(0))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)
        kept.append(mine)

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"kvd-test-buddy-{i}") for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()
    assert not errors, errors
    a.check_invariants()
    live = [off for mine in kept for off in mine]
    assert sorted(live) == [off for off, _ in a.allocations()]
    for off in live:
        a.free(off)
    a.check_invariants()
    assert a.free_bytes == a.capacity_bytes
    assert a.free_blocks() == a.top_level_blocks()


@settings(max_examples=50, deadline=None)
@given(
    capacity_units=st.integers(min_value=1, max_value=2000),
    sizes=st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=40),
)
def test_fill_then_drain_restores_decomposition(capacity_units: int, sizes: list[int]) -> None:
    a = BuddyAllocator(capacity_units * 512, 512)
    offs = []
    for units in sizes:
        with contextlib.suppress(PoolExhausted):
            offs.append(a.alloc(units * 512 - 7))
    a.check_invariants()
    for off in reversed(offs):
        a.free(off)
    assert a.free_blocks() == a.top_level_blocks()


# -- host pool -----------------------------------------------------------------------


def test_pool_views_are_disjoint_and_sized() -> None:
    pool = HostPool(1 * MiB, 4 * KiB)
    assert pool.buffer.dtype == torch.uint8 and pool.buffer.numel() == 1 * MiB
    blocks = [pool.alloc(n) for n in (100, 5000, 4096, 70_000)]
    for i, block in enumerate(blocks):
        view = pool.view(block)
        assert view.dtype == torch.uint8 and view.dim() == 1
        assert view.numel() == block.nbytes
        view.fill_(i + 1)
    for i, block in enumerate(blocks):
        assert bool((pool.view(block) == i + 1).all())
    assert pool.view(blocks[0]).data_ptr() == pool.buffer.data_ptr() + blocks[0].offset


def test_pool_stats_and_free() -> None:
    pool = HostPool(1 * MiB, 4 * KiB)
    assert pool.stats() == {
        "capacity_bytes": 1 * MiB,
        "used_bytes": 0,
        "free_bytes": 1 * MiB,
        "largest_free_bytes": 1 * MiB,
    }
    block = pool.alloc(320 * KiB)
    assert isinstance(block, PoolBlock)
    stats = pool.stats()
    assert stats["used_bytes"] == pool.used_bytes == 320 * KiB
    assert stats["free_bytes"] == pool.free_bytes == 704 * KiB
    assert stats["largest_free_bytes"] == pool.largest_free_bytes == 704 * KiB
    assert stats["capacity_bytes"] == pool.capacity_bytes == 1 * MiB
    pool.free(block)
    assert pool.stats()["free_bytes"] == 1 * MiB
    with pytest.raises(InvalidFree):
        pool.free(block)
    with pytest.raises(BadRequest):
        pool.view(block)


def test_pool_rejects_stale_or_forged_blocks() -> None:
    pool = HostPool(64 * KiB, 4 * KiB)
    block = pool.alloc(4 * KiB)
    with pytest.raises(InvalidFree):
        pool.free(PoolBlock(block.offset, 8 * KiB))
    with pytest.raises(InvalidFree):
        pool.free(PoolBlock(block.offset + 4 * KiB, 4 * KiB))
    pool.free(PoolBlock(block.offset, block.nbytes))  # equal value, not the same object


def test_pool_exhaustion_is_a_kvd_error() -> None:
    pool = HostPool(64 * KiB, 4 * KiB)
    pool.alloc(64 * KiB)
    with pytest.raises(PoolExhausted) as info:
        pool.alloc(1)
    assert isinstance(info.value, KvdError)
    with pytest.raises(BadRequest):
        pool.alloc(0)


def test_pool_without_pin_never_touches_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> bool:
        raise AssertionError("CUDA queried for an unpinned pool")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    pool = HostPool(64 * KiB)
    assert not pool.buffer.is_pinned()
