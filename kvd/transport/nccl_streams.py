"""The GPU side of one NCCL channel: its two CUDA streams, its staging buffers, and the
work of one job on them, as a generator of steps.

A channel (``transport.nccl_channel``) owns one ``ChannelStreams``: a stream for NCCL, one
for the staging copies, and ``STAGING_BUFFERS`` staging buffers (made on first need). This
module decides *what* a job issues and in which order; the channel decides when its
worker thread runs it.

A job's work is a generator of steps: between two yields it issues work (NCCL calls,
copies, events), and each yield is what to wait for before the next step — ``SETTLE``
(the last NCCL call accepted), or, last, ``LastStep``: the event after which the bytes are
there (all calls accepted and all work queued by then). The channel's worker runs the
steps up to ``LastStep`` with blocking polls (``NcclChannel._issue``) and keeps the job
among its tails until that event fires (``NcclChannel._reap``).

The sender gathers chunk k+1 into a free staging buffer on the copy stream while chunk k is
on the wire on the NCCL stream; the receiver scatters chunk k on the copy stream while
chunk k+1 arrives. Chunks that are one contiguous run of the source (or destination)
memory skip the staging copy. Events order the two streams. The staging buffers are reused
from one job to the next, each with the event after which it is free again
(``_staging_free``): a job's first copies into a buffer wait for the job before.

On a non-blocking communicator both directions call NCCL without waiting for the call to
be accepted, queue the copy-stream work that does not depend on it (the next chunk's
gather, the previous chunk's scatter) while NCCL launches it from its own thread (~0.1 ms
on the H200 host), and only then settle: nothing goes on the NCCL stream in between. A
blocking one (``nccl_blocking_calls``) has launched when the call returns: no ``SETTLE``
step.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from kvd import timeline
from kvd.memory.cuda_ipc import wait_ready
from kvd.transport import gpu_copy
from kvd.transport.chunks import BlockSet, Chunk, largest_chunk, plan_chunks
from kvd.transport.nccl import Communicator
from kvd.transport.nccl_job import SETTLE, LastStep, NcclJob, Steps, only_direct, time_left

STAGING_BUFFERS = 2  # double buffering: gather (or scatter) one chunk while one is on the wire


class ChannelStreams:
    """One channel's streams and staging buffers on ``device``, and its jobs' steps. Used
    by the channel's worker thread only."""

    comm_stream: torch.cuda.Stream  # NCCL's (made by open)
    copy_stream: torch.cuda.Stream  # the staging copies' (made by open)

    def __init__(self, name: str, device: torch.device, direction: str,
                 chunk_bytes: int) -> None:
        self.name = name
        self.device = device
        self.direction = direction
        self.chunk_bytes = chunk_bytes
        self._staging: list[torch.Tensor] = []
        # Per staging buffer, the event after which the last job's work no longer reads or
        # writes it (None: free): the next job's first copies into it wait for that.
        self._staging_free: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS

    @property
    def staging_bytes(self) -> int:
        """GPU memory its staging buffers hold now (read from any thread)."""
        return sum(buf.numel() for buf in list(self._staging))

    def open(self) -> None:
        """Make the streams; in the channel's thread, its device current."""
        self.comm_stream = torch.cuda.Stream(self.device)
        self.copy_stream = torch.cuda.Stream(self.device)

    def release(self) -> None:
        """Let the staging buffers go (the channel stopped)."""
        self._staging = []

    def steps(self, job: NcclJob, comm: Communicator) -> Steps:
        """``job``'s work on ``comm`` and the two streams, as steps (module doc)."""
        chunks, size = self._plan(job)
        # A receive nobody wants any more drops its bytes (blocks None); a sender that gave
        # up has none already (it sends zeros).
        blocks = None if self.direction == "recv" and job.abandoned else job.blocks
        direct = self._prepare(blocks, chunks, size)
        timeline.mark(f"nccl.{self.direction}.prepared")
        bufs = only_direct(direct)
        if bufs is not None:  # one grouped call
            self._issue_direct(comm, job, bufs)
            if not comm.blocking:
                yield SETTLE
            timeline.mark("nccl.settled")
            yield LastStep(gpu_copy.recorded(self.comm_stream))
        elif self.direction == "send":
            yield from self._send_staged(job, comm, chunks, blocks, direct)
        else:
            yield from self._recv_staged(job, comm, chunks, blocks, direct)
        return sum(c.nbytes for c in chunks)

    def _issue_direct(self, comm: Communicator, job: NcclJob,
                      bufs: Sequence[torch.Tensor]) -> None:
        """All of a job's chunks, straight from (into) its blocks, as one NCCL group."""
        if self.direction == "send":
            wait_ready(job.ready_events, self.comm_stream)
        timeline.mark("nccl.call")
        comm.start(self.direction, bufs, 1 if self.direction == "send" else 0,
                   self.comm_stream)

    def _buffer(self, b: int, nbytes: int) -> torch.Tensor:
        """Staging buffer ``b`` of at least ``nbytes``; allocated on first need only (a
        transfer whose chunks all go straight from memory to memory needs none). Growing
        it waits for the GPU: the old buffers may still be in use."""
        if not self._staging or self._staging[0].numel() < nbytes:
            torch.cuda.synchronize(self.device)  # the jobs in their tail too
            self._staging = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                             for _ in range(STAGING_BUFFERS)]
            self._staging_free = [None] * STAGING_BUFFERS
        return self._staging[b]

    def _plan(self, job: NcclJob) -> tuple[tuple[Chunk, ...], int]:
        """The transfer's chunks, and the staging size they need."""
        chunks = plan_chunks(job.layout, job.num_blocks, job.chunk_bytes or self.chunk_bytes)
        return chunks, largest_chunk(chunks)

    def _prepare(self, blocks: BlockSet | None, chunks: tuple[Chunk, ...], size: int
                 ) -> Sequence[torch.Tensor | None]:
        """Each chunk's memory when it goes straight from (or into) it, else None (staged).
        For staged chunks: the blocks' map for the staging copies, made now while the copy
        stream is idle (its small upload, made later, would wait for the chunk queued
        ahead of it), and the staging buffers, grown now (growing waits for the GPU)."""
        direct: Sequence[torch.Tensor | None] = (
            blocks.direct_chunks(chunks, self.device) if blocks is not None
            else [None] * len(chunks))
        if any(d is None for d in direct):
            if blocks is not None:
                with torch.cuda.stream(self.copy_stream):
                    blocks.block_map(self.device)
            self._buffer(0, size)
        return direct

    def _load(self, blocks: BlockSet | None, chunk: Chunk, buf: torch.Tensor | None,
              b: int, free_at: torch.cuda.Event | None) -> torch.Tensor:
        """Chunk's bytes ready to send, on the copy stream: straight from memory (``buf``)
        or gathered into staging buffer ``b`` once it is free."""
        if buf is not None:
            return buf
        with torch.cuda.stream(self.copy_stream):
            if free_at is not None:
                self.copy_stream.wait_event(free_at)
            stage = self._staging[b]
            # A sender that gave up sends zeros: the receiver waits for the bytes.
            return (blocks.load(chunk, stage) if blocks is not None
                    else stage[: chunk.nbytes].zero_())

    def _send_staged(self, job: NcclJob, comm: Communicator, chunks: tuple[Chunk, ...],
                     blocks: BlockSet | None, direct: Sequence[torch.Tensor | None],
                     ) -> Generator[Any, None, None]:
        freed = list(self._staging_free)  # the job before may still send from them
        wait_ready(job.ready_events, self.copy_stream)  # NCCL waits on the copy stream
        buf = self._load(blocks, chunks[0], direct[0], 0, freed[0]) if chunks else None
        for k in range(len(chunks)):
            b = k % STAGING_BUFFERS
            assert buf is not None
            self.comm_stream.wait_event(gpu_copy.recorded(self.copy_stream))
            timeline.mark("nccl.call")
            comm.send(buf, 1, self.comm_stream, time_left(job, self.name), settle=False)
            if k + 1 < len(chunks):
                nb = (k + 1) % STAGING_BUFFERS
                buf = self._load(blocks, chunks[k + 1], direct[k + 1], nb, freed[nb])
            if not comm.blocking:
                yield SETTLE
            timeline.mark("nccl.settled")
            freed[b] = gpu_copy.recorded(self.comm_stream)
        self._staging_free = freed
        yield LastStep(gpu_copy.recorded(self.comm_stream))

    def _recv_staged(self, job: NcclJob, comm: Communicator, chunks: tuple[Chunk, ...],
                     blocks: BlockSet | None, direct: Sequence[torch.Tensor | None],
                     ) -> Generator[Any, None, None]:
        stored = list(self._staging_free)  # the job before may still scatter from them
        landed: tuple[Chunk, torch.Tensor, torch.cuda.Event, int] | None = None

        def scatter(chunk: Chunk, buf: torch.Tensor, arrived: torch.cuda.Event,
                    b: int) -> None:
            assert blocks is not None
            self.copy_stream.wait_event(arrived)
            with torch.cuda.stream(self.copy_stream):
                blocks.store(chunk, buf)
            stored[b] = gpu_copy.recorded(self.copy_stream)

        for k, chunk in enumerate(chunks):
            b = k % STAGING_BUFFERS
            buf = direct[k]
            staged = buf is None
            if buf is None:
                free_at = stored[b]
                if free_at is not None:
                    self.comm_stream.wait_event(free_at)
                buf = self._staging[b][: chunk.nbytes]
            timeline.mark("nccl.call")
            comm.recv(buf, 0, self.comm_stream, time_left(job, self.name), settle=False)
            if landed is not None:
                scatter(*landed)
                landed = None
            if not comm.blocking:
                yield SETTLE
            timeline.mark("nccl.settled")
            if staged:
                arrived = gpu_copy.recorded(self.comm_stream)
                if blocks is not None:
                    landed = (chunk, buf, arrived, b)
                else:
                    stored[b] = arrived  # dropped: the buffer is free once received
        if landed is not None:
            scatter(*landed)
        self._staging_free = stored
        self.copy_stream.wait_stream(self.comm_stream)
        yield LastStep(gpu_copy.recorded(self.copy_stream))

