"""An NCCL channel: one direction between a local GPU and a GPU of a peer daemon.

Each channel owns a 2-rank communicator (``transport.nccl``), a worker thread, two CUDA
streams on its device — one for NCCL, one for the staging copies — and a few staging
buffers of ``chunk_bytes``. The loop submits jobs and awaits their futures; the thread
runs them in order, which is also the order the peer runs the matching jobs (both sides
queue a transfer's job when the receiver's ACCEPT is sent / arrives, or, for an eager
offer, when the OFFER is sent / arrives, and the peer link delivers those in order; see
``daemon.transfers``), so every NCCL send meets its recv.

A transfer is cut into chunks (``transport.chunks.plan_chunks``). The sender gathers chunk
k+1 into a free staging buffer on the copy stream while chunk k is on the wire on the NCCL
stream; the receiver scatters chunk k on the copy stream while chunk k+1 arrives. Chunks
that are one contiguous run of the source (or destination) memory skip the staging copy.
Events order the two streams; the thread only enqueues work, then polls one final event
against the transfer's deadline.

NCCL cannot stop a transfer half way without the peer: once a job has started it runs to
its end or to its deadline. A receive whose owner gave up before it started is still
received — into staging, and dropped — so the two ends stay in step. Any timeout or error
aborts the communicator (bounded, see ``transport.nccl``) and fails every later job: a
channel that failed is never reused, the peer plane makes a new one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvd import timeline
from kvd.errors import Cancelled, KvdError, PeerUnreachable, TransferFailed
from kvd.memory.cuda_ipc import wait_ready
from kvd.memory.regions import Layout
from kvd.transport import gpu_copy
from kvd.transport.chunks import BlockSet, Chunk, largest_chunk, plan_chunks
from kvd.transport.nccl import Communicator

log = logging.getLogger(__name__)

_STOP = object()
STAGING_BUFFERS = 2  # double buffering: gather (or scatter) one chunk while one is on the wire


@dataclass(eq=False)
class NcclJob:
    transfer_id: int
    blocks: BlockSet | None  # None: a receive nobody wants any more (bytes dropped)
    layout: Layout
    num_blocks: int
    deadline: float  # time.monotonic()
    nbytes: int = 0
    chunk_bytes: int = 0  # as the ACCEPT said (both ends must cut the bytes alike)
    ready_events: list[Any] = field(default_factory=list)  # sender: clients' writes first
    future: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)
    started_at: float = 0.0
    abandoned: bool = False  # receiver: drop the bytes instead of storing them


class NcclChannel:
    """One direction ("send" or "recv") of a 2-rank communicator, run by its own thread."""

    def __init__(self, name: str, device: torch.device, direction: str, chunk_bytes: int,
                 on_failed: Callable[[NcclChannel, KvdError], None] | None = None) -> None:
        if direction not in ("send", "recv"):
            raise ValueError(direction)
        self.name = name
        self.device = device
        self.direction = direction
        self.chunk_bytes = chunk_bytes
        self.last_used = time.monotonic()
        self.failed: KvdError | None = None
        self._on_failed = on_failed
        self._comm: Communicator | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._staging: list[torch.Tensor] = []
        self._busy = 0  # jobs queued or running
        self._lock = threading.Lock()
        # Not a daemon thread: every NCCL call it makes is bounded by a deadline, and
        # teardown stops it with a sentinel and joins it (NcclLinks._drop).
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

    # ------------------------------------------------------------ loop side

    def start(self, unique_id: bytes, rank: int, timeout_s: float) -> None:
        """Join the communicator (in the thread: init is polled against ``timeout_s``)."""
        self._jobs.put(("init", unique_id, rank, timeout_s))

    def warm(self, timeout_s: float) -> None:
        """Queue one small message (sent or received) right after the init: NCCL sets up a
        pair's connections on its first transfer. The peer's end queues the matching one
        in the same place (``NcclLinks.warm_up``)."""
        self._queue(("warm", timeout_s))

    def submit(self, job: NcclJob) -> concurrent.futures.Future[int]:
        self.last_used = time.monotonic()
        self._queue(job)
        return job.future

    def _queue(self, item: Any) -> None:
        """Work for the thread; the channel is busy (not evictable) until it is done."""
        with self._lock:
            self._busy += 1
        self._jobs.put(item)

    @property
    def idle(self) -> bool:
        return self._busy == 0

    def abort(self, error: KvdError) -> None:
        """Abort the communicator now (from any thread): jobs in flight fail at their next
        poll, queued ones at once."""
        if self.failed is None:
            self.failed = error
        comm = self._comm
        if comm is not None:
            comm.abort()

    def stop(self, timeout_s: float) -> bool:
        self._jobs.put(_STOP)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------ thread side

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        self._comm_stream = torch.cuda.Stream(self.device)
        self._copy_stream = torch.cuda.Stream(self.device)
        while True:
            item = self._jobs.get()
            if item is _STOP:
                self._release()
                return
            if isinstance(item, tuple) and item[0] == "init":
                self._init(*item[1:])
                continue
            if isinstance(item, tuple):
                try:
                    self._warm(item[1])
                finally:
                    with self._lock:
                        self._busy -= 1
                continue
            job: NcclJob = item
            try:
                if not job.future.set_running_or_notify_cancel():
                    # Nobody waits for it any more, but the peer's matching job will run:
                    # send zeros / drop the bytes, so the pair stays in step.
                    job = dataclasses.replace(job, blocks=None, abandoned=True,
                                              future=concurrent.futures.Future())
                    job.future.set_running_or_notify_cancel()
                try:
                    if self.failed is not None:
                        raise self.failed
                    job.started_at = time.monotonic()
                    timeline.mark(f"nccl.{self.direction}.start")
                    if self.direction == "send":
                        job.future.set_result(self._send(job))
                    else:
                        nbytes = self._recv(job)
                        if job.abandoned or job.blocks is None:
                            # Received and dropped as asked: the channel stays usable.
                            job.future.set_exception(Cancelled(
                                f"transfer {job.transfer_id} was given up; its bytes were "
                                "dropped"))
                        else:
                            job.future.set_result(nbytes)
                except BaseException as exc:
                    err = exc if isinstance(exc, KvdError) else TransferFailed(
                        f"nccl {self.direction} on {self.name}: {exc!r}")
                    self._fail(err)
                    job.future.set_exception(self.failed or err)
            finally:
                timeline.mark(f"nccl.{self.direction}.end")
                with self._lock:
                    self._busy -= 1
                self.last_used = time.monotonic()

    def _init(self, unique_id: bytes, rank: int, timeout_s: float) -> None:
        try:
            self._comm = Communicator.init(unique_id, rank, timeout_s, self.name)
            if self.failed is not None:  # aborted while joining
                self._comm.abort()
        except KvdError as err:
            self._fail(err)
        except Exception as exc:  # nccl4py raises its own types
            self._fail(TransferFailed(f"nccl init of {self.name} failed: {exc!r}"))

    def _warm(self, timeout_s: float) -> None:
        if self.failed is not None or self._comm is None:
            return
        started = time.monotonic()
        try:
            buf = torch.zeros(8, dtype=torch.uint8, device=self.device)
            if self.direction == "send":
                self._comm.send(buf, 1, self._comm_stream, timeout_s)
            else:
                self._comm.recv(buf, 0, self._comm_stream, timeout_s)
            self._comm.wait(gpu_copy.recorded(self._comm_stream), timeout_s, "warm-up message")
            log.info("nccl channel %s warm in %.3fs", self.name, time.monotonic() - started)
        except KvdError as err:
            self._fail(err)
        except Exception as exc:
            self._fail(TransferFailed(f"nccl warm-up of {self.name} failed: {exc!r}"))

    def _fail(self, err: KvdError) -> None:
        first = self.failed is None
        if first:
            self.failed = err
        if self._comm is not None:
            self._comm.abort()
        if first and self._on_failed is not None:
            self._on_failed(self, err)

    def _buffer(self, b: int, nbytes: int) -> torch.Tensor:
        """Staging buffer ``b`` of at least ``nbytes``; allocated on first need only (a
        transfer whose chunks all go straight from memory to memory needs none). Growing
        it waits for the GPU: the old buffers may still be in use."""
        if not self._staging or self._staging[0].numel() < nbytes:
            torch.cuda.synchronize(self.device)
            self._staging = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                             for _ in range(STAGING_BUFFERS)]
        return self._staging[b]

    def _remaining(self, job: NcclJob) -> float:
        left = job.deadline - time.monotonic()
        if left <= 0:
            raise PeerUnreachable(f"transfer {job.transfer_id} on {self.name} ran out of time")
        return left

    def _plan(self, job: NcclJob) -> tuple[Communicator, Sequence[Chunk], int]:
        """The communicator, the transfer's chunks, and the staging size they need."""
        assert self._comm is not None
        chunks = plan_chunks(job.layout, job.num_blocks, job.chunk_bytes or self.chunk_bytes)
        return self._comm, chunks, largest_chunk(chunks)

    def _prepare(self, blocks: BlockSet | None, chunks: Sequence[Chunk], size: int
                 ) -> list[torch.Tensor | None]:
        """Each chunk's memory when it goes straight from (or into) it, else None (staged).
        For staged chunks: the blocks' map for the staging copies, made now while the copy
        stream is idle (its small upload, made later, would wait for the chunk queued
        ahead of it), and the staging buffers, grown now (growing waits for the GPU)."""
        direct = [blocks.direct(c, self.device) if blocks is not None else None
                  for c in chunks]
        if any(d is None for d in direct):
            if blocks is not None:
                with torch.cuda.stream(self._copy_stream):
                    blocks.block_map(self.device)
            self._buffer(0, size)
        return direct

    def _load(self, blocks: BlockSet | None, chunk: Chunk, buf: torch.Tensor | None,
              b: int, free_at: torch.cuda.Event | None) -> torch.Tensor:
        """Chunk's bytes ready to send, on the copy stream: straight from memory (``buf``)
        or gathered into staging buffer ``b`` once it is free."""
        if buf is not None:
            return buf
        with torch.cuda.stream(self._copy_stream):
            if free_at is not None:
                self._copy_stream.wait_event(free_at)
            stage = self._staging[b]
            # A sender that gave up sends zeros: the receiver waits for the bytes.
            return (blocks.load(chunk, stage) if blocks is not None
                    else stage[: chunk.nbytes].zero_())

    # Both loops call NCCL without waiting for the call to be accepted, queue the
    # copy-stream work that does not depend on it (the next chunk's gather, the previous
    # chunk's scatter) while NCCL launches it from its own thread (~0.1 ms on the H200
    # host), and only then settle: nothing goes on the NCCL stream in between.

    def _send(self, job: NcclJob) -> int:
        comm, chunks, size = self._plan(job)
        blocks = job.blocks
        direct = self._prepare(blocks, chunks, size)
        timeline.mark("nccl.send.prepared")
        freed: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
        wait_ready(job.ready_events, self._copy_stream)  # NCCL waits on the copy stream
        buf = self._load(blocks, chunks[0], direct[0], 0, None) if chunks else None
        for k in range(len(chunks)):
            b = k % STAGING_BUFFERS
            assert buf is not None
            self._comm_stream.wait_event(gpu_copy.recorded(self._copy_stream))
            timeline.mark("nccl.call")
            comm.send(buf, 1, self._comm_stream, self._remaining(job), settle=False)
            if k + 1 < len(chunks):
                nb = (k + 1) % STAGING_BUFFERS
                buf = self._load(blocks, chunks[k + 1], direct[k + 1], nb, freed[nb])
            comm.settle(self._remaining(job), "send")
            timeline.mark("nccl.settled")
            freed[b] = gpu_copy.recorded(self._comm_stream)
        comm.wait(gpu_copy.recorded(self._comm_stream), self._remaining(job),
                  f"send of transfer {job.transfer_id}")
        return sum(c.nbytes for c in chunks)

    def _recv(self, job: NcclJob) -> int:
        comm, chunks, size = self._plan(job)
        blocks = None if job.abandoned else job.blocks  # None: drop the bytes
        direct = self._prepare(blocks, chunks, size)
        timeline.mark("nccl.recv.prepared")
        stored: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
        landed: tuple[Chunk, torch.Tensor, torch.cuda.Event, int] | None = None

        def scatter(chunk: Chunk, buf: torch.Tensor, arrived: torch.cuda.Event,
                    b: int) -> None:
            assert blocks is not None
            self._copy_stream.wait_event(arrived)
            with torch.cuda.stream(self._copy_stream):
                blocks.store(chunk, buf)
            stored[b] = gpu_copy.recorded(self._copy_stream)

        for k, chunk in enumerate(chunks):
            b = k % STAGING_BUFFERS
            buf = direct[k]
            staged = buf is None
            if buf is None:
                free_at = stored[b]
                if free_at is not None:
                    self._comm_stream.wait_event(free_at)
                buf = self._staging[b][: chunk.nbytes]
            timeline.mark("nccl.call")
            comm.recv(buf, 0, self._comm_stream, self._remaining(job), settle=False)
            if landed is not None:
                scatter(*landed)
                landed = None
            comm.settle(self._remaining(job), "recv")
            timeline.mark("nccl.settled")
            if staged:
                arrived = gpu_copy.recorded(self._comm_stream)
                if blocks is not None:
                    landed = (chunk, buf, arrived, b)
                else:
                    stored[b] = arrived  # dropped: the buffer is free once received
        if landed is not None:
            scatter(*landed)
        self._copy_stream.wait_stream(self._comm_stream)
        comm.wait(gpu_copy.recorded(self._copy_stream), self._remaining(job),
                  f"receive of transfer {job.transfer_id}")
        return sum(c.nbytes for c in chunks)

    def _release(self) -> None:
        comm = self._comm
        if comm is not None and self.failed is None:
            # A clean stop still aborts: destroy would wait for the peer, abort does not.
            comm.abort()
        self._staging = []
