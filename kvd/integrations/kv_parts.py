"""How a request's blocks are counted and cut into parts, and what key each part goes under.

Prefill and decode compute this alike from the same numbers, so that decode knows which
keys to wait for without being told each one.
"""

from __future__ import annotations

import math


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) if tokens > 0 else 0


def part_ranges(num_blocks: int, part_blocks: int) -> list[tuple[int, int]]:
    """How a request of ``num_blocks`` is cut into parts of ``part_blocks`` (0: one part);
    both ends compute it the same way."""
    if part_blocks <= 0 or num_blocks <= part_blocks:
        return [(0, num_blocks)]
    return [(lo, min(lo + part_blocks, num_blocks)) for lo in range(0, num_blocks, part_blocks)]


def part_key(key: str, index: int, count: int) -> str:
    return key if count == 1 else f"{key}#p{index}"
