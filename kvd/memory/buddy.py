"""A buddy allocator for offsets into one host buffer.

The daemon holds KV blocks in a single pre-allocated buffer, so it needs an
allocator over offsets rather than over memory: one that never asks the OS for more,
works in O(log n), and keeps fragmentation bounded under churn. A classic buddy
system wastes up to half of every allocation and of the pool itself (both rounded
to powers of two), and that waste is what sizes the host, so three changes remove it:

* the pool is split into top-level power-of-two blocks (the binary decomposition of
  its size), so a configured budget of 3 GiB is 3 GiB, not 2 or 4;
* an allocation is rounded only to ``min_block_bytes``;
* an allocation need not start on a boundary of its own size: it takes the front of
  a contiguous run of free buddy blocks. Aligned placement alone would strand space;
  in a 1 MiB pool, 320 KiB allocations would land at 0 and 512 KiB and leave two
  192 KiB holes, so a third would fail with 384 KiB free.

Free space is still held as buddy blocks, and every block enters the free lists
through the usual buddy merge, so they are always the maximal merge of the free
space: the state is a pure function of which ranges are live, which keeps long-lived
pools from drifting and is what the tests check. Beside the blocks sits an index of
runs (maximal contiguous free ranges) by exact length, which is what placement
searches: best fit, the shortest run that is long enough, lowest address among
equals (the same choice the classic buddy makes among blocks, made among runs). So an
allocation fails only when no contiguous free range of its size exists, and the
search is a bisect over the distinct run lengths, however fragmented the pool.
"""

from __future__ import annotations

import bisect
import heapq
import operator
import threading
from collections.abc import Iterator

from kvd.errors import BadRequest, InvalidFree, PoolExhausted

__all__ = ["BuddyAllocator"]


def _aligned_pieces(start: int, end: int) -> Iterator[tuple[int, int]]:
    """Yield ``(offset, order)`` blocks covering [start, end), in units of min blocks.

    Each block is a power of two aligned to its own size relative to offset 0, the
    largest that fits at its position; these are exactly the blocks the buddy rules
    can hold, so any range can be handed to the free lists this way.
    """
    pos = start
    while pos < end:
        size = 1 << ((end - pos).bit_length() - 1)
        if pos:
            size = min(size, pos & -pos)
        yield pos, size.bit_length() - 1
        pos += size


class _LowestSet:
    """A set of ints that also answers "lowest member" in O(log n) amortised.

    The heap may hold stale entries (removed members); they are skipped when they
    reach the top and purged wholesale once they outnumber the live ones.
    """

    __slots__ = ("_heap", "_members")

    def __init__(self) -> None:
        self._members: set[int] = set()
        self._heap: list[int] = []

    def add(self, x: int) -> None:
        self._members.add(x)
        heapq.heappush(self._heap, x)

    def remove(self, x: int) -> None:
        self._members.remove(x)
        if len(self._heap) > 2 * len(self._members) + 16:
            self._heap = sorted(self._members)

    def lowest(self) -> int:
        heap = self._heap
        while heap[0] not in self._members:
            heapq.heappop(heap)
        return heap[0]

    def __iter__(self) -> Iterator[int]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)


class BuddyAllocator:
    """Hands out byte offsets in ``[0, capacity_bytes)``; thread-safe.

    Internally everything is counted in units of ``min_block_bytes`` so that the
    buddy arithmetic (``addr ^ size``) works on small integers.
    """

    def __init__(self, capacity_bytes: int, min_block_bytes: int = 4096) -> None:
        if min_block_bytes <= 0 or min_block_bytes & (min_block_bytes - 1):
            raise BadRequest(f"min_block_bytes must be a power of two, got {min_block_bytes}")
        if capacity_bytes < 0:
            raise BadRequest(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._lock = threading.Lock()
        self._unit = min_block_bytes
        self._capacity_units = capacity_bytes // min_block_bytes
        # Buddy blocks: free block offset -> order (size 2**order units). Merging stops
        # at a top-level block: its buddy lies outside the pool or in another top-level
        # block, never something it may join.
        self._free_order: dict[int, int] = {}
        self._top_level: dict[int, int] = {}
        # Runs: start -> end and end -> start (to coalesce on free), starts grouped by
        # length, and the distinct lengths in order (to bisect for the best fit).
        self._run_end: dict[int, int] = {}
        self._run_start: dict[int, int] = {}
        self._runs_by_length: dict[int, _LowestSet] = {}
        self._run_lengths: list[int] = []
        self._allocs: dict[int, int] = {}  # offset -> size, both in units
        self._used_units = 0
        for off, order in _aligned_pieces(0, self._capacity_units):
            self._top_level[off] = order
            self._free_order[off] = order
        if self._capacity_units:
            self._add_run(0, self._capacity_units)

    # -- buddy blocks (caller holds the lock) ------------------------------------------

    def _release_range(self, start: int, end: int) -> None:
        """Return [start, end) to the free blocks, merging each piece with free buddies."""
        for off, order in _aligned_pieces(start, end):
            while self._top_level.get(off) != order:
                buddy = off ^ (1 << order)
                if self._free_order.get(buddy) != order:
                    break
                del self._free_order[buddy]
                off = min(off, buddy)
                order += 1
            self._free_order[off] = order

    def _take_range(self, start: int, end: int) -> None:
        """Remove [start, end) from the free blocks; ``start`` begins a free block.

        A free run is tiled by free blocks, so walking block by block from ``start``
        stays inside free space; only the last block can overhang ``end``, and its
        overhang goes back as aligned pieces.
        """
        pos = start
        while pos < end:
            block_end = pos + (1 << self._free_order.pop(pos))
            if block_end > end:
                self._release_range(end, block_end)
            pos = block_end

    # -- runs (caller holds the lock) --------------------------------------------------

    def _add_run(self, start: int, end: int) -> None:
        self._run_end[start] = end
        self._run_start[end] = start
        length = end - start
        same_length = self._runs_by_length.get(length)
        if same_length is None:
            same_length = self._runs_by_length[length] = _LowestSet()
            bisect.insort(self._run_lengths, length)
        same_length.add(start)

    def _remove_run(self, start: int) -> int:
        end = self._run_end.pop(start)
        del self._run_start[end]
        length = end - start
        same_length = self._runs_by_length[length]
        same_length.remove(start)
        if not same_length:
            del self._runs_by_length[length]
            del self._run_lengths[bisect.bisect_left(self._run_lengths, length)]
        return end

    def _find_run(self, units: int) -> int | None:
        """The start of the run to carve ``units`` from, or None if none is long enough."""
        i = bisect.bisect_left(self._run_lengths, units)
        if i == len(self._run_lengths):
            return None
        return self._runs_by_length[self._run_lengths[i]].lowest()

    def _largest_run_units(self) -> int:
        return self._run_lengths[-1] if self._run_lengths else 0

    def _free_bytes_locked(self) -> int:
        return (self._capacity_units - self._used_units) * self._unit

    # -- public API --------------------------------------------------------------------

    def alloc(self, nbytes: int) -> int:
        """Reserve ``nbytes`` rounded up to ``min_block_bytes``; return the byte offset.

        Raises ``PoolExhausted`` when no contiguous free range that large exists.
        """
        try:
            nbytes = operator.index(nbytes)
        except TypeError:
            raise BadRequest(f"allocation size must be an integer, got {nbytes!r}") from None
        if nbytes <= 0:
            raise BadRequest(f"allocation size must be positive, got {nbytes}")
        units = -(-nbytes // self._unit)
        with self._lock:
            start = self._find_run(units)
            if start is None:
                raise PoolExhausted(
                    f"cannot allocate {nbytes} bytes ({units * self._unit} rounded): "
                    f"free {self._free_bytes_locked()} bytes, "
                    f"largest free block {self._largest_run_units() * self._unit} bytes"
                )
            end = self._remove_run(start)
            if start + units < end:
                self._add_run(start + units, end)
            self._take_range(start, start + units)
            self._allocs[start] = units
            self._used_units += units
            return start * self._unit

    def free(self, offset: int) -> None:
        """Give back an allocation returned by :meth:`alloc`; anything else is InvalidFree."""
        unit_off, rem = divmod(offset, self._unit)
        with self._lock:
            units = self._allocs.pop(unit_off, None) if rem == 0 else None
            if units is None:
                raise InvalidFree(f"offset {offset} is not a live allocation")
            self._used_units -= units
            start, end = unit_off, unit_off + units
            self._release_range(start, end)
            if start in self._run_start:
                start = self._run_start[start]
                self._remove_run(start)
            if end in self._run_end:
                end = self._remove_run(end)
            self._add_run(start, end)

    def size_of(self, offset: int) -> int:
        """The rounded size in bytes of the live allocation at ``offset``."""
        unit_off, rem = divmod(offset, self._unit)
        with self._lock:
            units = self._allocs.get(unit_off) if rem == 0 else None
        if units is None:
            raise BadRequest(f"offset {offset} is not a live allocation")
        return units * self._unit

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_units * self._unit

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used_units * self._unit

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes_locked()

    @property
    def largest_free_bytes(self) -> int:
        """The largest allocation that would succeed now (the longest free run)."""
        with self._lock:
            return self._largest_run_units() * self._unit

    @property
    def allocation_count(self) -> int:
        with self._lock:
            return len(self._allocs)

    def stats(self) -> dict[str, int]:
        """All occupancy figures in bytes, taken at one instant so they add up."""
        with self._lock:
            return {
                "capacity_bytes": self._capacity_units * self._unit,
                "used_bytes": self._used_units * self._unit,
                "free_bytes": self._free_bytes_locked(),
                "largest_free_bytes": self._largest_run_units() * self._unit,
            }

    def free_blocks(self) -> list[tuple[int, int]]:
        """Every free buddy block as sorted ``(offset_bytes, size_bytes)``."""
        with self._lock:
            return sorted(
                (off * self._unit, (1 << order) * self._unit)
                for off, order in self._free_order.items()
            )

    def allocations(self) -> list[tuple[int, int]]:
        """Every live allocation as sorted ``(offset_bytes, size_bytes)``."""
        with self._lock:
            return sorted((off * self._unit, n * self._unit) for off, n in self._allocs.items())

    def top_level_blocks(self) -> list[tuple[int, int]]:
        """The pool's fixed decomposition as sorted ``(offset_bytes, size_bytes)``."""
        return sorted(
            (off * self._unit, (1 << order) * self._unit) for off, order in self._top_level.items()
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the internal state is inconsistent.

        Checks that free blocks and live allocations tile the pool exactly, that no
        two free buddies were left unmerged (together: the free blocks are the maximal
        merge of the free space), and that the run index matches the free blocks.
        """
        with self._lock:
            spans: list[tuple[int, int, bool]] = []  # (start, length, is_free)
            for off, order in self._free_order.items():
                if off % (1 << order):
                    raise AssertionError(f"free block {off} misaligned for order {order}")
                if self._top_level.get(off) != order:
                    buddy = off ^ (1 << order)
                    if self._free_order.get(buddy) == order:
                        raise AssertionError(f"free buddies {off}, {buddy} (order {order})")
                spans.append((off, 1 << order, True))
            spans.extend((off, n, False) for off, n in self._allocs.items())
            spans.sort()
            runs: dict[int, int] = {}
            pos, run_start = 0, None
            for off, length, is_free in spans:
                if off != pos:
                    what = "overlaps" if off < pos else "leaves a gap before"
                    raise AssertionError(f"block at unit {off} {what} unit {pos}")
                if is_free and run_start is None:
                    run_start = off
                elif not is_free and run_start is not None:
                    runs[run_start], run_start = off, None
                pos = off + length
            if run_start is not None:
                runs[run_start] = pos
            if pos != self._capacity_units:
                raise AssertionError(f"blocks cover {pos} units of {self._capacity_units}")
            if self._used_units != sum(self._allocs.values()):
                raise AssertionError("used counter disagrees with live allocations")
            if runs != self._run_end:
                raise AssertionError(f"run index {self._run_end} != free runs {runs}")
            if self._run_start != {e: s for s, e in runs.items()}:
                raise AssertionError("run end index disagrees with runs")
            by_length: dict[int, set[int]] = {}
            for start, end in runs.items():
                by_length.setdefault(end - start, set()).add(start)
            if {n: set(m) for n, m in self._runs_by_length.items()} != by_length:
                raise AssertionError("runs filed under the wrong length")
            if self._run_lengths != sorted(by_length):
                raise AssertionError(f"run lengths {self._run_lengths} != {sorted(by_length)}")
