"""Blocks cut into wire chunks, for transports that move whole messages (NCCL).

A transfer's bytes are, on the wire, tensor-major: every requested block of tensor 0, then
of tensor 1, and so on (see ``transport.views``). NCCL pairs each send with a recv of the
same size, so both ends must cut that byte stream at the same places without talking about
it: ``plan_chunks`` does it from what both ends know — the layout, the block count and the
chunk size. A chunk is a list of *segments* (tensor, a range of positions in the block
list); blocks are never split, so a chunk is at most ``max(chunk_bytes, one block)``.

Each end then maps a chunk onto its own memory, which may differ from the other end's: if
the chunk is one run of consecutive blocks of one block-contiguous tensor it is sent from
(or received into) that memory directly; otherwise it is gathered into a staging buffer
(``load``) or scattered out of one (``store``), one copy per segment (a slice copy for a
run of consecutive blocks, ``index_select`` / ``index_copy_`` otherwise).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvd.errors import TransferFailed
from kvd.memory.regions import FEW_IDS, IdArray, Layout, bits, packed_offsets
from kvd.transport import gpu_copy
from kvd.transport.gpu_copy import BlockMap
from kvd.transport.views import block_views, packed_views


@dataclass(frozen=True, slots=True)
class Segment:
    tensor: int  # which tensor of the layout
    start: int  # positions [start, stop) in the block list
    stop: int
    offset: int  # where the segment's bytes start within its chunk
    nbytes: int


@dataclass(frozen=True, slots=True)
class Chunk:
    segments: tuple[Segment, ...]
    nbytes: int
    wire_offset: int = 0  # where the chunk starts in the transfer's bytes


def plan_chunks(layout: Layout, num_blocks: int, chunk_bytes: int) -> tuple[Chunk, ...]:
    """Cut the wire bytes of ``num_blocks`` blocks of ``layout`` into chunks; both ends of
    a transfer compute the same plan. Remembered: the same layouts and block counts come
    back with every transfer, and a plan of 64 tensors takes ~70 us of Python to make."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    return _plan(tuple(e.bytes_per_block for e in layout), num_blocks, chunk_bytes)


@functools.lru_cache(maxsize=256)
def _plan(per_block: tuple[int, ...], num_blocks: int, chunk_bytes: int) -> tuple[Chunk, ...]:
    chunks: list[Chunk] = []
    segments: list[Segment] = []
    used = done = 0
    for t, bpb in enumerate(per_block):
        if bpb == 0:
            continue
        pos = 0
        while pos < num_blocks:
            room = max(0, chunk_bytes - used) // bpb
            if room == 0 and used == 0:
                room = 1  # a block larger than a chunk travels alone
            if room == 0:
                chunks.append(Chunk(tuple(segments), used, done))
                segments, done, used = [], done + used, 0
                continue
            take = min(room, num_blocks - pos)
            segments.append(Segment(t, pos, pos + take, used, take * bpb))
            used += take * bpb
            pos += take
    if segments:
        chunks.append(Chunk(tuple(segments), used, done))
    return tuple(chunks)


def largest_chunk(chunks: Sequence[Chunk]) -> int:
    return max((c.nbytes for c in chunks), default=0)


@dataclass(eq=False)
class BlockSet:
    """Blocks ``ids`` of every tensor in ``tensors`` (block dimension first): one end's
    memory for a transfer, in wire order."""

    tensors: Sequence[torch.Tensor]
    ids: IdArray  # int64; anything else is converted (a list, in tests)
    _ids_on: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    _maps: dict[torch.device, BlockMap | None] = field(default_factory=dict, repr=False)
    _packed: tuple[torch.Tensor, Layout] | None = field(default=None, repr=False)
    _breaks: np.ndarray[Any, Any] | None = field(default=None, repr=False)
    _consecutive: bool | None = field(default=None, repr=False)
    _direct: dict[tuple[int, torch.device], tuple[tuple[Chunk, ...], list[torch.Tensor | None]]
                  ] = field(default_factory=dict, repr=False)
    _flats: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # The daemon's ids come as int64 arrays (Region.block_index): no copy then.
        self.ids = np.asarray(self.ids, dtype=np.int64)

    @classmethod
    def packed(cls, buf: torch.Tensor, layout: Layout, num_blocks: int) -> BlockSet:
        """The sections of a packed uint8 buffer (``memory.regions.packed_offsets``)."""
        offsets, _ = packed_offsets(layout, num_blocks)
        tensors = [buf[off : off + e.bytes_per_block * num_blocks].view(num_blocks,
                                                                         e.bytes_per_block)
                   for off, e in zip(offsets, layout, strict=True)]
        return cls(tensors, np.arange(num_blocks, dtype=np.int64), _packed=(buf, layout))

    def views(self) -> list[memoryview]:
        """This memory as memoryviews in wire order, for a socket (host memory only):
        one per section of a packed buffer, else one per run of adjacent blocks."""
        if any(t.is_cuda for t in self.tensors):
            raise TransferFailed("GPU memory cannot be sent over TCP")
        if self._packed is not None:
            return packed_views(self._packed[0], self._packed[1], len(self.ids))
        return block_views(self.tensors, self.ids.tolist())

    def ids_on(self, device: torch.device) -> torch.Tensor:
        found = self._ids_on.get(device)
        if found is None:
            # non_blocking: a blocking upload from pageable memory waits for the current
            # stream's earlier work, which in a receive is the NCCL kernel (measured: 505 ms
            # behind a 0.5 s kernel, 0.2 ms non-blocking). The ids stay alive with self.
            found = torch.from_numpy(self.ids).to(device, non_blocking=True)
            self._ids_on[device] = found
        return found

    def consecutive(self) -> bool:
        """The ids are one run (n, n+1, ...); found once."""
        if self._consecutive is None:
            ids, n = self.ids, len(self.ids)
            if n <= FEW_IDS:  # see memory.regions.FEW_IDS
                listed = ids.tolist()
                self._consecutive = n > 0 and listed == list(range(listed[0], listed[0] + n))
            else:
                self._consecutive = int(ids[-1]) - int(ids[0]) == n - 1 \
                    and bool((np.diff(ids) == 1).all())
        return self._consecutive

    def one_run(self) -> bool:
        """Each tensor's blocks are consecutive ids of a block-contiguous tensor: the
        bytes can travel straight from (or into) this memory in one message per tensor."""
        if not self.consecutive():
            return False
        return all(gpu_copy.block_contiguous(t) and (
            len(self.ids) == 1 or t.stride(0) == math.prod(t.shape[1:])) for t in self.tensors)

    def _run(self, seg: Segment) -> int | None:
        """The first block id if the segment's blocks are consecutive ids, else None."""
        first = int(self.ids[seg.start])
        if int(self.ids[seg.stop - 1]) - first != seg.stop - 1 - seg.start:
            return None
        if self.consecutive():
            return first
        if self._breaks is None:
            # breaks[p]: how many positions before p do not continue a run. Found once per
            # transfer: then each segment's check is two lookups.
            steps = np.diff(self.ids) != 1
            self._breaks = np.concatenate(([0], np.cumsum(steps)))
        return first if self._breaks[seg.stop - 1] == self._breaks[seg.start] else None

    def direct_chunks(self, chunks: tuple[Chunk, ...], device: torch.device
                      ) -> list[torch.Tensor | None]:
        """``direct`` of each chunk of a plan, remembered: a get that waits finds them
        ahead of the transfer (``Engine.get``), so the receiver's first NCCL call does not
        wait for the ~50-80 us this takes in a daemon. Keyed by the plan's identity
        (``plan_chunks`` returns one object per plan; the entry keeps it alive)."""
        key = (id(chunks), device)
        found = self._direct.get(key)
        if found is None:
            found = (chunks, [self.direct(c, device) for c in chunks])
            self._direct[key] = found
        return found[1]

    def direct(self, chunk: Chunk, device: torch.device) -> torch.Tensor | None:
        """The chunk's bytes as one contiguous uint8 tensor of this memory on ``device``,
        when it is one run of one block-contiguous tensor (no staging copy needed)."""
        if len(chunk.segments) != 1:
            return None
        seg = chunk.segments[0]
        t = self.tensors[seg.tensor]
        if t.device != device:
            return None
        first = self._run(seg)
        if first is None:
            return None
        flat = self._flat(seg.tensor)
        if flat is not None:  # one slice per chunk (three view calls otherwise)
            start = first * (seg.nbytes // (seg.stop - seg.start))
            return flat[start : start + seg.nbytes]
        piece = t[first : first + seg.stop - seg.start]
        if not piece.is_contiguous():
            return None
        return piece.reshape(-1).view(torch.uint8)

    def _flat(self, tensor: int) -> torch.Tensor | None:
        """Tensor ``tensor`` as one flat uint8 view, if it is contiguous (block ``i``'s
        bytes are then at ``i * bytes_per_block``); made once per block set."""
        if tensor not in self._flats:
            t = self.tensors[tensor]
            self._flats[tensor] = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else None
        return self._flats[tensor]

    def block_map(self, device: torch.device) -> BlockMap | None:
        """The map for one-launch copies on ``device``, if the memory allows it (see
        ``transport.gpu_copy``); made on first need. Call it before queueing waits on the
        stream that will copy: making it uploads a few KiB."""
        if device.type != "cuda":
            return None
        if device not in self._maps:
            usable = gpu_copy.available() and gpu_copy.describable(self.tensors, device)
            self._maps[device] = BlockMap(self.tensors, self.ids, device) if usable else None
        return self._maps[device]

    def _one_launch(self, chunk: Chunk, staging: torch.Tensor, gather: bool,
                    on: torch.device | None = None) -> bool:
        found = self.block_map(on or staging.device)
        if found is None:
            return False
        head, tail = chunk.segments[0], chunk.segments[-1]
        first = found.piece_range(head.tensor, head.start, head.stop)[0]
        last = found.piece_range(tail.tensor, tail.start, tail.stop)[1]
        packed = staging.data_ptr() - chunk.wire_offset  # where wire byte 0 would be
        if gather:
            gpu_copy.copy(first, last, src=found, dst=packed)
        else:
            gpu_copy.copy(first, last, src=packed, dst=found)
        return True

    def _section(self, staging: torch.Tensor, seg: Segment, t: torch.Tensor) -> torch.Tensor:
        raw = staging[seg.offset : seg.offset + seg.nbytes]
        return raw.view(t.dtype).view(seg.stop - seg.start, *t.shape[1:])

    def load(self, chunk: Chunk, staging: torch.Tensor, on: torch.device | None = None
             ) -> torch.Tensor:
        """Gather the chunk's blocks into ``staging`` (uint8, at least chunk.nbytes).
        ``on``: the GPU whose kernel gathers, when ``staging`` is on another GPU that it
        may store into (``gpu_copy.peer_stores``); the blocks must be on ``on``."""
        if self._one_launch(chunk, staging, gather=True, on=on):
            return staging[: chunk.nbytes]
        if on is not None and on != staging.device:
            raise TransferFailed(f"no gather kernel on {on} for these blocks")
        for seg in chunk.segments:
            t = bits(self.tensors[seg.tensor])
            out = self._section(staging, seg, t)
            first = self._run(seg)
            if first is not None:
                out.copy_(t[first : first + seg.stop - seg.start], non_blocking=True)
            elif t.device == out.device:
                torch.index_select(t, 0, self.ids_on(t.device)[seg.start : seg.stop], out=out)
            else:
                out.copy_(t.index_select(0, self.ids_on(t.device)[seg.start : seg.stop]))
        return staging[: chunk.nbytes]

    def store(self, chunk: Chunk, staging: torch.Tensor) -> None:
        """Scatter a received chunk from ``staging`` into this memory's blocks."""
        if self._one_launch(chunk, staging, gather=False):
            return
        for seg in chunk.segments:
            t = bits(self.tensors[seg.tensor])
            src = self._section(staging, seg, t)
            first = self._run(seg)
            if first is not None:
                t[first : first + seg.stop - seg.start].copy_(src, non_blocking=True)
            else:
                ids = self.ids_on(t.device)[seg.start : seg.stop]
                t.index_copy_(0, ids, src if src.device == t.device else src.to(t.device))
