"""One kernel launch to gather, scatter or copy any number of GPU blocks.

Copying a chunk of KV blocks with one ``index_select`` per tensor costs a kernel launch per
tensor, and a launch costs 10-30 us of CPU on the H200 host we measure on: 64 tensors took
1.7 ms to gather 512 MiB, where the GPU needs 0.3 ms. This kernel runs one program per block
piece and copies 8-byte words: 512 MiB of 32 KiB blocks in 0.29 ms (1.8 TB/s), launched in
~25 us.

Each program computes its piece's address itself from a ``BlockMap``: per tensor its
address, bytes between blocks and bytes per piece, and the block ids — one small upload per
transfer. (A first version uploaded a table of every piece's address, built with numpy:
0.2-0.3 ms of CPU and a blocking copy per transfer, 0.7-1.4 ms on the critical path when
measured on the H200 host, because a pageable upload waits for the stream it is queued on.)

Written in Triton, which ships with CUDA builds of torch. Without Triton (or for memory a
map cannot describe: host memory, mixed devices, blocks that are not contiguous or not
8-byte aligned) the callers keep the per-tensor copies; ``available()`` says which.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvd.memory.regions import IdArray, block_contiguous
from kvd.memory.streams import current_stream
from kvd.memory.tensor_lists import PerTensorList

log = logging.getLogger(__name__)

PIECE_BYTES = 64 * 1024  # blocks larger than this are split so more SMs share them
WORD = 8
_kernel: Any = None
_checked = False
_launch_lock = threading.Lock()  # Triton compiles on a first launch; channel threads race


def available() -> bool:
    global _kernel, _checked
    if not _checked:
        _checked = True
        try:
            _kernel = _build()
        except Exception as exc:  # no triton, or no GPU support in it
            log.info("triton not usable (%r): GPU blocks are copied one tensor at a time",
                     exc)
            _kernel = None
    return _kernel is not None


def _build() -> Any:
    import triton
    import triton.language as tl

    # Integers that change from call to call are not specialised on: a new specialisation
    # would compile (about a second) in the middle of a transfer.
    @triton.jit(do_not_specialize=["src_base", "dst_base", "first", "T", "n", "k"])
    def copy_pieces(src_rows, src_ids, dst_rows, dst_ids, src_base, dst_base, first, T, n,
                    k, SRC_MAPPED: tl.constexpr, DST_MAPPED: tl.constexpr,
                    BLOCK: tl.constexpr):
        # Program i copies piece first + i: tensor t, block position p, piece j. A mapped
        # side finds the piece through its BlockMap, the other is a packed buffer at
        # base + the piece's wire offset. Rows (T each, per region): address, stride,
        # bytes per block of the tensors before t, piece bytes; ids: the n block ids.
        i = tl.program_id(0).to(tl.int64) + first
        per_tensor = n * k
        t = i // per_tensor
        r = i - t * per_tensor
        p = r // k
        j = r - p * k
        if SRC_MAPPED:
            piece = tl.load(src_rows + 3 * T + t)
            wire = n * tl.load(src_rows + 2 * T + t) + (p * k + j) * piece
            src = (tl.load(src_rows + t) + tl.load(src_ids + p) * tl.load(src_rows + T + t)
                   + j * piece)
        else:
            piece = tl.load(dst_rows + 3 * T + t)
            wire = n * tl.load(dst_rows + 2 * T + t) + (p * k + j) * piece
            src = src_base + wire
        if DST_MAPPED:
            dst = (tl.load(dst_rows + t) + tl.load(dst_ids + p) * tl.load(dst_rows + T + t)
                   + j * piece)
        else:
            dst = dst_base + wire
        words = piece // 8
        src_ptr = src.to(tl.pointer_type(tl.int64))
        dst_ptr = dst.to(tl.pointer_type(tl.int64))
        for start in range(0, words, BLOCK):
            w = start + tl.arange(0, BLOCK)
            mask = w < words
            tl.store(dst_ptr + w, tl.load(src_ptr + w, mask=mask), mask=mask)

    return copy_pieces


class BlockMap:
    """Blocks ``ids`` of ``tensors`` as the kernel reads them, on ``device``: the pieces in
    wire order (tensor-major, then block, then piece), each tensor's blocks cut into the same
    number ``k`` of pieces (1 when the tensors' block sizes do not split alike).

    What describes the tensors (``rows``) is made and uploaded once per region and device
    (``_Facts.rows_on``); a transfer uploads only its block ids. Making the whole table per
    transfer took ~30 us of numpy in a tight loop and, in a daemon, several times that on
    the sender's critical path (the staged sender's start, docs/architecture.md
    *Decisions*)."""

    def __init__(self, tensors: Any, ids: IdArray, device: torch.device) -> None:
        facts = _facts_of(tensors)
        described = facts.rows_on(device)
        self.rows, self.k = described.rows, described.k
        # Alive while its upload is queued (it shares the ids' memory).
        self._host = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        # Uploaded on whatever stream is current (a map may be made ahead, on the loop's
        # thread, while the transfer's offer is out); a copy on another stream waits for
        # ``ready``, which also follows the rows' upload.
        self.stream = current_stream(device) if device.type == "cuda" else None
        if self.stream is not None:
            upload = described.pending()
            if upload is not None:
                self.stream.wait_event(upload)
            self.ids = self._host.to(device, non_blocking=True)
            self.ready: torch.cuda.Event | None = recorded(self.stream)
        else:
            self.ids, self.ready = self._host, None
        self.num_tensors, self.num_blocks = len(facts.geometry), len(ids)
        self.nbytes = facts.block_bytes * len(ids)  # of all tensors' blocks ``ids``
        self.device = device

    def piece_range(self, tensor: int, start: int, stop: int) -> tuple[int, int]:
        """The pieces of blocks at positions [start, stop) of ``tensor``."""
        first = tensor * self.num_blocks
        return (first + start) * self.k, (first + stop) * self.k

    def pieces(self) -> int:
        return self.num_tensors * self.num_blocks * self.k


def copy(first: int, last: int, *, src: BlockMap | int, dst: BlockMap | int) -> None:
    """Pieces [first, last) from ``src`` to ``dst``, on the current stream of the mapped
    side's device: each side is a BlockMap, or the address of a packed buffer where the
    transfer's wire byte 0 would be. Maps of both sides must describe the same layout."""
    count = last - first
    if count <= 0:
        return
    maps = [m for m in (src, dst) if isinstance(m, BlockMap)]
    if not maps:
        raise ValueError("a copy needs a block map on at least one side")
    any_map = maps[0]
    stream = current_stream(any_map.device)
    for m in maps:
        if m.ready is not None and m.stream != stream:
            stream.wait_event(m.ready)
    src_mapped, dst_mapped = isinstance(src, BlockMap), isinstance(dst, BlockMap)
    args = (src.rows if isinstance(src, BlockMap) else any_map.rows,
            src.ids if isinstance(src, BlockMap) else any_map.ids,
            dst.rows if isinstance(dst, BlockMap) else any_map.rows,
            dst.ids if isinstance(dst, BlockMap) else any_map.ids,
            src if isinstance(src, int) else 0, dst if isinstance(dst, int) else 0,
            first, any_map.num_tensors, any_map.num_blocks, any_map.k)
    key = (src_mapped, dst_mapped, any_map.device.index)
    with _launch_lock, torch.cuda.device(any_map.device):  # Triton launches on the current one
        compiled = _compiled.get(key) if _direct_launch else None
        if compiled is not None:
            compiled.run(count, 1, 1, stream.cuda_stream, compiled.function,
                         compiled.packed_metadata, None, None, None,
                         *args, src_mapped, dst_mapped, _PROGRAM_WORDS)
        else:
            _compiled[key] = _kernel[(count,)](*args, SRC_MAPPED=src_mapped,
                                               DST_MAPPED=dst_mapped, BLOCK=_PROGRAM_WORDS)


# A variant's compiled kernel, as its first launch through Triton returned it, per (source
# mapped, destination mapped, GPU). Launching that directly takes 9.5 us of CPU on the
# H200 host, where Triton's JIT path (binding and specialising the arguments, finding the
# variant) takes 24.6 us, on every copy. The direct call is not Triton's documented API: it
# is used once warm_up has checked it moves the right bytes (Triton profiling hooks are
# not called on it).
_compiled: dict[tuple[bool, bool, int | None], Any] = {}
_direct_launch = False
_PROGRAM_WORDS = 2048  # 8-byte words each program moves per step


_peer_stores: dict[tuple[int, int], bool] = {}
_peer_lock = threading.Lock()


def peer_stores(src: torch.device, dst: torch.device) -> bool:
    """Whether a kernel on GPU ``src`` may store into memory this process allocated on GPU
    ``dst`` (NVLink stores): enables peer access once, through the driver API, and
    remembers the answer. Memory another process shares by legacy CUDA IPC stays out of
    reach (it faults: see docs/architecture.md), so callers store only into their own
    buffers. False without cuda-bindings, or where the pair cannot reach each other."""
    key = (src.index or 0, dst.index or 0)
    with _peer_lock:
        found = _peer_stores.get(key)
        if found is None:
            found = _peer_stores[key] = _enable_peer_access(*key)
        return found


def _enable_peer_access(src: int, dst: int) -> bool:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return False
    ok = cu.CUresult.CUDA_SUCCESS
    torch.cuda.init()  # the primary contexts exist (torch made them)
    err, src_dev = cu.cuDeviceGet(src)
    err2, dst_dev = cu.cuDeviceGet(dst)
    if err != ok or err2 != ok:
        return False
    err, can = cu.cuDeviceCanAccessPeer(src_dev, dst_dev)
    if err != ok or not can:
        return False
    # Peer access is a property of the source's (primary) context: make it current for
    # the call, then put back whatever this thread had.
    _, before = cu.cuCtxGetCurrent()
    err, src_ctx = cu.cuDevicePrimaryCtxRetain(src_dev)
    err2, dst_ctx = cu.cuDevicePrimaryCtxRetain(dst_dev)
    try:
        if err != ok or err2 != ok:
            return False
        cu.cuCtxSetCurrent(src_ctx)
        (err,) = cu.cuCtxEnablePeerAccess(dst_ctx, 0)
    finally:
        cu.cuCtxSetCurrent(before)
        cu.cuDevicePrimaryCtxRelease(src_dev)
        cu.cuDevicePrimaryCtxRelease(dst_dev)
    enabled = err in (ok, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    if not enabled:
        log.info("peer access cuda:%d -> cuda:%d not enabled: %s", src, dst, err)
    return enabled


def recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event recorded now on ``stream``: later work (or a poll) can wait for it."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _geometry(t: torch.Tensor) -> tuple[int, int, int]:
    """(address, bytes per block, bytes between blocks) of a block-first tensor."""
    size = t.element_size()
    return t.data_ptr(), math.prod(t.shape[1:]) * size, t.stride(0) * size


@dataclass
class _Rows:
    rows: torch.Tensor
    k: int
    ready: torch.cuda.Event | None  # after the upload; None once it is known done
    host: torch.Tensor  # the upload's source, alive while it may be queued

    def pending(self) -> torch.cuda.Event | None:
        """The upload's event while a stream must still wait for it; None once it has been
        seen complete, so that no later map waits on it (a stream wait costs a few us per
        transfer). (Threads may race here: each gets the event or None, both right.)"""
        ready = self.ready
        if ready is not None and ready.query():
            self.ready = ready = None
        return ready


class _Facts:
    """What the maps need of a list of tensors, found once per list (``_facts_of``)."""

    def __init__(self, tensors: Any) -> None:
        self._rows: dict[torch.device, _Rows] = {}
        self.geometry = [_geometry(t) for t in tensors]  # (address, block, stride) bytes
        self.block_bytes = sum(g[1] for g in self.geometry)  # one block of every tensor
        self.device = tensors[0].device if len(tensors) else None
        self.describable = bool(len(tensors)) and all(
            t.is_cuda and t.device == self.device and len(t) > 0 and block_contiguous(t)
            and not (block % WORD or address % WORD or stride % WORD)
            for t, (address, block, stride) in zip(tensors, self.geometry, strict=True))

    def rows_on(self, device: torch.device) -> _Rows:
        """The kernel's rows for these tensors on ``device``: made and uploaded once per
        device, on the stream current then (``ready``: an event after the upload)."""
        found = self._rows.get(device)
        if found is None:
            per_block = np.array([g[1] for g in self.geometry], dtype=np.int64)
            count = len(per_block)
            splits = np.where(per_block % PIECE_BYTES == 0,
                              np.maximum(per_block // PIECE_BYTES, 1), 1)
            k = int(splits[0]) if count and (splits == splits[0]).all() else 1
            rows = np.empty(4 * count, dtype=np.int64)
            rows[:count] = [g[0] for g in self.geometry]
            rows[count : 2 * count] = [g[2] for g in self.geometry]
            rows[2 * count : 3 * count] = np.concatenate([[0], np.cumsum(per_block)[:-1]])
            rows[3 * count :] = per_block // k
            host = torch.from_numpy(rows)
            if device.type == "cuda":
                stream = current_stream(device)
                found = _Rows(host.to(device, non_blocking=True), k, recorded(stream), host)
            else:
                found = _Rows(host, k, None, host)
            self._rows[device] = found
        return found

_facts = PerTensorList(_Facts)
_facts_of = _facts.get


def describable(tensors: Any, device: torch.device) -> bool:
    """Whether a block map can describe these tensors' blocks on ``device``: all of them
    on that GPU, each block one contiguous, 8-byte aligned range."""
    facts = _facts_of(tensors)
    return facts.describable and facts.device == device


def warm_up(device: torch.device) -> None:
    """Launch once, at start and before any NCCL kernel runs on ``device``, the kernels the
    event loop may launch. A kernel's first launch loads it, and loading waits for every
    kernel running on the GPU (measured on the H200 host: 505 ms behind a 0.5 s kernel on
    another stream, torch's lazily loaded kernels and a Triton kernel compiled ahead
    alike). Behind an NCCL kernel whose peer froze or died that is forever, and the abort
    that would end the kernel comes from that loop. Also moves Triton's compile (about a
    second per variant) out of the first transfer that needs it."""
    with torch.cuda.device(device):
        ids = torch.tensor([3, 1], dtype=torch.int64, device=device)
        for dtype in (torch.uint8, torch.bfloat16, torch.float16, torch.float32):
            # The per-tensor paths (chunks.BlockSet without a map): torch's kernels are
            # loaded one dtype at a time.
            t = torch.zeros((4, 16), dtype=dtype, device=device)
            picked = torch.index_select(t, 0, ids)
            t.index_copy_(0, ids, picked)
            t[:, :8].copy_(t[:, 8:])  # a strided copy is a kernel, a contiguous one is not
            t.zero_()  # a sender that gave up sends zeros
        if available():
            blocks = torch.zeros((4, 2 * PIECE_BYTES // WORD), dtype=torch.int64,
                                 device=device)
            other = torch.zeros_like(blocks)
            packed = torch.empty(2 * blocks[0].nbytes, dtype=torch.uint8, device=device)
            src = BlockMap([blocks], np.array([3, 1]), device)
            dst = BlockMap([other], np.array([0, 2]), device)
            count = src.pieces()
            copy(0, count, src=src, dst=packed.data_ptr())  # gather into staging
            copy(0, count, src=packed.data_ptr(), dst=dst)  # scatter from staging
            copy(0, count, src=src, dst=dst)  # region to region
            _check_direct_launch(device)
        torch.cuda.synchronize(device)


def _check_direct_launch(device: torch.device) -> None:
    """Allow launches of the compiled kernel itself (``_compiled``) once one has moved the
    right blocks here; otherwise (another Triton's calling convention) keep Triton's path."""
    global _direct_launch
    blocks = torch.arange(4 * 2 * PIECE_BYTES // WORD, dtype=torch.int64,
                          device=device).view(4, -1)
    other = torch.zeros_like(blocks)
    src = BlockMap([blocks], np.array([3, 1]), device)
    dst = BlockMap([other], np.array([0, 2]), device)
    _direct_launch = True
    try:
        copy(0, src.pieces(), src=src, dst=dst)
        torch.cuda.synchronize(device)
        moved = bool(torch.equal(other[[0, 2]], blocks[[3, 1]])
                     and not other[[1, 3]].any())
    except Exception as exc:
        log.info("direct launches of the copy kernel failed (%r): Triton's path it is", exc)
        moved = False
    if not moved:
        _direct_launch = False
        _compiled.clear()
