"""The peer port against strangers who reach it without keys: routing ids guessed to make
libzmq abort, a flood of connections that never speak, a daemon listening beyond
loopback without keys, and handshakes that outlive their callers. `kvd serve`
subprocesses on loopback; the attacks run as processes of their own
(``tests/peer_port_attacks.py``); what is checked is what a peer or an operator sees: the
daemon alive and serving, its descriptors, its counts and its log."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from kvd.errors import PeerUnreachable
from tests.test_peers import BLOCK, Nodes, random_region

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def nodes(sock_dir: str) -> Iterator[Nodes]:
    started = Nodes(sock_dir)
    yield started
    started.stop_all()


def test_a_handshake_that_outlives_its_caller_leaves_no_traceback(nodes: Nodes) -> None:
    """A put and a pull to an address that accepts connections and never answers, each
    with a timeout shorter than peer_connect_timeout_s: both fail with PeerUnreachable; the
    handshake each started fails a moment after its caller gave up, and leaves nothing in
    the daemon's log (no unretrieved task exception, no traceback)."""
    (a,) = nodes.each([])
    with socket.socket() as mute:  # the kernel completes connections; nothing reads them
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        address = f"127.0.0.1:{mute.getsockname()[1]}"
        region = a.client.register("kv", [random_region(1, 13)])
        with pytest.raises(PeerUnreachable):
            a.client.put("k", region, [0], to=address, timeout_s=0.5).wait(10)
        got = a.client.register("got", [random_region(1, 14, BLOCK)])
        with pytest.raises(PeerUnreachable):
            a.client.pull("k", address, got, [0], timeout_s=0.5)
        time.sleep(1.0)  # (the handshakes go on, and fail: within 0.5 s of their callers)
        # A failed task left unretrieved is reported when the garbage collector frees it
        # (it is in a reference cycle through its traceback): requests make the daemon
        # allocate, and collect.
        for _ in range(300):
            a.client.stats()
    assert a.proc.proc.poll() is None
    log = a.proc.log()
    assert "Task exception was never retrieved" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
