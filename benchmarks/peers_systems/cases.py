"""What a benchmark case moves, computed the same way in every process: the bytes of each
side, the pieces (source offset, destination offset, length) and the pattern whose arrival
the receiver checks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KiB, MiB, GiB = 2**10, 2**20, 2**30
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


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


def fill(buf: np.ndarray, seed: int) -> None:
    """Write the pattern of ``seed`` into a uint8 buffer (a multiple of 8 bytes): word i is
    (i + 1) * golden + seed, so each word and each seed differ."""
    words = buf.view(np.uint64)
    np.multiply(np.arange(1, len(words) + 1, dtype=np.uint64), GOLDEN, out=words)
    words += np.uint64(seed)


def check(case: Case, dst: np.ndarray, seed: int) -> str:
    """'' when every piece of ``dst`` holds what the source's pattern of ``seed`` has at
    that piece's source offset, else what differs."""
    src = np.empty(case.side_bytes, np.uint8)
    fill(src, seed)
    s_off, d_off, length = case.pieces()
    s_blocks = src.reshape(-1, length)[s_off // length]
    d_blocks = dst[:case.side_bytes].reshape(-1, length)[d_off // length]
    bad = np.flatnonzero((s_blocks != d_blocks).any(axis=1))
    if len(bad):
        return (f"{case.label}: {len(bad)} of {len(s_off)} pieces differ from the source "
                f"(first at destination offset {int(d_off[bad[0]])})")
    return ""
