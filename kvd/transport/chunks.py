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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvd.memory.regions import Layout, packed_offsets


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


def plan_chunks(layout: Layout, num_blocks: int, chunk_bytes: int) -> list[Chunk]:
    """Cut the wire bytes of ``num_blocks`` blocks of ``layout`` into chunks; both ends of
    a transfer compute the same plan."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    chunks: list[Chunk] = []
    segments: list[Segment] = []
    used = done = 0
    for t, entry in enumerate(layout):
        bpb = entry.bytes_per_block
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
    return chunks


def largest_chunk(chunks: Sequence[Chunk]) -> int:
    return max((c.nbytes for c in chunks), default=0)


@dataclass(eq=False)
class BlockSet:
    """Blocks ``ids`` of every tensor in ``tensors`` (block dimension first): one end's
    memory for a transfer, in wire order."""

    tensors: Sequence[torch.Tensor]
    ids: list[int]
    _ids_on: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    _rows: tuple[torch.Tensor, torch.Tensor, int] | bool | None = field(default=False,
                                                                      repr=False)
    _span: tuple[int, int] = (0, 0)

    @classmethod
    def packed(cls, buf: torch.Tensor, layout: Layout, num_blocks: int) -> BlockSet:
        """The sections of a packed uint8 buffer (``memory.regions.packed_offsets``)."""
        offsets, _ = packed_offsets(layout, num_blocks)
        tensors = [buf[off : off + e.bytes_per_block * num_blocks].view(num_blocks,
                                                                         e.bytes_per_block)
                   for off, e in zip(offsets, layout, strict=True)]
        return cls(tensors, list(range(num_blocks)))

    def ids_on(self, device: torch.device) -> torch.Tensor:
        found = self._ids_on.get(device)
        if found is None:
            found = torch.tensor(self.ids, dtype=torch.long, device=device)
            self._ids_on[device] = found
        return found

    def _run(self, seg: Segment) -> int | None:
        """The first block id if the segment's blocks are consecutive ids, else None."""
        first = self.ids[seg.start]
        if self.ids[seg.stop - 1] - first != seg.stop - 1 - seg.start:
            return None
        if all(self.ids[p + 1] == self.ids[p] + 1 for p in range(seg.start, seg.stop - 1)):
            return first
        return None

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
        piece = t[first : first + seg.stop - seg.start]
        if not piece.is_contiguous():
            return None
        return piece.reshape(-1).view(torch.uint8)

    def _row_view(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """One gather (or scatter) for a whole chunk, whatever tensors it spans.

        Launching a copy per tensor costs ~30 us of CPU each on some hosts, more than the
        GPU needs for the bytes, so for GPU memory we build one uint8 view of the address
        span that holds every tensor, cut into rows of R bytes (R divides every block's
        size and offset), and the row index of every wire row. A chunk is then one
        ``index_select`` (or ``index_copy_``) of rows; the holes between the tensors are
        never touched. Returns (rows view, row index in wire order, R), or None when the
        memory does not allow it (host memory, mixed devices, blocks not contiguous)."""
        if self._rows is not False:
            return self._rows  # type: ignore[return-value]
        self._rows = None
        ts = self.tensors
        if not ts or not self.ids or any(
                not t.is_cuda or t.device != ts[0].device or len(t) == 0
                or not t[0].is_contiguous() for t in ts):
            return None
        block = ts[0][0].numel() * ts[0].element_size()
        stride = ts[0].stride(0) * ts[0].element_size()
        if any(t[0].numel() * t.element_size() != block
               or t.stride(0) * t.element_size() != stride for t in ts):
            return None  # the index is built with a few ops only when tensors are alike
        base = min(t.data_ptr() for t in ts)
        end = max(t.data_ptr() for t in ts) + stride * (max(len(t) for t in ts) - 1) + block
        row = 4096
        while row >= 256 and (block % row or stride % row
                              or any((t.data_ptr() - base) % row for t in ts)):
            row //= 2
        if row < 256:
            return None
        dev = ts[0].device
        span = torch.as_tensor(_CudaSpan(base, (end - base) // row, row), device=dev)
        firsts = torch.tensor([(t.data_ptr() - base) // row for t in ts], device=dev)
        index = (firsts[:, None, None] + self.ids_on(dev)[None, :, None] * (stride // row)
                 + torch.arange(block // row, device=dev)[None, None, :]).reshape(-1)
        self._rows = (span, index, row)
        self._span = (base, end)
        return self._rows

    def _rows_for(self, staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The row view, unless ``staging`` lies inside the span (torch refuses copies
        between overlapping tensors)."""
        rows = self._row_view() if staging.is_cuda else None
        if rows is None:
            return None
        lo, hi = self._span
        ptr = staging.data_ptr()
        if ptr < hi and ptr + staging.numel() > lo:
            return None
        return rows

    def _section(self, staging: torch.Tensor, seg: Segment) -> torch.Tensor:
        t = self.tensors[seg.tensor]
        raw = staging[seg.offset : seg.offset + seg.nbytes]
        return raw.view(t.dtype).view(seg.stop - seg.start, *t.shape[1:])

    def load(self, chunk: Chunk, staging: torch.Tensor) -> torch.Tensor:
        """Gather the chunk's blocks into ``staging`` (uint8, at least chunk.nbytes)."""
        rows = self._rows_for(staging)
        if rows is not None and len(chunk.segments) > 1:
            span, index, r = rows
            out = staging[: chunk.nbytes].view(-1, r)
            torch.index_select(span, 0, index[chunk.wire_offset // r :][: len(out)], out=out)
            return staging[: chunk.nbytes]
        for seg in chunk.segments:
            t = self.tensors[seg.tensor]
            out = self._section(staging, seg)
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
        rows = self._rows_for(staging)
        if rows is not None and len(chunk.segments) > 1:
            span, index, r = rows
            src = staging[: chunk.nbytes].view(-1, r)
            span.index_copy_(0, index[chunk.wire_offset // r :][: len(src)], src)
            return
        for seg in chunk.segments:
            t = self.tensors[seg.tensor]
            src = self._section(staging, seg)
            first = self._run(seg)
            if first is not None:
                t[first : first + seg.stop - seg.start].copy_(src, non_blocking=True)
            else:
                ids = self.ids_on(t.device)[seg.start : seg.stop]
                t.index_copy_(0, ids, src if src.device == t.device else src.to(t.device))


class _CudaSpan:
    """``__cuda_array_interface__`` of a [rows, R] uint8 array at an address: lets torch
    view device memory it did not allocate (the owner keeps it alive)."""

    def __init__(self, ptr: int, rows: int, row_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (rows, row_bytes), "typestr": "|u1", "data": (ptr, False),
            "version": 3, "strides": None}
