"""What a hostile or unlucky client or peer can make a daemon hold, and puts bigger than a
pool: `kvd serve` subprocesses, raw sockets speaking the local and peer protocols, real
bytes checked where they land.

- A put into a get already waiting lands in the get's blocks whatever the pool's size,
  and a pull whose offer the puller refuses fails at once (not at its timeout).
- Transfer ids are unique per peer: a reused one is refused, and what a lost link held is
  freed with it (the pool comes back, the daemon stops at once).
- Deeply nested msgpack is a malformed message like any other: an error reply, a count,
  at most a line in the log, on both sockets.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import torch
import zmq

import kvd
from kvd import KvdClient, shared_empty, shared_zeros
from kvd.client.lifeline import ClientLifeline
from kvd.protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    Offer,
    PeerError,
    PeerWelcome,
    Pong,
    PullRequest,
    Refuse,
    Reply,
    Welcome,
    XferCancel,
    decode_reply,
)
from tests.conftest import ProcessDaemon, wait_until
from tests.test_peers import RawPeer

pack = msgspec.msgpack.encode
MiB = 1 << 20
BLOCK = 64 * 1024


@dataclass
class Node:
    proc: ProcessDaemon
    client: KvdClient
    address: str  # its peer socket, host:port

    def stats(self) -> dict[str, Any]:
        return self.client.stats()


@pytest.fixture
def daemons(sock_dir: str) -> Iterator[Callable[..., Node]]:
    """``start(name, *flags)``: a ready `kvd serve` with a client; all stopped at the end
    (and their exit codes checked), whatever the test did."""
    started: list[tuple[ProcessDaemon, KvdClient | None]] = []

    def start(name: str, *extra: str) -> Node:
        path = os.path.join(sock_dir, name)
        os.makedirs(path)
        proc = ProcessDaemon(path, "--node-id", name, *extra)
        started.append((proc, None))
        proc.wait_ready()
        client = KvdClient(proc.socket_path, timeout_s=30)
        started[-1] = (proc, client)
        client.connect()
        return Node(proc, client, client.stats()["peer"]["address"])

    yield start
    codes = []
    for proc, client in started:
        if client is not None:
            client.close()
        codes.append((proc.stop(), proc))
    for code, proc in codes:
        assert code == 0, f"exit code {code}:\n{proc.log()[-4000:]}"


def random_region(blocks: int, seed: int, block_bytes: int = BLOCK) -> torch.Tensor:
    t = shared_empty((blocks, block_bytes), torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8, generator=gen))
    return t


class FakeDaemon(RawPeer):
    """A fake daemon on the peer port: says what it likes. It listens on a data port of its
    own (the daemon dials it), and holds what is dialled there unread."""

    def __init__(self, address: str) -> None:
        self.data = socket.create_server(("127.0.0.1", 0))
        self.data_port = self.data.getsockname()[1]
        self.address = f"127.0.0.1:{self.data_port}"  # what it calls itself
        super().__init__(address)

    def hello(self, node_id: str) -> None:
        reply = self.ask({"op": "peer_hello", "protocol_version": PROTOCOL_VERSION,
                          "node_id": node_id, "epoch": 1, "address": self.address,
                          "data_port": self.data_port, "data_token": b"t" * 32,
                          "devices": ["cpu"]})
        assert isinstance(reply, PeerWelcome), reply

    def close(self) -> None:
        super().close()
        self.data.close()


class RawLocal:
    """A raw DEALER the daemon connected to through its lifeline."""

    def __init__(self, path: str) -> None:
        self.lifeline = ClientLifeline.connect(path, 10.0)
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        self.lifeline.reach(self.sock, 10.0)

    def reply(self) -> Reply:
        return decode_reply(self.sock.recv())

    def ask(self, payload: bytes) -> Reply:
        self.sock.send(payload)
        return self.reply()

    def hello(self) -> None:
        reply = self.ask(pack({"op": "hello", "req_id": 1, "protocol_version":
                               PROTOCOL_VERSION, "pid": os.getpid()}))
        assert isinstance(reply, Welcome), reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.lifeline.close()


def nested(depth: int) -> bytes:
    """msgpack: an array in an array ... ``depth`` deep, around a nil."""
    return b"\x91" * depth + b"\xc0"


def deep_request(req_id: int, depth: int, deep_first: bool = True) -> bytes:
    """A ping with a field that holds ``depth`` levels of nesting, before its other
    fields (the decoder meets it before anything else) or after them."""
    deep, rest = pack("x") + nested(depth), pack("op") + pack("ping") + pack("req_id") + pack(
        req_id)
    return b"\x83" + (deep + rest if deep_first else rest + deep)


# ---------------------------------------------------------------- puts bigger than a pool


def test_a_put_larger_than_the_pool_lands_in_a_waiting_get(
        daemons: Callable[..., Node]) -> None:
    """A get already waiting is room: 32 MiB put into a daemon whose whole pool is 16 MiB
    lands in the get's blocks, from a peer and from a local client. Without a waiting get
    the offer is refused at once, and a pull right after that moves its bytes at once."""
    a = daemons("a")
    b = daemons("b", "--pool-size-bytes", "16MiB")
    src = random_region(32, 1, MiB)
    r_src = a.client.register("kv", [src])

    with KvdClient(b.proc.socket_path, timeout_s=30) as waiter:
        dst = shared_zeros((32, MiB), torch.uint8)
        r_dst = waiter.register("kv", [dst])
        get = waiter.start_get("k", r_dst, range(32), timeout_s=20)
        wait_until(lambda: b.stats()["waiting_gets"] == 1)
        assert a.client.put("k", r_src, range(32), to=b.address,
                            timeout_s=20).wait(25) == 32 * MiB
        assert get.wait(10) == 32 * MiB
        assert torch.equal(dst, src)

        # The same within one daemon: a local put into a waiting get takes no pool either.
        local_src = random_region(32, 2, MiB)
        r_local = b.client.register("local", [local_src])
        get = waiter.start_get("k-local", r_dst, range(32), timeout_s=20)
        wait_until(lambda: b.stats()["waiting_gets"] == 1)
        assert b.client.put("k-local", r_local, range(32)).wait(20) == 32 * MiB
        assert get.wait(10) == 32 * MiB
        assert torch.equal(dst, local_src)
    assert b.stats()["pool"]["used_bytes"] == 0

    # Nobody waits: no room for it anywhere, refused at once.
    t0 = time.monotonic()
    with pytest.raises(kvd.PoolExhausted, match="exceeds the whole pool"):
        a.client.put("nobody", r_src, range(32), to=b.address, timeout_s=20).wait(25)
    assert time.monotonic() - t0 < 5
    # A pull right after the refusal, over the same link, moves its bytes at once.
    big = random_region(64, 3, MiB)
    a.client.publish("big", a.client.register("big", [big]), range(64))
    pulled = shared_zeros((64, MiB), torch.uint8)
    r_pulled = b.client.register("pulled", [pulled])
    t0 = time.monotonic()
    assert b.client.pull("big", a.address, r_pulled, range(64), timeout_s=30) == 64 * MiB
    assert time.monotonic() - t0 < 10
    assert torch.equal(pulled, big)
    assert b.stats()["pool"]["used_bytes"] == 0


def test_a_pull_whose_offer_the_puller_refuses_fails_at_once(
        daemons: Callable[..., Node]) -> None:
    """The owner (here a fake one) answers a pull with an offer the puller cannot take:
    the puller refuses it, and its pull fails then, with the reason, not at its timeout."""
    b = daemons("b", "--peer-grace-s", "60")
    owner = FakeDaemon(b.address)
    try:
        owner.hello("owner")
        dst = shared_zeros((4, BLOCK), torch.uint8)
        r_dst = b.client.register("kv", [dst])
        cases: list[tuple[dict[str, Any], type[kvd.KvdError], str]] = [
            ({"nbytes": 7}, kvd.ProtocolError, "does not match"),
            ({"src_dev": "cuda:0", "src_gpu": True}, kvd.BadRequest, "no GPU with NCCL"),
        ]
        for changes, error, needle in cases:
            pull = b.client.start_pull("k", owner.address, r_dst, range(4), timeout_s=8)
            req = owner.recv()
            assert isinstance(req, PullRequest), req
            owner.send({"op": "offer", "transfer_id": req.transfer_id, "key": "k",
                        "src_dev": "cpu", "dst_dev": "cpu", "nbytes": 4 * BLOCK,
                        "num_blocks": 4, "layout": [[BLOCK, "uint8"]], **changes})
            refused = owner.recv()
            assert isinstance(refused, Refuse) and needle in refused.message, refused
            t0 = time.monotonic()
            with pytest.raises(error, match=needle):
                pull.wait(12)
            assert time.monotonic() - t0 < 3
            cancel = owner.recv()  # the puller gave up: it says so
            assert isinstance(cancel, XferCancel) and cancel.transfer_id == req.transfer_id
        assert b.stats()["transfers"]["in_flight_in"] == 0
        assert not dst.any()
    finally:
        owner.close()


# ---------------------------------------------------------------- transfer ids


def test_a_reused_transfer_id_is_refused_and_a_lost_link_frees_its_state(
        daemons: Callable[..., Node]) -> None:
    """A peer asks three times, with one transfer id, for an offloaded key, offers under
    that id too, and leaves: the repeats are refused and counted, the one pull it made
    ends with its link, the pool comes back after delete and SIGTERM stops the daemon at
    once (its drain has nothing left to wait for)."""
    a = daemons("a", "--peer-grace-s", "60")
    region = random_region(1, 4)
    a.client.offload("off", a.client.register("kv", [region]), [0])
    assert a.stats()["pool"]["used_bytes"] == BLOCK
    peer = FakeDaemon(a.address)
    try:
        peer.hello("reuser")
        tid = 77
        pull = {"op": "pull_request", "transfer_id": tid, "key": "off", "dst_dev": "cpu",
                "num_blocks": 1, "layout": [[BLOCK, "uint8"]]}
        # All three at once: the daemon reads them in one batch (ZeroMQ queues them
        # together), before the first one's task runs.
        for _ in range(3):
            peer.send(pull)
        answers = [peer.recv() for _ in range(3)]
        offers = [m for m in answers if isinstance(m, Offer)]
        assert len(offers) == 1 and offers[0].transfer_id == tid, answers
        for refused in answers:
            if not isinstance(refused, Offer):
                assert isinstance(refused, Refuse) and refused.transfer_id == tid, refused
                assert refused.code == "protocol" and "already in use" in refused.message
        refused = peer.ask({"op": "offer", "transfer_id": tid, "key": "other",
                            "src_dev": "cpu", "dst_dev": "cpu", "nbytes": BLOCK,
                            "num_blocks": 1, "layout": [[BLOCK, "uint8"]]})
        assert isinstance(refused, Refuse) and "already in use" in refused.message, refused
        bad = a.stats()["peer"]["bad_messages"]
        assert bad.get("duplicate_transfer") == 3, bad
        assert a.stats()["transfers"]["in_flight_out"] == 1
    finally:
        peer.close()
    stats = wait_until(lambda: (s := a.stats())["peer"]["links"] == []
                       and s["transfers"]["in_flight_out"] == 0 and s, timeout_s=10)
    assert stats["transfers"]["in_flight_in"] == 0
    a.client.delete("off")
    assert a.stats()["pool"]["used_bytes"] == 0
    a.client.close()
    t0 = time.monotonic()
    assert a.proc.stop() == 0
    assert time.monotonic() - t0 < 5, a.proc.log()[-3000:]


# ---------------------------------------------------------------- unfinished messages


# ---------------------------------------------------------------- deep nesting


def test_deep_nesting_is_refused_on_both_sockets(daemons: Callable[..., Node]) -> None:
    """msgpack nested 100,000 deep, 50 times over on the local socket and on the peer
    socket: each gets an error reply and is counted as malformed; no traceback, and the
    log says so at most once per socket, not once per message."""
    a = daemons("a", "--peer-grace-s", "60")
    local = RawLocal(a.proc.socket_path)
    try:
        local.hello()
        for i in range(50):  # in the typed decoding, or after it (looking for a req_id)
            reply = local.ask(deep_request(10 + i, 100_000, deep_first=i % 2 == 0))
            assert isinstance(reply, ErrorReply) and reply.code == "protocol", reply
            assert "nested too deeply" in reply.message or "unknown field" in reply.message
        reply = local.ask(nested(100_000))
        assert isinstance(reply, ErrorReply) and reply.code == "protocol", reply
        assert isinstance(local.ask(pack({"op": "ping", "req_id": 99})), Pong)
    finally:
        local.close()
    assert a.stats()["bad_messages"]["malformed"] == 51

    peer = FakeDaemon(a.address)
    try:
        for _ in range(50):  # before its hello, and after
            answer = peer.ask(deep_request(1, 100_000))
            assert isinstance(answer, PeerError) and answer.code == "protocol", answer
        peer.hello("deep")
        answer = peer.ask(b"\x82" + pack("x") + nested(100_000) + pack("op")
                          + pack("heartbeat"))
        assert isinstance(answer, PeerError) and "nested too deeply" in answer.message, answer
    finally:
        peer.close()
    assert a.stats()["peer"]["bad_messages"]["malformed"] == 51
    log = a.proc.log()
    assert "Traceback" not in log and "RecursionError" not in log
    assert log.count("malformed") <= 4, log[-3000:]
