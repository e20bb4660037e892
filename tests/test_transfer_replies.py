"""``context.Replies``: the answers one send awaits, on a real loop."""

from __future__ import annotations

import asyncio

import pytest

from kvd.daemon.transfer.context import Replies
from kvd.errors import Cancelled
from kvd.protocol import Busy, XferDone


async def test_answers_are_taken_in_the_order_they_came() -> None:
    replies = Replies()
    busy, err = Busy(transfer_id=1, retry_after_s=0.05), Cancelled("gone")
    replies.put_nowait(busy)
    waiting = asyncio.ensure_future(replies.get())
    assert await waiting is busy
    waiting = asyncio.ensure_future(replies.get())
    await asyncio.sleep(0)  # it waits now
    replies.put_nowait(err)
    replies.put_nowait(XferDone(transfer_id=1, nbytes=8))
    assert await waiting is err
    assert await replies.get() == XferDone(transfer_id=1, nbytes=8)


async def test_an_answer_that_came_as_its_taker_was_cancelled_waits_for_the_next() -> None:
    """A send cancelled as its answer arrives asks again (``Sender._verdict``): the
    answer must still be there, not handed to the cancelled wait and lost."""
    replies = Replies()
    waiting = asyncio.ensure_future(replies.get())
    await asyncio.sleep(0)
    done = XferDone(transfer_id=7, nbytes=4096)
    replies.put_nowait(done)
    waiting.cancel()  # (before it ran again: the answer woke it, the cancel wins)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    async with asyncio.timeout(5):
        assert await replies.get() is done
