"""Loop futures for work that other threads (or the loop itself) finish.

``on_loop`` is ``asyncio.wrap_future`` for the daemon's worker threads (NCCL channels,
copies, TCP channels): a result set on another thread reaches the loop through
``call_soon_threadsafe``, one write to the loop's wake-up fd: the one hand-off back per
job. A result set on the loop's own thread (a future the loop settles itself) is copied
at once instead of taking another turn of the loop, which ``wrap_future`` would.
Cancelling the loop future cancels the concurrent one, as ``wrap_future`` does, unless
``cancels_job`` is False: then a task awaiting it directly is as ``asyncio.shield`` would
make it (a cancel of the task leaves the job running) without the shield's extra turn of
the loop between the job's end and the task's wake-up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def on_loop(cfut: concurrent.futures.Future[T], cancels_job: bool = True
            ) -> asyncio.Future[T]:
    """An asyncio future of the running loop that settles as ``cfut`` does."""
    loop = asyncio.get_running_loop()
    afut: asyncio.Future[T] = loop.create_future()
    loop_thread = threading.get_ident()

    def settled(src: concurrent.futures.Future[T]) -> None:
        if threading.get_ident() == loop_thread:
            _copy(src, afut)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(_copy, src, afut)

    def cancelled(dest: asyncio.Future[T]) -> None:
        if dest.cancelled():
            cfut.cancel()

    if cancels_job:
        afut.add_done_callback(cancelled)
    cfut.add_done_callback(settled)
    return afut


def _copy(src: concurrent.futures.Future[T], dest: asyncio.Future[T]) -> None:
    if dest.done():
        return
    if src.cancelled():
        dest.cancel()
        return
    exc = src.exception()
    if exc is not None:
        dest.set_exception(exc)
    else:
        dest.set_result(src.result())


def settle_awaited(future: asyncio.Future[Any], wake: asyncio.Future[Any],
                   result: Any) -> None:
    """Settle ``future`` and ``wake`` with ``result`` (an exception is raised by whoever
    awaits either), once: later calls are moot. ``wake`` is what a request's task awaits
    in place of ``future``: a cancel of the task cancels only ``wake``, and ``future``
    stays for the cancel path to wait on (bytes still landing), as ``asyncio.shield``
    would leave it but without the shield's extra loop turn. An exception is marked
    retrieved: the task may be gone, with nobody left to raise it."""
    if future.done():
        return
    for fut in (future, wake):
        if fut.done():
            continue
        if isinstance(result, BaseException):
            fut.set_exception(result)
            fut.exception()  # (retrieved)
        else:
            fut.set_result(result)


def keep_task(tasks: set[asyncio.Task[T]], coro: Coroutine[Any, Any, T],
              name: str | None = None) -> asyncio.Task[T]:
    """Run ``coro`` as a task that ``tasks`` holds until it ends (the loop holds a task
    only weakly; its owner cancels or awaits what ``tasks`` holds when it stops)."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


class TimedOut(Exception):
    """Raised where a future settled by ``time_out`` is awaited."""


def time_out(fut: asyncio.Future[Any], delay_s: float) -> asyncio.TimerHandle:
    """Settle ``fut`` with ``TimedOut`` in ``delay_s`` unless it is done by then (cancel
    the handle once it is): one timer, where ``asyncio.timeout`` costs a context manager,
    a task cancel and an uncancel per wait (~2% of a receiving daemon's CPU with 64 gets
    waiting at once, py-spy)."""
    def fire() -> None:
        if not fut.done():
            fut.set_exception(TimedOut())

    return fut.get_loop().call_later(delay_s, fire)


async def wait_out(fut: asyncio.Future[Any], timeout_s: float) -> bool:
    """Wait until ``fut`` settles (at most ``timeout_s``), and let no cancel cut the wait
    short: for work that must end before its request answers, such as bytes still landing
    in a client's blocks (a second cancel, or one after a timeout, would otherwise answer
    while they land). True if a cancel came meanwhile: the caller raises it once done.
    ``fut``'s outcome is left to its owner."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    cancelled = False
    while not fut.done() and (left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait([fut], timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled
