"""Copies within the daemon: scheduled from the loop, run in the copy worker, on the loop
itself, or queued on the GPU.

``LocalCopies`` is the submit-and-await shape of the local transport, as the channels are
for TCP and NCCL: ``copy`` runs a host copy (in the ``CopyWorker``, or right on the loop
when it is small enough to cost less than the thread hand-offs) and ``copy_blocks`` moves
blocks between two regions (between GPU regions: queued from the loop, its completion
polled there). Every copy keeps the regions it touches mapped until it has ended
(``hold_regions``), also past a cancel; an awaited copy that is cancelled returns only
once its bytes have landed. Each copy is recorded in the metrics as a local transfer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from kvd import timeline
from kvd.daemon.busy_poll import BusyPoll
from kvd.daemon.futures import keep_task, on_loop, wait_out
from kvd.daemon.metrics import Metrics
from kvd.errors import TransferFailed
from kvd.memory.regions import Region
from kvd.transport import local
from kvd.transport.chunks import BlockSet

log = logging.getLogger(__name__)
_T = TypeVar("_T")

INLINE_COPY_BYTES = 256 * 1024
# A GPU copy queued from the loop (Engine._gpu_copy_on_loop) is polled at every turn for
# its expected time (bytes at this rate, plus this much), then every _GPU_COPY_POLL_S,
# and given up after _GPU_COPY_TIMEOUT_S plus 1 s per GB.
_GPU_COPY_SPIN_S = 0.002
_GPU_COPY_BYTES_PER_S = 200e9
_GPU_COPY_POLL_S = 0.0002
_GPU_COPY_TIMEOUT_S = 60.0



def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any, float]:
    """Run ``fn`` in the worker, with when it started and ended (for the metrics)."""
    started = time.monotonic()
    timeline.mark("copy.start")
    result = fn(*args)
    timeline.mark("copy.end")
    return started, result, time.monotonic()


def after_ready(source: Region, fn: Callable[..., _T], *args: Any) -> _T:
    """Run a copy that reads ``source`` after the writes its client recorded (interprocess
    CUDA events, see ``protocol.CudaIpcTensor.ready_event``)."""
    if source.ready_events:
        from kvd.memory.cuda_ipc import wait_ready

        wait_ready(source.ready_events)
    return fn(*args)



def _landed(events: list[torch.cuda.Event]) -> bool:
    """Whether every destination GPU has passed its copy's event (raises a CUDA error the
    copy met)."""
    return all(e.query() for e in events)


class LocalCopies:
    def __init__(self, worker: local.CopyWorker, busy_poll: BusyPoll, metrics: Metrics) -> None:
        self.worker = worker
        self.busy_poll = busy_poll
        self.metrics = metrics
        self._loop = asyncio.get_running_loop()
        self._copies_in_flight: dict[int, int] = {}  # id -> bytes
        self._region_copies: dict[int, set[asyncio.Future[Any]]] = {}
        self._background: set[asyncio.Task[None]] = set()  # GPU copies polled past a cancel

    async def copy(
        self, regions: Sequence[Region], nbytes: int, fn: Callable[..., int], *args: Any,
        gpu: bool = False,
    ) -> int:
        """Run a copy in the worker; if cancelled mid-copy, wait for it to finish first.

        A copy of at most INLINE_COPY_BYTES runs on the loop: it takes microseconds, less
        than the two thread hand-offs (and GIL switches) the worker would cost."""
        submitted = time.monotonic()
        if nbytes <= INLINE_COPY_BYTES and not gpu and not any(r.on_gpu for r in regions):
            try:
                result = fn(*args)
            except Exception:
                self._record_copy("failed", nbytes, 0.0, None)
                raise
            self._record_copy("done", nbytes, 0.0, time.monotonic() - submitted)
            return result
        cfut = self.worker.submit(_timed, fn, *args)
        self.busy_poll.thread_work(cfut)
        afut = on_loop(cfut)
        self._copies_in_flight[id(afut)] = nbytes
        outcome, started, ended = "failed", None, None
        self.hold_regions(regions, afut)
        try:
            try:
                started, result, ended = await asyncio.shield(afut)
                outcome = "done"
                return int(result)
            except asyncio.CancelledError:
                outcome = "cancelled"
                if not cfut.cancel():
                    await wait_out(afut, 60.0)
                raise
        finally:
            del self._copies_in_flight[id(afut)]
            self._record_copy(outcome, nbytes,
                              None if started is None else started - submitted,
                              None if started is None or ended is None else ended - started)

    async def copy_blocks(
        self, regions: Sequence[Region], nbytes: int, source: Region, src_idx: torch.Tensor,
        dst: Sequence[torch.Tensor], dst_idx: torch.Tensor, dst_blocks: BlockSet | None = None,
    ) -> int:
        """Blocks of ``source`` into blocks of another region (``regions``: both). Between
        GPU regions the copy is queued from the loop and its completion polled there
        (``_gpu_copy_on_loop``); otherwise, or where the copy kernel cannot describe the
        memory, in the copy worker."""
        if source.on_gpu and dst and dst[0].is_cuda:
            done = await self._gpu_copy_on_loop(regions, nbytes, source, src_idx, dst,
                                                dst_idx, dst_blocks)
            if done is not None:
                return done
        return await self.copy(regions, nbytes, after_ready, source, local.copy_blocks,
                                source.tensors, src_idx, dst, dst_idx)

    async def _gpu_copy_on_loop(
        self, regions: Sequence[Region], nbytes: int, source: Region, src_idx: torch.Tensor,
        dst: Sequence[torch.Tensor], dst_idx: torch.Tensor, dst_blocks: BlockSet | None,
    ) -> int | None:
        """Queue a copy between GPU regions from the loop: kernel launches and stream
        waits, no wait for the GPU here. That saves the copy worker's two hand-offs
        (~200 us on the H200 host before the worker started, then its wait and the way
        back) and keeps the loop spinning (busy_poll) instead of pausing for a thread.
        The bytes are in when the destination's events complete, polled at every turn of
        the loop while the copy should still be running, then every 0.2 ms; the regions
        stay mapped until then, even past a cancel or the deadline. None: not queued."""
        submitted = time.monotonic()
        timeline.mark("local.gpu_copy.start")
        try:
            queued = after_ready(source, local.copy_gpu_blocks_queued, source.tensors,
                                  src_idx, dst, dst_idx, dst_blocks)
        except Exception:
            self._record_copy("failed", nbytes, 0.0, None)
            raise
        if queued is None:
            return None
        copied, events = queued
        timeline.mark("local.gpu_copy.queued")
        done: asyncio.Future[None] = self._loop.create_future()
        self.hold_regions(regions, done)
        self._copies_in_flight[id(done)] = nbytes
        busy_until = submitted + _GPU_COPY_SPIN_S + nbytes / _GPU_COPY_BYTES_PER_S
        deadline = submitted + _GPU_COPY_TIMEOUT_S + nbytes / 1e9
        outcome = "failed"
        handed_over = False  # to _landing, which settles ``done``
        try:
            # Polled here, in the request's own coroutine: no task, no wait_for, no loop
            # turn between the copy's end and the reply. Only a cancel or the deadline
            # hands the rest of the wait to a task that holds the regions (_landing).
            while not _landed(events):
                now = time.monotonic()
                if now > deadline:
                    handed_over = True
                    self._landing(events, done, nbytes, submitted)
                    raise TransferFailed(f"GPU copy of {nbytes} bytes did not complete "
                                         f"within {deadline - submitted:.0f}s")
                await asyncio.sleep(0 if now < busy_until else _GPU_COPY_POLL_S)
            timeline.mark("local.gpu_copy.done")
            done.set_result(None)
            outcome = "done"
            return copied
        except asyncio.CancelledError:
            outcome = "cancelled"
            if not done.done() and not handed_over:
                self._landing(events, done, nbytes, submitted)
            await wait_out(done, 60.0)  # bytes already on their way land first
            raise
        except BaseException as exc:  # a failed launch shows in the poll (a CUDA error)
            if not done.done() and not handed_over:
                done.set_exception(exc)
                done.exception()  # retrieved: raised to the request here
            raise
        finally:
            del self._copies_in_flight[id(done)]
            self._record_copy(outcome, nbytes, 0.0, time.monotonic() - submitted)

    def _landing(self, events: list[torch.cuda.Event], done: asyncio.Future[None],
                 nbytes: int, submitted: float) -> None:
        """Poll a GPU copy its request no longer waits for (cancelled, or past its
        deadline) until its bytes have landed, then settle ``done``, which releases the
        regions it writes into."""

        async def poll() -> None:
            try:
                while not _landed(events):
                    if time.monotonic() > submitted + _GPU_COPY_TIMEOUT_S + nbytes / 1e9:
                        # Still holding the regions: a GPU this late is stuck, but the
                        # copy may yet write into them.
                        log.error("a GPU copy of %d bytes is not done after %.0fs",
                                  nbytes, time.monotonic() - submitted)
                        await asyncio.sleep(1.0)
                    else:
                        await asyncio.sleep(_GPU_COPY_POLL_S)
                if not done.done():
                    done.set_result(None)
            except BaseException as exc:
                if not done.done():
                    done.set_exception(exc)
                    done.exception()  # retrieved: the request has gone

        keep_task(self._background, poll())

    def _record_copy(self, outcome: str, nbytes: int, queue_s: float | None,
                     wire_s: float | None) -> None:
        self.metrics.transfer(peer="local", direction="local", transport="local",
                              outcome=outcome, nbytes=nbytes, queue_s=queue_s, wire_s=wire_s)

    def in_flight(self) -> tuple[int, int]:
        """Local copies running or queued: how many, how many bytes."""
        return len(self._copies_in_flight), sum(self._copies_in_flight.values())

    def hold_regions(self, regions: Sequence[Region], fut: asyncio.Future[Any]) -> None:
        """Keep ``regions`` mapped until ``fut`` settles: call it when a thread starts
        reading or writing their memory, before anything else can run on the loop."""
        for region in regions:
            self._region_copies.setdefault(region.region_id, set()).add(fut)

        def release(_fut: asyncio.Future[Any]) -> None:
            for region in regions:
                pending = self._region_copies.get(region.region_id)
                if pending is not None:
                    pending.discard(fut)
                    if not pending:
                        del self._region_copies[region.region_id]

        fut.add_done_callback(release)

    def holding(self, region: Region) -> set[asyncio.Future[Any]]:
        """The copies that keep ``region`` mapped now."""
        return set(self._region_copies.get(region.region_id, ()))
