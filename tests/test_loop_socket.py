"""``LoopSocket`` on real ZeroMQ sockets and a real loop: what a send does to the edge of
``zmq.FD``."""

from __future__ import annotations

import asyncio
import time

import zmq

from kvd.loop_socket import LoopSocket, has_message, new_context


async def test_a_message_that_came_while_we_sent_is_still_read() -> None:
    """``zmq.FD`` is edge-triggered and a send may consume the edge that announced a
    message: the send must see to it that the message is read anyway (the next loop turn
    reads what waits), or it waits for another message that may never come."""
    ctx = new_context()
    ours, theirs = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
    try:
        port = theirs.bind_to_random_port("tcp://127.0.0.1")
        got: asyncio.Queue[list[bytes]] = asyncio.Queue()
        sock = LoopSocket(ours, got.put_nowait)
        sock.start()
        ours.connect(f"tcp://127.0.0.1:{port}")
        assert sock.send([b"hello"])
        deadline = time.monotonic() + 10
        while not has_message(theirs):  # (blocking the loop: nothing of ours reads)
            assert time.monotonic() < deadline, "the peer never got our first message"
            time.sleep(0.001)
        routing_id, _ = theirs.recv_multipart()
        for _ in range(3):  # what was scheduled runs, and finds nothing to read
            await asyncio.sleep(0.01)
        # Without a loop turn in between: their message arrives (its edge announced),
        # then our send takes ZeroMQ's pending commands, and that edge with them.
        theirs.send_multipart([routing_id, b"answer"])
        time.sleep(0.1)
        assert sock.send([b"more"])
        async with asyncio.timeout(10):
            assert await got.get() == [b"answer"]
        sock.close()
    finally:
        ours.close(linger=0)
        theirs.close(linger=0)
        ctx.term()
