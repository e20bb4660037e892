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
Events order the two streams; the thread only enqueues work. Once a job's last work is
queued on the streams (its *tail*: one final event, polled from the loop against the
transfer's deadline), the next job may queue its own behind it: consecutive transfers
overlap, one's NCCL calls and copies issued while the bytes of the one before are still
moving. The streams keep them in order; the staging buffers, which both reuse, carry the
event after which each is free again from one job to the next (``_staging_free``).

NCCL cannot stop a transfer half way without the peer: once a job has started it runs to
its end or to its deadline. A receive whose owner gave up before it started is still
received — into staging, and dropped — so the two ends stay in step. Any timeout or error
aborts the communicator (bounded, see ``transport.nccl``) and fails every later job: a
channel that failed is never reused, the peer plane makes a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvd import timeline
from kvd.errors import Cancelled, KvdError, KvdTimeout, PeerUnreachable, TransferFailed
from kvd.memory.cuda_ipc import wait_ready
from kvd.memory.regions import Layout
from kvd.transport import gpu_copy
from kvd.transport.chunks import BlockSet, Chunk, largest_chunk, plan_chunks
from kvd.transport.nccl import Communicator

log = logging.getLogger(__name__)

_STOP = object()
SETTLE = object()  # a step waits for the last NCCL call to be accepted (see _steps)
STAGING_BUFFERS = 2  # double buffering: gather (or scatter) one chunk while one is on the wire
# An inline job is polled at every turn of the loop while its bytes should still be moving
# (this long, plus its bytes at this rate), then every _INLINE_POLL_S.
_INLINE_SPIN_S = 0.002
_INLINE_SPIN_BYTES_PER_S = 300e9
_INLINE_POLL_S = 0.0002


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
    inline: bool = False  # run from the event loop (_start_inline), not the channel's thread


@dataclass(frozen=True)
class _Last:
    """A job's last step: all its work is queued, ``event`` fires when its bytes are there
    (sent, or stored in their blocks)."""

    event: Any


@dataclass(eq=False)
class _InlineRun:
    """An inline job in progress (``NcclChannel._start_inline``)."""

    job: NcclJob
    comm: Communicator
    loop: asyncio.AbstractEventLoop
    steps: Generator[Any, None, int]  # NcclChannel._steps
    spin_until: float  # time.monotonic(): poll at every loop turn until then
    wait: Any = None  # what the current step waits for (SETTLE, an event, or _Last); None:
    # the first step has not run yet
    locked: bool = True  # holds the channel's _comm_lock (until its last step, _Last)


class NcclChannel:
    """One direction ("send" or "recv") of a 2-rank communicator, run by its own thread."""

    def __init__(self, name: str, device: torch.device, direction: str, chunk_bytes: int,
                 on_failed: Callable[[NcclChannel, KvdError], None] | None = None,
                 inline: bool = True, blocking_calls: bool = True) -> None:
        if direction not in ("send", "recv"):
            raise ValueError(direction)
        self.name = name
        self.device = device
        self.direction = direction
        self.chunk_bytes = chunk_bytes
        self.inline = inline
        self.blocking_calls = blocking_calls  # see kvd/transport/nccl.py
        self.last_used = time.monotonic()
        self.failed: KvdError | None = None
        self._on_failed = on_failed
        self._comm: Communicator | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._staging: list[torch.Tensor] = []
        # Per staging buffer, the event after which the last job's work no longer reads or
        # writes it (None: free): the next job's first copies into it wait for that.
        self._staging_free: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
        self._busy = 0  # items queued, or jobs still issuing their work
        self._tails = 0  # jobs whose work is all queued, waiting for their last event
        self._unconfirmed = 0  # sends the receiver has not confirmed yet (the loop's count)
        self._loop: asyncio.AbstractEventLoop | None = None  # polls the thread's tails
        self.jobs_inline = 0  # jobs run from the loop (_start_inline), for stats and tests
        self.jobs_threaded = 0
        self.jobs_overlapped = 0  # jobs that started while an earlier one's bytes moved
        self._lock = threading.Lock()
        # Held by whoever issues a job's work, from its first call to its last step: the
        # thread for its jobs, the loop for an inline one (see _start_inline).
        self._comm_lock = threading.Lock()
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
        """Run ``job`` after every job submitted before it. Called on the event loop."""
        self.last_used = time.monotonic()
        if self._loop is None:
            # (No loop: the thread waits for its jobs' tails itself.)
            with contextlib.suppress(RuntimeError):
                self._loop = asyncio.get_running_loop()
        if not (self.inline and self._start_inline(job)):
            self._queue(job)
        return job.future

    def _queue(self, item: Any) -> None:
        """Work for the thread; the channel is busy (not evictable) until it is done."""
        with self._lock:
            self._busy += 1
        self._jobs.put(item)

    @property
    def idle(self) -> bool:
        return self._busy == 0 and self._tails == 0 and self._unconfirmed == 0

    def until_confirmed(self) -> Callable[[], None]:
        """Keep the channel from being idle (so from eviction) until the returned function
        is called (on the loop; once is enough), when the receiver has said it has a send's
        bytes. A send is complete once its bytes have *left*: between nodes they may still
        be on their way (NCCL's proxies), and aborting the communicator then would cut the
        receiver off (seen over NCCL's socket transport; NVLink hides it)."""
        self._unconfirmed += 1
        pending = True

        def confirmed() -> None:
            nonlocal pending
            if pending:
                pending = False
                self._unconfirmed -= 1

        return confirmed

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
                    with self._comm_lock:
                        self._warm(item[1])
                finally:
                    self._done(tail=False)
                continue
            self._run_job(item)

    def _run_job(self, job: NcclJob) -> None:
        """Issue ``job``'s work in the thread, then hand its tail to the loop."""
        if not job.future.set_running_or_notify_cancel():
            # Nobody waits for it any more, but the peer's matching job will run: send
            # zeros / drop the bytes, so the pair stays in step.
            job = dataclasses.replace(job, blocks=None, abandoned=True,
                                      future=concurrent.futures.Future())
            job.future.set_running_or_notify_cancel()
        try:
            # An inline job started before this one may still be issuing its work.
            if not self._comm_lock.acquire(timeout=self._remaining(job)):
                raise PeerUnreachable(f"transfer {job.transfer_id} on {self.name} ran out "
                                      "of time behind the job before it")
            try:
                if self.failed is not None:
                    raise self.failed
                self._started(job)
                self.jobs_threaded += 1
                comm, steps, last = self._issue(job)
            finally:
                self._comm_lock.release()
        except BaseException as exc:
            err = self._as_error(exc)
            self._fail(err)
            job.future.set_exception(self.failed or err)
            self._done(tail=False)
            return
        self._to_tail()
        loop = self._loop
        if loop is not None:
            run = _InlineRun(job, comm, loop, steps, self._spin_until(job), wait=last,
                             locked=False)
            try:
                loop.call_soon_threadsafe(self._poll_inline, run)
                return
            except RuntimeError:  # the loop is closed: wait here
                pass
        self._wait_tail(job, comm, steps, last)

    def _wait_tail(self, job: NcclJob, comm: Communicator,
                   steps: Generator[Any, None, int], last: _Last) -> None:
        """The tail of a job, waited for in the thread (there is no loop to poll it)."""
        try:
            comm.wait(last.event, self._remaining(job),
                      f"{self.direction} of transfer {job.transfer_id}")
            self._resolve(job, _finish(steps))
        except BaseException as exc:
            err = self._as_error(exc)
            self._fail(err)
            job.future.set_exception(self.failed or err)
        self._done(tail=True)

    def _started(self, job: NcclJob) -> None:
        job.started_at = time.monotonic()
        if self._tails:
            self.jobs_overlapped += 1
        timeline.mark(f"nccl.{self.direction}.start")

    def _to_tail(self) -> None:
        """The job issuing its work has queued it all."""
        with self._lock:
            self._busy -= 1
            self._tails += 1

    def _spin_until(self, job: NcclJob) -> float:
        return (job.started_at + _INLINE_SPIN_S
                + (job.nbytes or 0) / _INLINE_SPIN_BYTES_PER_S)

    def _resolve(self, job: NcclJob, nbytes: int) -> None:
        if job.abandoned or job.blocks is None:
            # Received and dropped as asked: the channel stays usable.
            job.future.set_exception(Cancelled(
                f"transfer {job.transfer_id} was given up; its bytes were dropped"))
        else:
            job.future.set_result(nbytes)

    def _as_error(self, exc: BaseException) -> KvdError:
        return exc if isinstance(exc, KvdError) else TransferFailed(
            f"nccl {self.direction} on {self.name}: {exc!r}")

    def _done(self, tail: bool) -> None:
        """A queued item or a job ended: in its tail, or before (failed, or not a job)."""
        timeline.mark(f"nccl.{self.direction}.end")
        with self._lock:
            if tail:
                self._tails -= 1
            else:
                self._busy -= 1
        self.last_used = time.monotonic()

    # ------------------------------------------------------------ inline jobs

    def _start_inline(self, job: NcclJob) -> bool:
        """Run ``job`` from the event loop's own thread when nothing is queued here or
        issuing its work (so nothing may go first; jobs in their tail may be): the loop
        runs the job's steps
        (``_steps``: NCCL calls, one group when no chunk needs staging, and the gathers or
        scatters of staged chunks) and polls what each waits for between its other
        callbacks. That skips two thread hand-offs, each ~100-150 us on the H200 host (the
        thread's wake-up with the GIL, then the loop's when the future is set). Returns
        False when the job must go to the thread instead: the channel is busy, the bytes
        are to be dropped, or its staging must grow first (growing waits for the GPU)."""
        comm = self._comm
        if (comm is None or self.failed is not None or self._busy or job.blocks is None
                or job.abandoned or not all(t.is_cuda for t in job.blocks.tensors)):
            # Host memory stays off the loop: a copy between a GPU and pageable memory
            # (the pool, unpinned by default) or a host-side index_select blocks the caller
            # until the stream gets there, which is behind the NCCL kernel; a kernel whose
            # peer froze or died never gets there, and the abort that would end it comes
            # from this loop (seen: a peer resumed after SIGSTOP hung its daemon for good).
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        chunks = plan_chunks(job.layout, job.num_blocks, job.chunk_bytes or self.chunk_bytes)
        direct = job.blocks.direct_chunks(chunks, self.device)
        if _only_direct(direct) is None and (
                not self._staging or self._staging[0].numel() < largest_chunk(chunks)):
            return False
        if not self._comm_lock.acquire(blocking=False):
            return False
        if not job.future.set_running_or_notify_cancel():
            self._comm_lock.release()
            return False
        with self._lock:
            self._busy += 1
        self.jobs_inline += 1
        job.inline = True
        self._started(job)
        nbytes = sum(c.nbytes for c in chunks)
        run = _InlineRun(job, comm, loop, self._steps(job), job.started_at + _INLINE_SPIN_S
                         + nbytes / _INLINE_SPIN_BYTES_PER_S)
        self._poll_inline(run)  # the first step (the first NCCL call) now
        return True

    def _issue_direct(self, comm: Communicator, job: NcclJob,
                      bufs: Sequence[torch.Tensor]) -> None:
        """All of a job's chunks, straight from (into) its blocks, as one NCCL group."""
        if self.direction == "send":
            wait_ready(job.ready_events, self._comm_stream)
        timeline.mark("nccl.call")
        comm.start(self.direction, bufs, 1 if self.direction == "send" else 0,
                   self._comm_stream)

    def _poll_inline(self, run: _InlineRun) -> None:
        """One look at an inline job (or at a tail the thread handed over), from the loop:
        if what its step waits for is done, run the next step; again at the next turn (or
        shortly) until the last step is done or the job's deadline passes. At its last
        step (``_Last``) the job lets go of the channel: the next may issue its work."""
        job = run.job
        try:
            if run.comm.aborted:
                raise PeerUnreachable(f"nccl communicator {self.name} was aborted")
            if run.wait is None:
                ready = True
            elif run.wait is SETTLE:
                ready = run.comm.settled(self.direction)
            elif isinstance(run.wait, _Last):
                ready = run.wait.event.query()
            else:
                ready = run.wait.query()
            if ready:
                try:
                    run.wait = run.steps.send(None)
                except StopIteration as stop:
                    if run.comm.aborted:  # an abort ends the kernels too: the event fires
                        raise PeerUnreachable(
                            f"nccl communicator {self.name} was aborted") from None
                    self._resolve(job, int(stop.value))
                    self._done(tail=True)
                    return
                if isinstance(run.wait, _Last) and run.locked:
                    run.locked = False
                    self._comm_lock.release()
                    self._to_tail()
                run.loop.call_soon(self._poll_inline, run)
                return
            if time.monotonic() > job.deadline:
                raise KvdTimeout(f"nccl {self.direction} of transfer {job.transfer_id} on "
                                 f"{self.name} did not finish by its deadline; "
                                 "communicator aborted")
            if time.monotonic() < run.spin_until:
                run.loop.call_soon(self._poll_inline, run)
            else:
                run.loop.call_later(_INLINE_POLL_S, self._poll_inline, run)
        except BaseException as exc:
            run.steps.close()
            self._fail_inline(run, self._as_error(exc))

    def _fail_inline(self, run: _InlineRun, err: KvdError) -> None:
        """Abort (~0.5 s, so off the loop: in its default executor, which the loop joins
        when it closes, as ``NcclLinks`` does for teardown), then fail the job: once its
        future is done no kernel of it touches the blocks."""
        def fail() -> None:
            try:
                self._fail(err)
            finally:
                if run.locked:
                    self._comm_lock.release()
                run.job.future.set_exception(self.failed or err)
                self._done(tail=not run.locked)

        try:
            run.loop.run_in_executor(None, fail)
        except RuntimeError:  # the loop or its executor is shutting down: fail it here
            fail()

    def _init(self, unique_id: bytes, rank: int, timeout_s: float) -> None:
        try:
            self._comm = Communicator.init(unique_id, rank, timeout_s, self.name,
                                           blocking_calls=self.blocking_calls,
                                           connect=self._comm_stream)
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
            torch.cuda.synchronize(self.device)  # the jobs in their tail too
            self._staging = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                             for _ in range(STAGING_BUFFERS)]
            self._staging_free = [None] * STAGING_BUFFERS
        return self._staging[b]

    def _remaining(self, job: NcclJob) -> float:
        left = job.deadline - time.monotonic()
        if left <= 0:
            raise PeerUnreachable(f"transfer {job.transfer_id} on {self.name} ran out of time")
        return left

    def _plan(self, job: NcclJob) -> tuple[Communicator, tuple[Chunk, ...], int]:
        """The communicator, the transfer's chunks, and the staging size they need."""
        assert self._comm is not None
        chunks = plan_chunks(job.layout, job.num_blocks, job.chunk_bytes or self.chunk_bytes)
        return self._comm, chunks, largest_chunk(chunks)

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

    # A job's work is a generator of steps: between two yields it issues work (NCCL calls,
    # copies, events), and each yield is what to wait for before the next step — SETTLE
    # (the last NCCL call accepted), or, last, _Last: the event after which the bytes are
    # there (all calls accepted and all work queued by then). The thread runs the steps up
    # to _Last with blocking polls (_issue) and hands the tail to the loop; the loop runs
    # an inline job's with callbacks (_poll_inline): the same work either way.
    #
    # On a non-blocking communicator both call NCCL without waiting for the call to be
    # accepted, queue the copy-stream work that does not depend on it (the next chunk's
    # gather, the previous chunk's scatter) while NCCL launches it from its own thread
    # (~0.1 ms on the H200 host), and only then settle: nothing goes on the NCCL stream in
    # between. A blocking one (``nccl_blocking_calls``) has launched when the call returns:
    # no SETTLE step.

    def _steps(self, job: NcclJob) -> Generator[Any, None, int]:
        comm, chunks, size = self._plan(job)
        # A receive nobody wants any more drops its bytes (blocks None); a sender that gave
        # up has none already (it sends zeros).
        blocks = None if self.direction == "recv" and job.abandoned else job.blocks
        direct = self._prepare(blocks, chunks, size)
        timeline.mark(f"nccl.{self.direction}.prepared")
        bufs = _only_direct(direct)
        if bufs is not None:  # one grouped call
            self._issue_direct(comm, job, bufs)
            if not comm.blocking:
                yield SETTLE
            timeline.mark("nccl.settled")
            yield _Last(gpu_copy.recorded(self._comm_stream))
        elif self.direction == "send":
            yield from self._send_staged(job, comm, chunks, blocks, direct)
        else:
            yield from self._recv_staged(job, comm, chunks, blocks, direct)
        return sum(c.nbytes for c in chunks)

    def _issue(self, job: NcclJob) -> tuple[Communicator, Generator[Any, None, int], _Last]:
        """Run ``job``'s steps up to its last (blocking polls): its communicator, its steps
        (to finish once the last event fired) and that last step."""
        comm = self._comm
        assert comm is not None
        steps = self._steps(job)
        wait = next(steps)
        while not isinstance(wait, _Last):
            if wait is SETTLE:
                comm.settle(self._remaining(job), self.direction)
            else:
                comm.wait(wait, self._remaining(job),
                          f"{self.direction} of transfer {job.transfer_id}")
            wait = steps.send(None)
        return comm, steps, wait

    def _send_staged(self, job: NcclJob, comm: Communicator, chunks: tuple[Chunk, ...],
                     blocks: BlockSet | None, direct: Sequence[torch.Tensor | None],
                     ) -> Generator[Any, None, None]:
        freed = list(self._staging_free)  # the job before may still send from them
        wait_ready(job.ready_events, self._copy_stream)  # NCCL waits on the copy stream
        buf = self._load(blocks, chunks[0], direct[0], 0, freed[0]) if chunks else None
        for k in range(len(chunks)):
            b = k % STAGING_BUFFERS
            assert buf is not None
            self._comm_stream.wait_event(gpu_copy.recorded(self._copy_stream))
            timeline.mark("nccl.call")
            comm.send(buf, 1, self._comm_stream, self._remaining(job), settle=False)
            if k + 1 < len(chunks):
                nb = (k + 1) % STAGING_BUFFERS
                buf = self._load(blocks, chunks[k + 1], direct[k + 1], nb, freed[nb])
            if not comm.blocking:
                yield SETTLE
            timeline.mark("nccl.settled")
            freed[b] = gpu_copy.recorded(self._comm_stream)
        self._staging_free = freed
        yield _Last(gpu_copy.recorded(self._comm_stream))

    def _recv_staged(self, job: NcclJob, comm: Communicator, chunks: tuple[Chunk, ...],
                     blocks: BlockSet | None, direct: Sequence[torch.Tensor | None],
                     ) -> Generator[Any, None, None]:
        stored = list(self._staging_free)  # the job before may still scatter from them
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
            if not comm.blocking:
                yield SETTLE
            timeline.mark("nccl.settled")
            if staged:
                arrived = gpu_copy.recorded(self._comm_stream)
                if blocks is not None:
                    landed = (chunk, buf, arrived, b)
                else:
                    stored[b] = arrived  # dropped: the buffer is free once received
        if landed is not None:
            scatter(*landed)
        self._staging_free = stored
        self._copy_stream.wait_stream(self._comm_stream)
        yield _Last(gpu_copy.recorded(self._copy_stream))

    def _release(self) -> None:
        comm = self._comm
        if comm is not None and self.failed is None:
            # A clean stop still aborts: destroy would wait for the peer, abort does not.
            comm.abort()
        self._staging = []


def _finish(steps: Generator[Any, None, int]) -> int:
    """The bytes of a job whose last event fired (its steps end after ``_Last``)."""
    try:
        steps.send(None)
    except StopIteration as stop:
        return int(stop.value)
    raise AssertionError("a job's steps went on after its last")


def _only_direct(direct: Sequence[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """Every chunk's memory, when each goes straight from (or into) it; else None."""
    bufs = [d for d in direct if d is not None]
    return bufs if bufs and len(bufs) == len(direct) else None
