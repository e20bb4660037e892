"""kvd.daemon.futures: on_loop, a loop future for a concurrent one, settled through the loop
when a worker thread settles the concurrent one (one wake-up of the loop), at once when
the loop's own thread does; time_out, one timer for a wait."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from kvd.daemon.futures import TimedOut, on_loop, time_out
from kvd.errors import TransferFailed


def test_settled_on_the_loop_thread_is_done_at_once() -> None:
    async def main() -> None:
        cfut: concurrent.futures.Future[int] = concurrent.futures.Future()
        afut = on_loop(cfut)
        cfut.set_result(7)
        assert afut.done()  # no turn of the loop in between (wrap_future needs one)
        assert await afut == 7

    asyncio.run(main())


def test_settled_on_another_thread_arrives_through_the_loop() -> None:
    async def main() -> None:
        cfut: concurrent.futures.Future[int] = concurrent.futures.Future()
        afut = on_loop(cfut)
        thread = threading.Thread(target=cfut.set_exception,
                                  args=(TransferFailed("lost on the way"),))
        thread.start()
        with pytest.raises(TransferFailed, match="lost on the way"):
            await asyncio.wait_for(afut, 5)
        thread.join()

    asyncio.run(main())


def test_cancelling_either_side_cancels_the_other() -> None:
    async def main() -> None:
        cfut: concurrent.futures.Future[int] = concurrent.futures.Future()
        afut = on_loop(cfut)
        afut.cancel()
        await asyncio.sleep(0)
        assert cfut.cancelled()

        cfut2: concurrent.futures.Future[int] = concurrent.futures.Future()
        afut2 = on_loop(cfut2)
        assert cfut2.cancel()
        assert afut2.cancelled()

    asyncio.run(main())


def test_already_settled_and_late_results_after_the_loop_closed() -> None:
    async def main() -> concurrent.futures.Future[int]:
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        done.set_result(3)
        assert await on_loop(done) == 3
        pending: concurrent.futures.Future[int] = concurrent.futures.Future()
        on_loop(pending)
        return pending

    pending = asyncio.run(main())
    # The loop is closed: a result from another thread is dropped, not raised there.
    errors: list[BaseException] = []

    def finish() -> None:
        try:
            pending.set_result(1)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=finish)
    thread.start()
    thread.join()
    assert not errors


def test_time_out_settles_what_is_awaited_unless_it_is_done_or_the_timer_cancelled() -> None:
    """kvd.daemon.futures.time_out: a get's and a pull's one timer."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        waiting: asyncio.Future[int] = loop.create_future()
        time_out(waiting, 0.01)
        with pytest.raises(TimedOut):
            await waiting
        answered: asyncio.Future[int] = loop.create_future()
        time_out(answered, 0.01)
        answered.set_result(3)
        await asyncio.sleep(0.03)
        assert answered.result() == 3  # done first: left alone
        kept: asyncio.Future[int] = loop.create_future()
        time_out(kept, 0.01).cancel()
        await asyncio.sleep(0.03)
        assert not kept.done()

    asyncio.run(main())
