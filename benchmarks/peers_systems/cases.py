"""What a benchmark case moves, computed the same way in every process: the bytes of each
side, the pieces (source offset, destination offset, length) and the pattern whose arrival
the receiver checks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KiB, MiB, GiB = 2**10, 2**20, 2**30
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SLICE_BYTES = 64 * MiB  # what fill and check hold of a pattern at once


@dataclass(frozen=True)
class Case:
    """``contig``: one buffer of ``nbytes`` moved whole. ``paged``: ``tensors`` tensors of
    ``blocks`` blocks of ``block`` bytes each side; the same ``pick`` random source blocks
    of every tensor go to ``pick`` random destination blocks (one block table for all
    layers, as in a paged KV cache)."""

    label: str
    kind: str  # "contig" | "paged"
    nbytes: int  # payload moved per transfer
    tensors: int = 1
    blocks: int = 1
    block: int = 0
    pick: int = 0
    seed: int = 0

    @classmethod
    def contig(cls, label: str, nbytes: int) -> Case:
        return cls(label, "contig", nbytes, 1, 1, nbytes, 1)

    @classmethod
    def paged(cls, label: str, tensors: int, blocks: int, block: int, pick: int,
              seed: int = 7) -> Case:
        return cls(label, "paged", tensors * pick * block, tensors, blocks, block, pick, seed)

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Case:
        return cls(**d)  # type: ignore[arg-type]

    @property
    def side_bytes(self) -> int:
        """Bytes of one side's buffer: all tensors, laid out one after another."""
        return self.tensors * self.blocks * self.block

    def block_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The source and destination block ids within each tensor."""
        if self.kind == "contig":
            return np.zeros(1, np.int64), np.zeros(1, np.int64)
        rng = np.random.default_rng(self.seed)
        return (rng.choice(self.blocks, self.pick, replace=False).astype(np.int64),
                rng.choice(self.blocks, self.pick, replace=False).astype(np.int64))

    def pieces(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Source and destination byte offsets into one side's buffer, and the length of
        each piece (all pieces are one block long)."""
        src, dst = self.block_ids()
        base = (np.arange(self.tensors, dtype=np.int64) * self.blocks)[:, None]
        return ((base + src[None, :]).ravel() * self.block,
                (base + dst[None, :]).ravel() * self.block, self.block)


def pattern(offset: int, nbytes: int, seed: int) -> np.ndarray:
    """Bytes [offset, offset + nbytes) of the pattern of ``seed`` (both multiples of 8): word
    i of a side is (i + 1) * golden + seed, so each word and each seed differ."""
    first = offset // 8
    words = np.arange(first + 1, first + nbytes // 8 + 1, dtype=np.uint64)
    words *= GOLDEN
    words += np.uint64(seed)
    return words.view(np.uint8)


def fill(buf: np.ndarray, seed: int, offset: int = 0) -> None:
    """Write the pattern of ``seed`` into a uint8 buffer (a multiple of 8 bytes) that holds
    a side's bytes from ``offset`` on; ``SLICE_BYTES`` at a time."""
    for at in range(0, len(buf), SLICE_BYTES):
        n = min(SLICE_BYTES, len(buf) - at)
        buf[at:at + n] = pattern(offset + at, n, seed)


def check(case: Case, dst: np.ndarray | Sequence[np.ndarray], seed: int) -> str:
    """'' when every piece of ``dst`` (one side's buffer, or its tensors' buffers, in
    order) holds what the source's pattern of ``seed`` has at that piece's source offset,
    else what differs. Compared ``SLICE_BYTES`` at a time: a check holds no copy of a side
    (five systems' paged cases, 10 GiB, leave little else on a small machine)."""
    parts = [dst] if isinstance(dst, np.ndarray) else list(dst)
    per = case.side_bytes // len(parts)  # (a piece lies within one tensor)
    s_off, d_off, length = case.pieces()
    bad, first_bad = 0, -1
    for s, d in zip(s_off.tolist(), d_off.tolist(), strict=True):
        part, at = parts[d // per], d % per
        for k in range(0, length, SLICE_BYTES):
            n = min(SLICE_BYTES, length - k)
            if not np.array_equal(part[at + k:at + k + n], pattern(s + k, n, seed)):
                bad += 1
                first_bad = d if first_bad < 0 else first_bad
                break
    if bad:
        return (f"{case.label}: {bad} of {len(s_off)} pieces differ from the source "
                f"(first at destination offset {first_bad})")
    return ""
