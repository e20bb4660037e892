"""Regions: a client's tensors, mapped into the daemon once, addressed by block.

A region is a list of tensors that share one block count along a block dimension (for a
model: one tensor per layer, K and V). The daemon keeps each tensor as a view with the
block dimension moved to the front, so block ``b`` of every tensor is ``t[b]``.

The *layout* of a region is, per tensor, the bytes of one block and the dtype. Two regions
(or a stored key and a region) are compatible when their layouts are equal; a mismatch is a
``LayoutMismatch`` naming both, never a silent reinterpretation.

CPU tensors arrive as segments (``protocol.ShmTensor``): memfds the client handed over as
file descriptors (daemon/lifelines.py), sealed so that they can never shrink under
the daemon's mapping; a spec names one of its session's segments by id, so a client
cannot make the daemon map anything it did not hand over. GPU tensors (CUDA IPC) are
another kind of spec, mapped by the same ``build_region_tensors``.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

import numpy as np
import torch

from kvd.errors import BadRequest, LayoutMismatch
from kvd.memory.segments import check_segment
from kvd.protocol import (
    WHOLE,
    CudaIpcTensor,
    DType,
    LayoutEntry,
    Part,
    ShmTensor,
    TensorSpec,
)

# Block ids inside the daemon: a 1-D int64 array (what torch indexes with).
IdArray = np.ndarray[Any, np.dtype[np.int64]]
# Up to this many ids, checks run in Python on a list: each numpy call on a small array
# costs several microseconds in a daemon woken between transfers (py-spy on the GPU host
# put the numpy checks of a one-block transfer at ~30 us).
FEW_IDS = 64

# Sections of a packed buffer start on this boundary so that every dtype view is aligned.
PACK_ALIGN_BYTES = 64

# The wire's dtype names are torch's own.
_DTYPES: dict[DType, torch.dtype] = {name: getattr(torch, name) for name in get_args(DType)}
DTYPE_NAMES: dict[torch.dtype, DType] = {v: k for k, v in _DTYPES.items()}


# torch has no CPU index_copy_ for its one-byte floats (FP8 KV caches): copies move their
# bits as bytes.
_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as what a block copy may move: its bytes for an FP8 tensor, else itself."""
    return t.view(torch.uint8) if t.dtype in _BYTE_FLOATS else t


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]  # type: ignore[index]
    except KeyError:
        raise BadRequest(f"unsupported dtype {name!r}") from None


Layout = tuple[LayoutEntry, ...]


def describe_layout(layout: Layout) -> str:
    parts = [f"{e.bytes_per_block}B {e.dtype}" for e in layout[:4]]
    more = f", … ({len(layout)} tensors)" if len(layout) > 4 else ""
    return "[" + ", ".join(parts) + more + "]"


def packed_offsets(layout: Layout, num_blocks: int) -> tuple[list[int], int]:
    """Byte offset of each tensor's section in a packed buffer of ``num_blocks`` blocks,
    and the total size. Sections are tensor-major: all blocks of tensor 0, then tensor 1."""
    offsets = []
    pos = 0
    for entry in layout:
        offsets.append(pos)
        pos += entry.bytes_per_block * num_blocks
        pos = -(-pos // PACK_ALIGN_BYTES) * PACK_ALIGN_BYTES
    return offsets, pos


def part_layout(layout: Layout, part: Part) -> Layout:
    """The layout of ``part`` of each block; empty when some block does not divide."""
    if part == WHOLE:
        return layout
    if any(e.bytes_per_block % (part.count * torch_dtype(e.dtype).itemsize) for e in layout):
        return ()  # (a part is whole elements of its dtype)
    return tuple(LayoutEntry(e.bytes_per_block // part.count, e.dtype) for e in layout)


def part_of_blocks(tensors: Sequence[torch.Tensor], layout: Layout, part: Part,
                   what: str) -> tuple[list[torch.Tensor], Layout]:
    """``part`` of every block of each tensor (block dimension first): views, and their
    layout. Each block must be one contiguous run that the part's count divides into whole
    elements; ``what`` names the memory in the error if not."""
    if part == WHOLE:
        return list(tensors), layout
    views = []
    for i, (t, entry) in enumerate(zip(tensors, layout, strict=True)):
        per_block = t[0].numel() if len(t) else 0
        if not block_contiguous(t) or per_block % part.count:
            raise BadRequest(f"{what}: tensor {i}'s blocks cannot be cut into {part.count} "
                             f"parts ({per_block} {entry.dtype} elements each, "
                             f"{'' if block_contiguous(t) else 'not '}contiguous)")
        size = per_block // part.count
        flat = t.as_strided((t.shape[0], per_block), (t.stride(0), 1))
        views.append(flat[:, part.index * size:(part.index + 1) * size])
    return views, part_layout(layout, part)


def block_contiguous(t: torch.Tensor) -> bool:
    """Each block (``t[i]``) is one contiguous range: checked on the strides, without
    making a view (a view costs microseconds, per tensor, per transfer)."""
    expected = 1
    for dim in range(t.dim() - 1, 0, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            return False
        expected *= t.shape[dim]
    return True


def _extent_elements(shape: Sequence[int], stride: Sequence[int]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))


class _ShmMapping:
    """One mapped segment; stays alive while any tensor view uses it."""

    def __init__(self, segment: int, fd: int, stated_bytes: int) -> None:
        self.path = f"segment {segment}"  # what messages call it
        self.nbytes = check_segment(fd)  # (sealed: it stays this size)
        if stated_bytes != self.nbytes:
            raise BadRequest(f"segment {segment} holds {self.nbytes} bytes, not "
                             f"{stated_bytes}")
        try:
            self.mm = mmap.mmap(fd, self.nbytes)
        except OSError as exc:
            raise BadRequest(f"cannot map segment {segment}: {exc.strerror}") from None
        self.storage = torch.frombuffer(self.mm, dtype=torch.uint8).untyped_storage()

    def tensor(self, spec: ShmTensor) -> torch.Tensor:
        dtype = torch_dtype(spec.dtype)
        itemsize = dtype.itemsize
        if len(spec.shape) != len(spec.stride):
            raise BadRequest("tensor shape and stride have different lengths")
        if spec.offset_bytes % itemsize:
            raise BadRequest(f"tensor offset {spec.offset_bytes} is not aligned to {spec.dtype}")
        end = spec.offset_bytes + _extent_elements(spec.shape, spec.stride) * itemsize
        if end > self.nbytes:
            raise BadRequest(
                f"tensor extends to byte {end} but {self.path} holds {self.nbytes} bytes"
            )
        t = torch.empty(0, dtype=dtype)
        t.set_(self.storage, spec.offset_bytes // itemsize, spec.shape, spec.stride)
        return t

    def close(self) -> None:
        self.storage = None  # type: ignore[assignment]
        # Views handed to in-flight copies keep the map alive; closing then is refused,
        # and the map goes when its last view does.
        with contextlib.suppress(BufferError):
            self.mm.close()


@dataclass
class Region:
    region_id: int
    name: str
    owner: int
    tensors: list[torch.Tensor]  # block dimension first
    num_blocks: int
    layout: Layout
    mappings: list[Any] = field(default_factory=list, repr=False)
    # (device, event): the client's interprocess events; reads of the region wait for them
    ready_events: list[Any] = field(default_factory=list, repr=False)
    _parts: dict[Part, Region] = field(default_factory=dict, repr=False)

    def part(self, part: Part) -> Region:
        """The region seen as ``part`` of each of its blocks: the same region (its id, its
        holds and its events) with views of its tensors. Made once per part."""
        if part == WHOLE:
            return self
        found = self._parts.get(part)
        if found is None:
            tensors, layout = part_of_blocks(self.tensors, self.layout, part,
                                             f"region {self.name!r}")
            found = Region(self.region_id, self.name, self.owner, tensors, self.num_blocks,
                           layout, self.mappings, self.ready_events)
            self._parts[part] = found
        return found

    @property
    def on_gpu(self) -> bool:
        return any(t.is_cuda for t in self.tensors)

    @property
    def bytes_per_block(self) -> int:
        return sum(e.bytes_per_block for e in self.layout)

    def block_index(self, ids: IdArray, *, writing: bool) -> torch.Tensor:
        """Validated block ids (int64, as ``protocol._WithBlocks.ids`` gives them) as an
        index tensor sharing their memory. Many ids are checked with numpy (a Python loop
        over 1024 ids cost tens of microseconds on every request's critical path), a few
        in Python (``FEW_IDS``)."""
        n = len(ids)
        if not n:
            raise BadRequest("no blocks given")
        if n <= FEW_IDS:  # numpy's per-call cost exceeds the work on a few ids
            listed = ids.tolist()
            bad = [b for b in listed if b < 0 or b >= self.num_blocks]
            repeats = writing and len(set(listed)) != n
        else:
            bad = (ids[(ids < 0) | (ids >= self.num_blocks)].tolist()
                   if ids.min() < 0 or ids.max() >= self.num_blocks else [])
            # Ids in increasing order (the usual case) cannot repeat; others are sorted.
            repeats = writing and not (np.diff(ids) > 0).all() and len(np.unique(ids)) != n
        if bad:
            raise BadRequest(
                f"block {bad[0]} out of range for region {self.name!r} ({self.num_blocks} blocks)"
            )
        if repeats:
            raise BadRequest("destination blocks repeat a block id")
        return torch.from_numpy(ids)


def _build_tensors(
    specs: Sequence[TensorSpec], block_dim: int, segments: Mapping[int, int],
    maps: dict[int, _ShmMapping], events: dict[bytes, Any],
) -> list[torch.Tensor]:
    tensors = []
    for i, spec in enumerate(specs):
        if len(spec.shape) <= block_dim:
            raise BadRequest(f"tensor {i} has {len(spec.shape)} dims, block_dim is {block_dim}")
        if isinstance(spec, CudaIpcTensor):
            from kvd.memory.cuda_ipc import open_cuda_tensor, open_ready_event

            tensors.append(open_cuda_tensor(spec, torch_dtype(spec.dtype)).movedim(block_dim, 0))
            if spec.ready_event and spec.ready_event not in events:
                events[spec.ready_event] = open_ready_event(spec)
            continue
        mapping = maps.get(spec.segment)
        if mapping is None:
            fd = segments.get(spec.segment)
            if fd is None:
                raise BadRequest(
                    f"tensor {i}: segment {spec.segment} was not handed to this daemon "
                    "(CPU tensors come from kvd.shared_empty, registered by the client "
                    "library, which hands their segments over first)")
            mapping = maps[spec.segment] = _ShmMapping(spec.segment, fd, spec.file_bytes)
        tensors.append(mapping.tensor(spec).movedim(block_dim, 0))
    return tensors


def build_region_tensors(
    name: str, specs: Sequence[TensorSpec], block_dim: int,
    segments: Mapping[int, int] | None = None,
) -> tuple[list[torch.Tensor], dict[int, _ShmMapping], list[Any]]:
    """Map a region's tensors (``segments``: the session's segment descriptors by id; and
    open its clients' CUDA events) and check they share one block count. No shared state
    but reads of ``segments``: safe in a thread (CUDA IPC can take a while)."""
    maps: dict[int, _ShmMapping] = {}
    events: dict[bytes, Any] = {}
    try:
        tensors = _build_tensors(specs, block_dim, segments or {}, maps, events)
        num_blocks = tensors[0].shape[0]
        for i, t in enumerate(tensors):
            if t.shape[0] != num_blocks:
                raise LayoutMismatch(
                    f"region {name!r}: tensor {i} has {t.shape[0]} blocks along dim "
                    f"{block_dim}, tensor 0 has {num_blocks}"
                )
    except BaseException:
        for m in maps.values():
            m.close()
        raise
    return tensors, maps, list(events.values())


class RegionTable:
    """Every registered region, by id and by (owner, name). Owned by the event loop."""

    def __init__(self) -> None:
        self._by_id: dict[int, Region] = {}
        self._by_name: dict[tuple[int, str], int] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def check_name(self, owner: int, name: str) -> None:
        if (owner, name) in self._by_name:
            raise BadRequest(f"region {name!r} is already registered by this client")

    def add(self, owner: int, name: str, tensors: list[torch.Tensor],
            maps: dict[int, _ShmMapping], ready_events: list[Any] | None = None) -> Region:
        """Record a region whose tensors ``build_region_tensors`` made (on the loop)."""
        self.check_name(owner, name)
        num_blocks = tensors[0].shape[0]
        layout = tuple(LayoutEntry((t[0].numel() if num_blocks else 0) * t.element_size(),
                                   DTYPE_NAMES[t.dtype]) for t in tensors)
        region = Region(self._next_id, name, owner, tensors, num_blocks, layout,
                        list(maps.values()), ready_events or [])
        self._next_id += 1
        self._by_id[region.region_id] = region
        self._by_name[(owner, name)] = region.region_id
        return region

    def get(self, owner: int, region_id: int) -> Region:
        region = self._by_id.get(region_id)
        if region is None or region.owner != owner:
            raise BadRequest(f"unknown region id {region_id}")
        return region

    def remove(self, region: Region) -> None:
        self._by_id.pop(region.region_id, None)
        self._by_name.pop((region.owner, region.name), None)
        region.tensors = []
        for m in region.mappings:
            m.close()
        region.mappings = []

    def owned_by(self, owner: int) -> list[Region]:
        return [r for r in self._by_id.values() if r.owner == owner]
