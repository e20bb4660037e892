"""An NCCL channel: one direction between a local GPU and a GPU of a peer daemon.

Each channel owns a 2-rank communicator (``transport.nccl``), a worker thread, and its GPU
side (``transport.nccl_streams.ChannelStreams``: two CUDA streams on its device — one for
NCCL, one for the staging copies — and a few staging buffers of ``chunk_bytes``). The loop
submits jobs (``transport.nccl_job.NcclJob``) and awaits their futures; the worker runs
them in order, which is also the order the peer runs the matching jobs (both sides queue a
transfer's job when the receiver's ACCEPT is sent / arrives, or, for an eager offer, when
the OFFER is sent / arrives, and the peer link delivers those in order; see
``daemon.transfer``), so every NCCL send meets its recv. Every NCCL call, staging copy and
wait on a stream happens on the worker: the event loop only queues a job and, later, reads
its future. This module decides when the worker issues a job's work and how it waits;
``ChannelStreams`` what that work is.

A transfer is cut into chunks (``transport.chunks.plan_chunks``), staged or not, on the two
streams (``transport.nccl_streams``). Once a job's last work is queued on the streams (its
*tail*: one final event), the worker keeps it in a FIFO of tails and goes on to the next
queued job: consecutive transfers overlap, one's NCCL calls and copies issued while the
bytes of the one before are still moving. The streams keep them in order, and the staging
buffers, which both reuse, carry the event after which each is free again from one job to
the next. Between jobs (and between a job's steps) the worker looks at its oldest tails in
order and resolves each whose event fired: its future is set there, and the loop hears of
it through that future (``daemon.futures.on_loop``: one write to the loop's wake-up fd).
So a job crosses between the loop and the worker once each way, by design.

*The hand-off.* A thread asleep in a futex pays for its wake-up: ~100-150 us per hand-off
on the H200 host (a microVM whose idle vCPU halts; Python right after a 2 ms sleep runs ~4x
slower than hot, see ``daemon.busy_poll``). So the worker does not go back to sleep in its
queue while work flows: for ``_SPIN_S`` after its last job or tail it looks at the queue
without blocking, with ``os.sched_yield()`` between looks, and only then blocks. The
pause releases the GIL (the loop is never kept waiting for more than one look, a few
microseconds) and costs ~0.2 us, where ``time.sleep(0)`` costs the kernel's 50 us timer
slack (measured ~56-78 us). ``_SPIN_S`` is 2 ms: in a stream of transfers the next job
comes one round trip after the last (~0.5 ms on the H200 host), so it finds the worker
awake; a job after a longer quiet pays one wake-up, at most ~7 % of that quiet. While the
worker spins and the loop runs Python the two share the GIL (a spinning thread with a
GIL-releasing pause cost a busy thread ~10 % on a 2-core machine, a pure spin 2x), which is
why the window is short and ends by itself. The same pause serves a job's tail until its
bytes should be there (``_TAIL_SPIN_S`` plus its bytes at ``_TAIL_SPIN_BYTES_PER_S``);
after that the worker waits on its queue for at most ``_TAIL_POLL_S`` between looks at the
tail, so a new job still wakes it at once.

NCCL cannot stop a transfer half way without the peer: once a job has started it runs to
its end or to its deadline. A receive whose owner gave up before it started is still
received — into staging, and dropped — so the two ends stay in step. Any timeout or error
aborts the communicator (bounded, see ``transport.nccl``; ~0.5 s, on the worker, never on
the loop) and fails every later job: a channel that failed is never reused, the peer
plane makes a new one.

Timeline marks (``kvd.timeline``) show the hand-off: ``nccl.<dir>.queued`` (the loop
submits), ``.start`` (the worker took it), ``.issued`` (all its work queued: its tail
begins), ``.end`` (the tail's event fired, the future is set) and, while marks are
recorded, ``.seen`` (the loop ran the future's callback).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
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
from kvd.transport.nccl import Communicator
from kvd.transport.nccl_job import (
    SETTLE,
    LastStep,
    NcclJob,
    Steps,
    finish_steps,
    time_left,
)
from kvd.transport.nccl_streams import ChannelStreams

__all__ = ["NcclChannel"]

log = logging.getLogger(__name__)

_STOP = object()
# The worker's waits (the module's docstring, *The hand-off*, says why these numbers).
_SPIN_S = 0.002  # after the last job or tail: look at the queue without sleeping this long
# A tail is looked at without sleeping while its bytes should still be moving (this long,
# plus its bytes at this rate), then at most every _TAIL_POLL_S.
_TAIL_SPIN_S = 0.002
_TAIL_SPIN_BYTES_PER_S = 300e9
_TAIL_POLL_S = 0.0002


@dataclass(eq=False)
class _Tail:
    """A job whose work is all queued, waiting in the worker for its last event."""

    job: NcclJob
    comm: Communicator
    steps: Steps  # ChannelStreams.steps, finished once ``last`` fired
    last: LastStep
    spin_until: float  # time.monotonic(): look at it without sleeping until then


# GPU memory one end of a channel's communicator holds once NCCL has connected it (its
# buffers and the rest), staging aside: 68 MiB per channel for both ends, after the first
# of a process, on the H200 host with NCCL 2.28.9 between two hosts over its socket
# transport (benchmarks/nccl_channels.py). Other transports (NVLink, InfiniBand) and NCCL
# settings (NCCL_BUFFSIZE, channels) hold other amounts: an estimate for the budget
# (nccl_channel_memory_bytes), documented in docs/operations.md.
COMMUNICATOR_BYTES = 34 * 2**20


class NcclChannel:
    """One direction ("send" or "recv") of a 2-rank communicator, run by its own thread."""

    def __init__(self, name: str, device: torch.device, direction: str, chunk_bytes: int,
                 on_failed: Callable[[NcclChannel, KvdError], None] | None = None,
                 blocking_calls: bool = True) -> None:
        if direction not in ("send", "recv"):
            raise ValueError(direction)
        self.name = name
        self.device = device
        self.direction = direction
        self.chunk_bytes = chunk_bytes
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
        self.jobs = 0  # jobs the worker started, for stats and tests
        self.jobs_overlapped = 0  # jobs that started while an earlier one's bytes moved
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
        """Run ``job`` on the worker after every job submitted before it; its future is set
        there. Called on the event loop (or any thread): it only queues."""
        self.last_used = time.monotonic()
        timeline.mark(f"nccl.{self.direction}.queued")
        if timeline.recording():
            self._mark_seen(job)
        self._queue(job)
        return job.future

    def _mark_seen(self, job: NcclJob) -> None:
        """Mark ``nccl.<dir>.seen`` when the submitting loop runs the job's future's
        callbacks: the hand-off back, as the loop sees it. Only while marks are recorded
        (it costs a second wake-up of the loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        name = f"nccl.{self.direction}.seen"

        def settled(_fut: concurrent.futures.Future[int]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(timeline.mark, name)

        job.future.add_done_callback(settled)

    def _queue(self, item: Any) -> None:
        """Work for the thread; the channel is busy (not evictable) until it is done."""
        with self._lock:
            self._busy += 1
        self._jobs.put(item)

    @property
    def gpu_bytes(self) -> int:
        """What it holds of its GPU's memory, as the budget counts it: its communicator
        (``COMMUNICATOR_BYTES``) and its staging buffers."""
        return COMMUNICATOR_BYTES + self._streams.staging_bytes

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
        """Abort the communicator now (from any thread but the loop's: it takes ~0.5 s):
        jobs in flight fail at the worker's next look, queued ones at once."""
        if self.failed is None:
            self.failed = error
        comm = self._comm
        if comm is not None:
            comm.abort()

    def stop(self, timeout_s: float) -> bool:
        self._jobs.put(_STOP)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------ the worker

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        self._streams.open()
        tails: collections.deque[_Tail] = collections.deque()
        active = time.monotonic()  # when the last job was taken or tail ended
        try:
            while True:
                item = self._next(tails, active)
                if item is _STOP:
                    return
                if item is not None:
                    self._handle(item, tails)
                    active = time.monotonic()
                if tails and self._reap(tails):
                    active = time.monotonic()
        finally:
            self._release(tails)

    def _next(self, tails: collections.deque[_Tail], active: float) -> Any:
        """The next queued item, or None when it is time to look at the tails again (the
        module's docstring, *The hand-off*)."""
        try:
            return self._jobs.get_nowait()
        except queue.Empty:
            pass
        now = time.monotonic()
        if tails:
            if now < tails[0].spin_until:
                os.sched_yield()  # (releases the GIL)
                return None
            try:
                return self._jobs.get(timeout=_TAIL_POLL_S)
            except queue.Empty:
                return None
        if now - active < _SPIN_S:
            os.sched_yield()
            return None
        return self._jobs.get()  # idle: sleep until the next item (stop() sends one too)

    def _handle(self, item: Any, tails: collections.deque[_Tail]) -> None:
        if isinstance(item, NcclJob):
            self._run_job(item, tails)
        elif item[0] == "init":
            self._init(*item[1:])
        else:
            try:
                self._warm(item[1])
            finally:
                self._done(tail=False)

    def _run_job(self, job: NcclJob, tails: collections.deque[_Tail]) -> None:
        """Issue ``job``'s work, then keep it among the tails."""
        if not job.future.set_running_or_notify_cancel():
            # Nobody waits for it any more, but the peer's matching job will run: send
            # zeros / drop the bytes, so the pair stays in step.
            job = dataclasses.replace(job, blocks=None, abandoned=True,
                                      future=concurrent.futures.Future())
            job.future.set_running_or_notify_cancel()
        try:
            if self.failed is not None:
                raise self.failed
            self._started(job, overlapping=bool(tails))
            comm, steps, last = self._issue(job, tails)
        except BaseException as exc:
            err = self._as_error(exc)
            self._fail(err)
            job.future.set_exception(self.failed or err)
            self._done(tail=False)
            return
        with self._lock:
            self._busy -= 1
            self._tails += 1
        timeline.mark(f"nccl.{self.direction}.issued")
        tails.append(_Tail(job, comm, steps, last,
                           job.started_at + _TAIL_SPIN_S
                           + (job.nbytes or 0) / _TAIL_SPIN_BYTES_PER_S))

    def _issue(self, job: NcclJob, tails: collections.deque[_Tail]
               ) -> tuple[Communicator, Steps, LastStep]:
        """Run ``job``'s steps up to its last (blocking polls; the tails before it are
        looked at between steps): its communicator, its steps (to finish once the last
        event fired) and that last step."""
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
            if tails:
                self._reap(tails)
            wait = steps.send(None)
        return comm, steps, wait

    def _reap(self, tails: collections.deque[_Tail]) -> bool:
        """Resolve the oldest tails whose last event fired, in order (the streams finish
        them in order); fail them once the communicator was aborted, and abort it when a
        tail's deadline passed. True if any tail ended."""
        ended = False
        while tails:
            tail = tails[0]
            try:
                fired = tail.last.event.query()
                if tail.comm.aborted:  # an abort ends the kernels too: the event fires
                    raise PeerUnreachable(f"nccl communicator {self.name} was aborted")
                if not fired:
                    now = time.monotonic()
                    late = next((t for t in tails if now > t.job.deadline), None)
                    if late is None:
                        return ended
                    raise KvdTimeout(
                        f"nccl {self.direction} of transfer {late.job.transfer_id} on "
                        f"{self.name} did not finish by its deadline; communicator aborted")
                nbytes = finish_steps(tail.steps)
            except BaseException as exc:
                # The abort (in _fail) ends every tail's kernels: each fails in turn.
                tails.popleft()
                tail.steps.close()
                err = self._as_error(exc)
                self._fail(err)
                tail.job.future.set_exception(self.failed or err)
                self._done(tail=True)
                ended = True
                continue
            tails.popleft()
            timeline.mark(f"nccl.{self.direction}.end")  # (before the future's callbacks)
            self._resolve(tail.job, nbytes)
            self._done(tail=True, mark=False)
            ended = True
        return ended

    def _started(self, job: NcclJob, overlapping: bool) -> None:
        job.started_at = time.monotonic()
        self.jobs += 1
        if overlapping:
            self.jobs_overlapped += 1
        timeline.mark(f"nccl.{self.direction}.start")

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

    def _done(self, tail: bool, mark: bool = True) -> None:
        """A queued item or a job ended: in its tail, or before (failed, or not a job)."""
        if mark:
            timeline.mark(f"nccl.{self.direction}.end")
        with self._lock:
            if tail:
                self._tails -= 1
            else:
                self._busy -= 1
        self.last_used = time.monotonic()

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

    def _release(self, tails: collections.deque[_Tail]) -> None:
        """The worker ends (stopped): abort, then fail the tails still waiting (the abort
        ended their kernels), and let the staging go."""
        comm = self._comm
        if comm is not None and self.failed is None:
            # A clean stop still aborts: destroy would wait for the peer, abort does not.
            comm.abort()
        err = self.failed or PeerUnreachable(f"nccl channel {self.name} stopped")
        while tails:
            tail = tails.popleft()
            tail.steps.close()
            tail.job.future.set_exception(err)
            self._done(tail=True)
        self._streams.release()
