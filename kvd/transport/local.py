"""The local transport: both ends on this daemon, bytes moved by a copy worker thread.

The event loop copies host memory only for copies of at most ``INLINE_COPY_BYTES``
(daemon/local_copies.py); larger jobs go to a ``CopyWorker``, whose returned future the
loop awaits. A copy between GPU regions is kernel launches and stream waits, so the loop
queues it itself (``copy_gpu_blocks_queued``) and polls the events it returns.
Jobs are the three moves a node needs: gather blocks of a region into a packed buffer
(offload, put into the pool), scatter a packed buffer into blocks (get from the pool), and
copy blocks from one region to another (put to a waiting get, get of a published key).
Packed buffers are tensor-major with aligned sections, see ``memory.regions.packed_offsets``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvd import timeline
from kvd.memory.regions import IdArray, Layout, bits, packed_offsets
from kvd.memory.streams import current_stream
from kvd.protocol import LayoutEntry
from kvd.transport import gpu_copy
from kvd.transport.chunks import BlockSet, largest_chunk, plan_chunks

log = logging.getLogger(__name__)

_STOP = object()


def _section(buf: torch.Tensor, offset: int, like: torch.Tensor, num_blocks: int) -> torch.Tensor:
    nbytes = num_blocks * like[0].numel() * like.element_size() if num_blocks else 0
    return buf[offset : offset + nbytes].view(like.dtype).view(num_blocks, *like.shape[1:])


# Up to this many contiguous runs, blocks are moved run by run with plain slice copies
# (memcpy speed, ~9 GB/s here); beyond it, the per-call overhead loses to one
# index_select / index_copy_ (~1.7 GB/s here, but one call for any number of blocks).
MAX_RUNS_FOR_SLICES = 64


def runs(src: Sequence[int], dst: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the stretches where consecutive ids are
    consecutive in ``src`` (and in ``dst``; positions 0.. when ``dst`` is None)."""
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(src):
        d = i if dst is None else dst[i]
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def _few_runs(found: list[tuple[int, int, int]]) -> bool:
    return len(found) <= MAX_RUNS_FOR_SLICES


def gather(
    tensors: Sequence[torch.Tensor], layout: Layout, idx: torch.Tensor, out: torch.Tensor
) -> int:
    """Blocks ``idx`` of every tensor into the packed uint8 buffer ``out``."""
    offsets, total = packed_offsets(layout, len(idx))
    found = runs(idx.tolist())
    for t, off in zip(map(bits, tensors), offsets, strict=True):
        section = _section(out, off, t, len(idx))
        if _few_runs(found):
            for s, p, n in found:
                section[p : p + n].copy_(t[s : s + n])
        elif t.device != section.device:
            section.copy_(t.index_select(0, idx.to(t.device)))
        else:
            torch.index_select(t, 0, idx, out=section)
    _finish_writes(out)
    return total


def scatter(
    buf: torch.Tensor, layout: Layout, tensors: Sequence[torch.Tensor], idx: torch.Tensor
) -> int:
    """The packed uint8 buffer ``buf`` into blocks ``idx`` of every tensor."""
    offsets, total = packed_offsets(layout, len(idx))
    found = runs(idx.tolist())
    for t, off in zip(map(bits, tensors), offsets, strict=True):
        section = _section(buf, off, t, len(idx))
        if _few_runs(found):
            for d, p, n in found:
                t[d : d + n].copy_(section[p : p + n])
        else:
            t.index_copy_(0, idx.to(t.device), section.to(t.device))
    _finish_writes(*tensors)
    return total


def copy_gpu_blocks_queued(
    src: Sequence[torch.Tensor],
    src_idx: torch.Tensor,
    dst: Sequence[torch.Tensor],
    dst_idx: torch.Tensor,
    dst_blocks: BlockSet | None = None,
) -> tuple[int, list[torch.cuda.Event]] | None:
    """``copy_blocks`` between GPU regions, queued without waiting for it: the bytes, and
    one event per destination GPU recorded after the writes on its current stream (the
    caller waits for them before it answers). None, with nothing queued, where only the
    worker's paths apply (host memory, or blocks the copy kernel cannot describe). Every
    step is a kernel launch or a stream wait, so the event loop may run it."""
    if not (src and dst and src[0].is_cuda and dst[0].is_cuda):
        return None
    if src[0].device != dst[0].device:
        nbytes = copy_across_gpus(src, src_idx.numpy(), dst, dst_idx.numpy(),
                                  dst_blocks=dst_blocks)
        written = {t.device for t in dst}
    else:
        done = _same_gpu_one_launch(src, src_idx.numpy(), dst, dst_idx.numpy(), dst_blocks)
        if done is None:
            return None
        nbytes, written = done, {dst[0].device}  # (a map's tensors are on one GPU)
    return nbytes, [gpu_copy.recorded(current_stream(device)) for device in written]


def copy_blocks(
    src: Sequence[torch.Tensor],
    src_idx: torch.Tensor,
    dst: Sequence[torch.Tensor],
    dst_idx: torch.Tensor,
) -> int:
    """Blocks of one region into blocks of another with the same layout, done when it
    returns: the copy worker's path, for what the loop does not queue itself
    (``copy_gpu_blocks_queued`` returned None: host memory on either side, or GPU blocks
    the copy kernel cannot describe), so it does not try that again."""
    nbytes = 0
    found = runs(src_idx.tolist(), dst_idx.tolist())
    for s, d in zip(map(bits, src), map(bits, dst), strict=True):
        block_shape = d.shape[1:]
        if _few_runs(found):
            for a, b, n in found:
                d[b : b + n].copy_(s[a : a + n].reshape(n, *block_shape))
        else:
            picked = s.index_select(0, src_idx.to(s.device)).to(d.device)
            d.index_copy_(0, dst_idx.to(d.device), picked.view(len(dst_idx), *block_shape))
        nbytes += len(src_idx) * s[0].numel() * s.element_size() if len(s) else 0
    _finish_writes(*dst)
    return nbytes


CROSS_GPU_CHUNK_BYTES = 128 * 2**20  # 4 chunks for 512 MiB: the launches keep up with the GPU
CROSS_GPU_BUFFERS = 2  # gather chunk k+1 and scatter chunk k-1 while chunk k crosses


def _same_gpu_one_launch(src: Sequence[torch.Tensor], src_ids: IdArray,
                         dst: Sequence[torch.Tensor], dst_ids: IdArray,
                         dst_blocks: BlockSet | None = None) -> int | None:
    """Blocks between two regions of one GPU in one kernel launch (``transport.gpu_copy``),
    or None when the kernel cannot describe this memory."""
    device = dst[0].device
    reader = BlockSet(src, src_ids).block_map(device)
    writer = ((dst_blocks or BlockSet(dst, dst_ids)).block_map(device)
              if reader is not None else None)
    if reader is None or writer is None or reader.k != writer.k:
        return None
    timeline.mark("local.gpu_copy.mapped")
    gpu_copy.copy(0, reader.pieces(), src=reader, dst=writer)
    return reader.nbytes


class _CrossStreams:
    """Streams for copies between two GPUs, made once per device pair: a gather and a
    copy stream on the source, a landing and a scatter stream on the destination."""

    _made: dict[tuple[torch.device, torch.device], _CrossStreams] = {}

    def __init__(self, src: torch.device, dst: torch.device) -> None:
        self.gather, self.copy = torch.cuda.Stream(src), torch.cuda.Stream(src)
        self.land, self.scatter = torch.cuda.Stream(dst), torch.cuda.Stream(dst)

    @classmethod
    def get(cls, src: torch.device, dst: torch.device) -> _CrossStreams:
        found = cls._made.get((src, dst))
        if found is None:
            found = cls._made[(src, dst)] = cls(src, dst)
        return found


def copy_across_gpus(src: Sequence[torch.Tensor], src_ids: IdArray,
                     dst: Sequence[torch.Tensor], dst_ids: IdArray,
                     chunk_bytes: int | None = None, peer_stores: bool | None = None,
                     dst_blocks: BlockSet | None = None) -> int:
    """Blocks between two GPUs of this node, chunk by chunk, pipelined so that chunk k
    crosses NVLink while k+1 is gathered and k-1 scattered.

    Where the source GPU may store into the destination's memory (``peer_stores``, the
    default when ``gpu_copy.peer_stores`` says so), the gather kernel runs on the source
    and stores straight into a staging buffer of ours on the destination: one pass over
    NVLink, no copy engine step, and the destination scatters from there. Otherwise:
    gather on the source, one peer copy, scatter on the destination. Runs of blocks skip
    the staging on either side. (The client's own memory on the destination is mapped by
    legacy CUDA IPC, which the source GPU cannot store into: hence the staging.) The work
    starts after what the devices' current streams hold (the clients' ready events) and
    the current streams wait for it at the end; the caller waits for those (an event
    after them, see ``copy_gpu_blocks_queued``), this function does not.

    The staging buffers are freed on return, possibly before the GPU is done with them:
    they were allocated on the current streams, which wait for every stream that uses
    them, and a copy's streams start after the current ones, so whatever reuses the
    memory next runs after it."""
    # The plan needs bytes per block only; the copies keep each tensor's own dtype.
    layout = tuple(LayoutEntry(math.prod(t.shape[1:]) * t.element_size(), "uint8")
                   for t in src)
    chunks = plan_chunks(layout, len(src_ids), chunk_bytes or CROSS_GPU_CHUNK_BYTES)
    if not chunks:
        return 0
    src_dev, dst_dev = src[0].device, dst[0].device
    timeline.mark("local.cross.start")
    streams = _CrossStreams.get(src_dev, dst_dev)
    reader, writer = BlockSet(src, src_ids), dst_blocks or BlockSet(dst, dst_ids)
    # Maps are made on a stream while it is idle (their small upload would wait for the
    # work queued on it, see NcclChannel._prepare): the reader's now, the writer's once
    # the first chunk is on its way, on the landing stream before it waits for anything.
    with torch.cuda.stream(streams.gather):
        reader_map = reader.block_map(src_dev)
    if peer_stores is None:
        peer_stores = gpu_copy.peer_stores(src_dev, dst_dev)
    peer_stores = peer_stores and reader_map is not None
    size = largest_chunk(chunks)
    src_stage = [] if peer_stores else [torch.empty(size, dtype=torch.uint8, device=src_dev)
                                        for _ in range(CROSS_GPU_BUFFERS)]
    dst_stage = [torch.empty(size, dtype=torch.uint8, device=dst_dev)
                 for _ in range(CROSS_GPU_BUFFERS)]
    src_now, dst_now = current_stream(src_dev), current_stream(dst_dev)
    for s in (streams.gather, streams.copy):
        s.wait_stream(src_now)

    def destination_ready() -> None:
        with torch.cuda.stream(streams.land):
            writer.block_map(dst_dev)
        for s in (streams.land, streams.scatter):
            s.wait_stream(dst_now)

    copied: list[torch.cuda.Event | None] = [None] * CROSS_GPU_BUFFERS  # src stage free
    scattered: list[torch.cuda.Event | None] = [None] * CROSS_GPU_BUFFERS  # dst stage free
    for k, chunk in enumerate(chunks):
        b = k % CROSS_GPU_BUFFERS
        buf = reader.direct(chunk, src_dev)
        into = writer.direct(chunk, dst_dev)
        if k == 0 and not (buf is None and peer_stores):
            destination_ready()  # the copy below lands on the destination's streams
        if buf is None and peer_stores:
            # Gathered on the source straight into our staging on the destination.
            free_at = scattered[b]
            with torch.cuda.stream(streams.gather):
                if free_at is not None:
                    streams.gather.wait_event(free_at)
                landed = reader.load(chunk, dst_stage[b], on=src_dev)
            crossed = gpu_copy.recorded(streams.gather)
            if k == 0:
                destination_ready()  # while the first chunk crosses
        else:
            if buf is None:
                src_free = copied[b]
                with torch.cuda.stream(streams.gather):
                    if src_free is not None:
                        streams.gather.wait_event(src_free)
                    buf = reader.load(chunk, src_stage[b])
                streams.copy.wait_event(gpu_copy.recorded(streams.gather))
            if into is not None:
                landed = into  # straight into the destination's run of blocks
            else:
                dst_free = scattered[b]
                if dst_free is not None:
                    streams.copy.wait_event(dst_free)
                landed = dst_stage[b][: chunk.nbytes]
            # A copy between devices runs on the source's current stream, fenced with the
            # destination's current one: the landing stream, which nothing else uses.
            with torch.cuda.stream(streams.copy), torch.cuda.stream(streams.land):
                landed.copy_(buf, non_blocking=True)
            crossed = copied[b] = gpu_copy.recorded(streams.copy)
            if into is not None:
                continue
        streams.scatter.wait_event(crossed)
        with torch.cuda.stream(streams.scatter):
            if into is not None:
                into.copy_(landed, non_blocking=True)
            else:
                writer.store(chunk, landed)
        scattered[b] = gpu_copy.recorded(streams.scatter)
    timeline.mark("local.cross.queued")
    for s in (streams.gather, streams.copy):
        src_now.wait_stream(s)
    for s in (streams.land, streams.scatter):
        dst_now.wait_stream(s)
    return sum(c.nbytes for c in chunks)


def _finish_writes(*written: torch.Tensor) -> None:
    """Copies between host memory and a GPU are asynchronous: wait for them before the
    daemon answers, because its answer is the client's only signal that the blocks are
    complete (nothing on the client's streams waits for the daemon's), and a pool item's
    host bytes are read by threads that follow no stream. The wait runs in this worker
    thread, never on the loop, per device written; the worker runs one copy at a time
    anyway, on streams of its own (``CopyWorker``), so this waits for its copies only
    (the next job's copy would queue behind this one on the same stream and PCIe link:
    the wait costs the worker's CPU overlap, not bandwidth).
    (Copies between GPU regions that the loop queues skip it: it polls an event recorded
    after them, ``copy_gpu_blocks_queued``; only blocks the copy kernel cannot describe
    come here.) A daemon-side interprocess event the client waits on would
    remove it (next steps in docs/architecture.md)."""
    for device in {t.device for t in written if t.is_cuda}:
        current_stream(device).synchronize()


class CopyWorker:
    """One thread running copy jobs in order; stopped by a sentinel, never abandoned.

    Its GPU work goes on streams of its own, one per GPU, made current for this thread
    once CUDA is in use (a current stream is per thread): on the devices' default streams
    a 1 GiB offload (~20 ms at PCIe speed) would hold up every copy the loop queues behind
    it, and ``_finish_writes`` would wait for those copies in turn. The clients' ready
    events (``wait_ready``) are waited for on these streams like any current stream."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._own_streams = False
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

    def _use_own_streams(self) -> None:
        """Once CUDA is in use (never on a daemon without GPUs): a stream per GPU, current
        for this thread from now on."""
        if self._own_streams or not torch.cuda.is_initialized():
            return
        for index in range(torch.cuda.device_count()):
            torch.cuda.set_stream(torch.cuda.Stream(index))
        self._own_streams = True

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Queue ``fn(*args)``; cancelling the future before it starts skips the job."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                self._use_own_streams()
                fut.set_result(fn(*args))
            except BaseException as exc:
                log.debug("copy job failed worker=%s: %r", self.name, exc)
                fut.set_exception(exc)

    def stop(self, timeout_s: float) -> bool:
        """Finish queued jobs, then stop; False if the thread did not end in time."""
        self._jobs.put(_STOP)
        self._thread.join(timeout_s)
        alive = self._thread.is_alive()
        if alive:
            log.error("copy worker %s did not stop within %.1fs", self.name, timeout_s)
        return not alive
