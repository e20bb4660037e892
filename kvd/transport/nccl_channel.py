"""An NCCL channel: one direction between a local GPU and a GPU of a peer daemon.

Each channel owns a 2-rank communicator (``transport.nccl``), a worker thread, and its GPU
side (``transport.nccl_streams.ChannelStreams``: two CUDA streams on its device — one for
NCCL, one for the staging copies — and a few staging buffers of ``chunk_bytes``). The loop
submits jobs (``transport.nccl_job.NcclJob``) and awaits their futures; the thread runs
them in order, which is also the order the peer runs the matching jobs (both sides queue a
transfer's job when the receiver's ACCEPT is sent / arrives, or, for an eager offer, when
the OFFER is sent / arrives, and the peer link delivers those in order; see
``daemon.transfer.transfers``), so every NCCL send meets its recv. This module decides who issues a
job's work (the thread, or the loop for an inline job) and when; ``ChannelStreams`` what
that work is.

A transfer is cut into chunks (``transport.chunks.plan_chunks``), staged or not, on the two
streams (``transport.nccl_streams``); the thread only enqueues work. Once a job's last work
is queued on the streams (its *tail*: one final event, polled from the loop against the
transfer's deadline), the next job may queue its own behind it: consecutive transfers
overlap, one's NCCL calls and copies issued while the bytes of the one before are still
moving. The streams keep them in order, and the staging buffers, which both reuse, carry
the event after which each is free again from one job to the next.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvd import timeline
from kvd.errors import Cancelled, KvdError, KvdTimeout, PeerUnreachable, TransferFailed
from kvd.transport import gpu_copy
from kvd.transport.chunks import largest_chunk, plan_chunks
from kvd.transport.nccl import Communicator
from kvd.transport.nccl_job import (
    SETTLE,
    LastStep,
    NcclJob,
    Steps,
    finish_steps,
    only_direct,
    time_left,
)
from kvd.transport.nccl_streams import ChannelStreams

__all__ = ["NcclChannel"]

log = logging.getLogger(__name__)

_STOP = object()
# An inline job is polled at every turn of the loop while its bytes should still be moving
# (this long, plus its bytes at this rate), then every _INLINE_POLL_S.
_INLINE_SPIN_S = 0.002
_INLINE_SPIN_BYTES_PER_S = 300e9
_INLINE_POLL_S = 0.0002


@dataclass(eq=False)
class _InlineRun:
    """An inline job in progress (``NcclChannel._start_inline``)."""

    job: NcclJob
    comm: Communicator
    loop: asyncio.AbstractEventLoop
    steps: Steps  # ChannelStreams.steps
    spin_until: float  # time.monotonic(): poll at every loop turn until then
    wait: Any = None  # what the current step waits for (SETTLE, an event, or LastStep); None:
    # the first step has not run yet
    locked: bool = True  # holds the channel's _comm_lock (until its last step, LastStep)


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
        self._streams = ChannelStreams(name, device, direction, chunk_bytes)
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
        self._streams.open()
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
            if not self._comm_lock.acquire(timeout=time_left(job, self.name)):
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
                   steps: Steps, last: LastStep) -> None:
        """The tail of a job, waited for in the thread (there is no loop to poll it)."""
        try:
            comm.wait(last.event, time_left(job, self.name),
                      f"{self.direction} of transfer {job.transfer_id}")
            self._resolve(job, finish_steps(steps))
        except BaseException as exc:
            err = self._as_error(exc)
            self._fail(err)
            job.future.set_exception(self.failed or err)
        self._done(tail=True)

    def _issue(self, job: NcclJob) -> tuple[Communicator, Steps, LastStep]:
        """Run ``job``'s steps up to its last (blocking polls): its communicator, its steps
        (to finish once the last event fired) and that last step."""
        comm = self._comm
        assert comm is not None
        steps = self._streams.steps(job, comm)
        wait = next(steps)
        while not isinstance(wait, LastStep):
            if wait is SETTLE:
                comm.settle(time_left(job, self.name), self.direction)
            else:
                comm.wait(wait, time_left(job, self.name),
                          f"{self.direction} of transfer {job.transfer_id}")
            wait = steps.send(None)
        return comm, steps, wait

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
        runs the job's steps (``ChannelStreams.steps``: NCCL calls, one group when no
        chunk needs staging, and the gathers or scatters of staged chunks) and polls what
        each waits for between its other callbacks. That skips two thread hand-offs, each
        ~100-150 us on the H200 host (the thread's wake-up with the GIL, then the loop's
        when the future is set). Returns False when the job must go to the thread
        instead: the channel is busy, the bytes are to be dropped, or its staging must
        grow first (growing waits for the GPU)."""
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
        if only_direct(direct) is None and not self._streams.holds(largest_chunk(chunks)):
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
        run = _InlineRun(job, comm, loop, self._streams.steps(job, comm),
                         job.started_at + _INLINE_SPIN_S
                         + nbytes / _INLINE_SPIN_BYTES_PER_S)
        self._poll_inline(run)  # the first step (the first NCCL call) now
        return True

    def _poll_inline(self, run: _InlineRun) -> None:
        """One look at an inline job (or at a tail the thread handed over), from the loop:
        if what its step waits for is done, run the next step; again at the next turn (or
        shortly) until the last step is done or the job's deadline passes. At its last
        step (``LastStep``) the job lets go of the channel: the next may issue its work."""
        job = run.job
        try:
            if run.comm.aborted:
                raise PeerUnreachable(f"nccl communicator {self.name} was aborted")
            if run.wait is None:
                ready = True
            elif run.wait is SETTLE:
                ready = run.comm.settled(self.direction)
            elif isinstance(run.wait, LastStep):
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
                if isinstance(run.wait, LastStep) and run.locked:
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
                                           connect=self._streams.comm_stream)
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
        stream = self._streams.comm_stream
        try:
            buf = torch.zeros(8, dtype=torch.uint8, device=self.device)
            if self.direction == "send":
                self._comm.send(buf, 1, stream, timeout_s)
            else:
                self._comm.recv(buf, 0, stream, timeout_s)
            self._comm.wait(gpu_copy.recorded(stream), timeout_s, "warm-up message")
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

    def _release(self) -> None:
        comm = self._comm
        if comm is not None and self.failed is None:
            # A clean stop still aborts: destroy would wait for the peer, abort does not.
            comm.abort()
        self._streams.release()


