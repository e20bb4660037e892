"""Leases: a lent key renewed and released by its reader, from another daemon or this
one; bad renewals and releases refused; and a get that watches the daemon it waits on.
`kvd serve` subprocesses on loopback, bytes checked where they land."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest
import torch

import kvd
from kvd import Region, Share, Transfer, shared_zeros
from kvd.protocol import PROTOCOL_VERSION, LeaseAnswer, PeerError, PeerWelcome
from tests.conftest import wait_until
from tests.test_peers import BLOCK, Node, Nodes, RawPeer, random_region


@pytest.fixture
def nodes(sock_dir: str) -> Iterator[Nodes]:
    started = Nodes(sock_dir)
    yield started
    started.stop_all()


def leases(node: Node) -> dict[str, int]:
    found: dict[str, int] = node.client.stats()["leases"]
    return found


def lend(node: Node, key: str, region: Region, blocks: list[int], ttl_s: float) -> Transfer:
    """A lend, once the daemon holds the key (a lend's reply comes only when it ends)."""
    keys = node.client.stats()["keys"]
    lent = node.client.lend(key, region, blocks, ttl_s=ttl_s)
    wait_until(lambda: node.client.stats()["keys"] == keys + 1)
    return lent


def test_a_reader_keeps_a_lent_key_past_its_lease_by_renewing_it(nodes: Nodes) -> None:
    """A key lent for 1 s is renewed by its reader every 0.4 s, from the other daemon and
    from this one: 2.5 s later it is still there, and the pull takes it. Renewals extend,
    never shorten: a short one leaves the longer lease as it was."""
    a, b = nodes(2)
    src = random_region(4, 1)
    r_src = a.client.register("kv", [src])
    dst = shared_zeros((4, BLOCK), torch.uint8)
    r_dst = b.client.register("kv", [dst])
    lent = lend(a, "queued", r_src, [3, 1], ttl_s=1.0)
    renewals = 0
    for i in range(6):  # 2.4 s: more than twice the lease
        reader = b.client if i % 2 else a.client  # (a's: a reader on this daemon)
        assert reader.renew("queued", a.address, ttl_s=1.0).wait(5) == 0
        renewals += 1
        time.sleep(0.4)
    assert not lent.done()
    assert b.client.renew("queued", a.address, ttl_s=0.001).wait(5) == 0  # (not shorter)
    time.sleep(0.3)
    assert b.client.pull("queued", a.address, r_dst, [0, 1], timeout_s=10) == 2 * BLOCK
    assert lent.wait(10) == 2 * BLOCK
    assert torch.equal(dst[0], src[3]) and torch.equal(dst[1], src[1])
    assert leases(a)["renewed"] == renewals + 1 and leases(a)["expired"] == 0

    # Not renewed, the same loan ends unread, and that is counted.
    assert a.client.lend("unrenewed", r_src, [2], ttl_s=0.3).wait(10) == 0
    assert leases(a)["expired"] == 1
    metrics = a.client.stats()
    assert metrics["expired_keys"] == 1


def test_a_reader_that_will_not_come_releases_the_key_at_once(nodes: Nodes) -> None:
    """Decode aborted: it releases the key it would have pulled. The lender's lend answers
    0 bytes within a second (its blocks are free), the key is gone for pulls (KeyGone, at
    once), and a release that comes before the lend makes the lend answer at once and
    fails the pulls already waiting for the key."""
    a, b = nodes(2)
    r_src = a.client.register("kv", [random_region(4, 2)])
    dst = shared_zeros((4, BLOCK), torch.uint8)
    r_dst = b.client.register("kv", [dst])
    lent = lend(a, "aborted", r_src, [0, 1], ttl_s=30)
    started = time.monotonic()
    assert b.client.release("aborted", a.address).wait(5) == 0
    assert lent.wait(5) == 0 and time.monotonic() - started < 1.0
    st = a.client.stats()
    assert st["keys"] == 0 and st["leases"]["released"] == 1
    started = time.monotonic()
    with pytest.raises(kvd.KeyGone, match="released by its reader"):
        b.client.pull("aborted", a.address, r_dst, [0, 1], timeout_s=20, wait_for_key_s=15)
    assert time.monotonic() - started < 1.0
    assert b.client.release("aborted", a.address).wait(5) == 0  # (twice: the same)

    # Released before it is lent: the pulls waiting for it fail now, the lend answers 0.
    waiting = b.client.start_pull("early", a.address, r_dst, [2], timeout_s=20,
                                  wait_for_key_s=15)
    wait_until(lambda: a.client.stats()["transfers"]["pulls_waiting_for_key"] == 1)
    local_wait = a.client.start_pull("early", a.address, a.client.register(
        "back", [shared_zeros((1, BLOCK), torch.uint8)]), [0], timeout_s=20,
        wait_for_key_s=15)
    time.sleep(0.2)
    started = time.monotonic()
    assert a.client.release("early", a.address).wait(5) == 0  # (a reader on this daemon)
    for pull in (waiting, local_wait):
        with pytest.raises(kvd.KeyGone, match="released by its reader"):
            pull.wait(5)
    assert time.monotonic() - started < 1.0
    assert a.client.lend("early", r_src, [2], ttl_s=30).wait(5) == 0
    st = a.client.stats()
    assert st["keys"] == 0 and st["leases"]["released"] == 2
    assert not bool(dst.any())


def test_a_pushed_key_its_reader_released_never_crosses_the_wire(nodes: Nodes) -> None:
    """Push flow, decode with the key cached already: released at the daemon that will push
    it, the put answers 0 at once and sends nothing; released at the daemon it goes to, the
    put is refused there (``KeyGone``) and nothing is stored; pushed already, a release
    drops it from the receiver's pool at once. Nothing lands in the reader's blocks."""
    a, b = nodes(2)
    r_src = a.client.register("kv", [random_region(4, 5)])
    dst = shared_zeros((4, BLOCK), torch.uint8)
    r_dst = b.client.register("kv", [dst])

    def arrived() -> tuple[int, int, int]:
        st = b.client.stats()
        return st["bytes_in"], st["keys"], st["pool"]["used_bytes"]

    assert b.client.release("early", a.address).wait(5) == 0  # at the sender
    started = time.monotonic()
    assert a.client.put("early", r_src, [0, 1], to=b.address).wait(5) == 0
    assert time.monotonic() - started < 1.0 and arrived() == (0, 0, 0)

    assert b.client.release("late", "local").wait(5) == 0  # at the receiver
    with pytest.raises(kvd.KeyGone, match="released by its reader"):
        a.client.put("late", r_src, [2, 3], to=b.address).wait(5)
    assert arrived() == (0, 0, 0)

    assert a.client.put("stored", r_src, [1, 2], to=b.address).wait(5) == 2 * BLOCK
    assert arrived()[1:] == (1, 2 * BLOCK)
    assert b.client.release("stored", "local").wait(5) == 0
    assert arrived()[1:] == (0, 0)
    with pytest.raises(kvd.KeyGone, match="released by its reader"):
        b.client.get("stored", r_dst, [0, 1], timeout_s=1)
    assert a.client.release("here", "local").wait(5) == 0  # a put to its own daemon
    assert a.client.put("here", r_src, [0], to="local").wait(5) == 0
    assert a.client.stats()["keys"] == 0 and not bool(dst.any())
    assert b.client.stats()["leases"]["released"] == 2


def test_a_key_released_in_part_sends_only_the_blocks_its_reader_lacks(nodes: Nodes) -> None:
    """Push flow, decode with a prefix of a part cached: it releases the part's first
    blocks at the daemon that will push it (``skip``), and the put sends only the others,
    over TCP (3 blocks) and inline (1). Its answer and the receiver's counters say the
    tail's bytes, and decode's get with that skip lands them byte for byte: stored first,
    or straight into a get that waits. A get that skips fewer blocks than the receiver
    holds fails cleanly, the key kept for the right one; a release that comes after the
    whole key arrived leaves it whole, and the get with a skip still works."""
    a, b = nodes(2)
    src = random_region(5, 6)
    r_src = a.client.register("kv", [src])
    dst = shared_zeros((5, BLOCK), torch.uint8)
    r_dst = b.client.register("kv", [dst])

    def received() -> tuple[int, int]:
        st = b.client.stats()
        return st["bytes_in"], st["transfers"]["bytes_received"]

    # Stored first: 2 of 5 blocks cached at decode, 3 cross.
    assert b.client.release("tcp", a.address, skip=2).wait(5) == 0
    assert leases(a)["released_head"] == 1 and leases(a)["released"] == 0
    assert a.client.put("tcp", r_src, [4, 0, 3, 1, 2], to=b.address).wait(5) == 3 * BLOCK
    assert received() == (3 * BLOCK, 3 * BLOCK)
    with pytest.raises(kvd.BadRequest, match="holds its blocks from 2 on"):
        b.client.get("tcp", r_dst, [0, 1, 2, 3], timeout_s=5, share=Share(skip=1))
    assert b.client.get("tcp", r_dst, [2, 0], timeout_s=5, share=Share(skip=3)) == 2 * BLOCK
    assert torch.equal(dst[2], src[1]) and torch.equal(dst[0], src[2])
    assert b.client.stats()["keys"] == 0

    # A get waiting with that skip takes the one block left (inline) into its blocks.
    dst.zero_()
    assert b.client.release("inline", a.address, skip=4).wait(5) == 0
    get = b.client.start_get("inline", r_dst, [3], timeout_s=10, share=Share(skip=4))
    wait_until(lambda: b.client.stats()["waiting_gets"] == 1)
    assert a.client.put("inline", r_src, [0, 1, 2, 3, 4], to=b.address).wait(5) == BLOCK
    assert get.wait(5) == BLOCK and torch.equal(dst[3], src[4])
    assert received()[1] == 4 * BLOCK and not bool(dst[:3].any())
    # Every block released: the put answers at once, sending nothing.
    assert b.client.release("none", a.address, skip=2).wait(5) == 0
    assert a.client.put("none", r_src, [0, 1], to=b.address).wait(5) == 0

    # Released too late: the whole key is here, and stays whole for the get that skips.
    assert a.client.put("late", r_src, [0, 1, 2], to=b.address).wait(5) == 3 * BLOCK
    assert b.client.release("late", "local", skip=2).wait(5) == 0
    assert b.client.release("late", a.address, skip=2).wait(5) == 0
    assert b.client.get("late", r_dst, [4], timeout_s=5, share=Share(skip=2)) == BLOCK
    assert torch.equal(dst[4], src[2]) and b.client.stats()["keys"] == 0


def test_renewals_and_releases_that_cannot_be_are_refused(nodes: Nodes) -> None:
    """A key that is not there, one that is not lent (published, offloaded), one that is
    gone, a TTL out of bounds, a source nobody answers at: each is a clear error, and the
    key a bad renewal named is left as it was."""
    a, b = nodes(2)
    r_src = a.client.register("kv", [random_region(4, 3)])
    dst = shared_zeros((4, BLOCK), torch.uint8)
    r_dst = b.client.register("kv", [dst])
    for client, src in ((b.client, a.address), (a.client, a.address)):
        with pytest.raises(kvd.UnknownKey, match="no key 'nothing'"):
            client.renew("nothing", src, ttl_s=5).wait(5)
    a.client.publish("published", r_src, [0])
    a.client.offload("offloaded", r_src, [1])
    for key in ("published", "offloaded"):
        with pytest.raises(kvd.BadRequest, match="not lent"):
            b.client.renew(key, a.address, ttl_s=5).wait(5)
        with pytest.raises(kvd.BadRequest, match="only a lent or pushed key"):
            b.client.release(key, a.address).wait(5)
    lent = lend(a, "lent", r_src, [2], ttl_s=30)
    for ttl_s in (0.0, 86400.0 * 2):
        with pytest.raises(kvd.BadRequest, match="ttl_s must be in"):
            b.client.renew("lent", a.address, ttl_s=ttl_s).wait(5)
    with pytest.raises(kvd.ProtocolError, match="ttl_s"):  # refused as it is read
        b.client.renew("lent", a.address, ttl_s=-1).wait(5)
    with pytest.raises(kvd.ProtocolError, match="skip"):
        b.client.release("lent", a.address, skip=-1).wait(5)
    assert b.client.pull("lent", a.address, r_dst, [0], timeout_s=10) == BLOCK
    assert lent.wait(5) == BLOCK
    with pytest.raises(kvd.KeyGone, match="taken by its reader"):
        b.client.renew("lent", a.address, ttl_s=5).wait(5)
    with pytest.raises(kvd.KeyGone, match="taken by its reader"):
        b.client.release("lent", a.address).wait(5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(kvd.PeerUnreachable, match=str(port)):
        b.client.renew("lent", f"127.0.0.1:{port}", ttl_s=5).wait(10)
    st = a.client.stats()
    assert st["keys"] == 2 and st["leases"] == {"renewed": 0, "released": 0, "expired": 0,
                                                "sender_lost": 0, "released_head": 0}
    assert b.client.stats()["bad_messages"].get("malformed") == 2  # (the two above)


def test_bad_lease_messages_from_a_peer(nodes: Nodes) -> None:
    """A raw peer: a renewal with a negative TTL is malformed (counted, answered), an
    answer to no call of ours is counted and dropped, and a renewal of a key lent here is
    answered like any other peer's (a peer may renew what it may pull)."""
    (a,) = nodes(1, "--peer-grace-s", "60")
    r_src = a.client.register("kv", [random_region(2, 4)])
    lent = lend(a, "k", r_src, [1], ttl_s=30)
    peer = RawPeer(a.address)
    try:
        hello = {"op": "peer_hello", "protocol_version": PROTOCOL_VERSION, "node_id": "raw",
                 "epoch": 1, "address": "127.0.0.1:1", "data_port": 1,
                 "data_token": b"t" * 32, "devices": ["cpu"]}
        assert isinstance(peer.ask(hello), PeerWelcome)
        reply = peer.ask({"op": "lease_renew", "call_id": 7, "key": "k", "ttl_s": 5.0})
        assert reply == LeaseAnswer(call_id=7)
        reply = peer.ask({"op": "lease_renew", "call_id": 8, "key": "none", "ttl_s": 5.0})
        assert isinstance(reply, LeaseAnswer) and reply.code == "unknown_key"
        reply = peer.ask({"op": "lease_renew", "call_id": 9, "key": "k", "ttl_s": 1e6})
        assert isinstance(reply, LeaseAnswer) and reply.code == "bad_request"
        reply = peer.ask({"op": "lease_renew", "call_id": 10, "key": "k", "ttl_s": -1.0})
        assert isinstance(reply, PeerError) and "ttl_s" in reply.message
        peer.send({"op": "lease_answer", "call_id": 11})
        reply = peer.ask({"op": "lease_release", "call_id": 12, "key": "k"})
        assert reply == LeaseAnswer(call_id=12)
        assert lent.wait(5) == 0
        bad = wait_until(lambda: (b := a.client.stats()["peer"]["bad_messages"]).get(
            "unknown_call") and b)
        assert bad["malformed"] == 1 and bad["unknown_call"] == 1
        assert a.client.stats()["leases"]["renewed"] == 1
    finally:
        peer.close()


def test_a_get_watching_its_sender_fails_at_once_when_the_sender_goes(
        nodes: Nodes) -> None:
    """Push flow: decode waits (a get) for a key that prefill's daemon puts. Told which
    daemon that is, the get fails at once when that daemon cannot be reached or dies,
    instead of at its timeout; what came before it died is still taken."""
    a, b = nodes(2)
    src = random_region(4, 5)
    r_src = a.client.register("kv", [src])
    dst = shared_zeros((4, BLOCK), torch.uint8)
    r_dst = b.client.register("kv", [dst])
    # The sender puts: the get takes it, as any get would.
    waiting = b.client.start_get("p0", r_dst, [0], timeout_s=20, sender=a.address)
    wait_until(lambda: b.client.stats()["peer"]["links"])  # (b linked to a to watch it)
    assert a.client.put("p0", r_src, [2], to=b.address).wait(10) == BLOCK
    assert waiting.wait(10) == BLOCK and torch.equal(dst[0], src[2])
    # Nobody at the sender's address: at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(kvd.PeerUnreachable, match=str(port)):
        b.client.get("p1", r_dst, [1], timeout_s=20, sender=f"127.0.0.1:{port}")
    assert time.monotonic() - started < 1.0
    # Stored before the sender died: taken.
    assert a.client.put("p2", r_src, [3], to=b.address).wait(10) == BLOCK
    waiting = b.client.start_get("p3", r_dst, [2], timeout_s=20, sender=a.address)
    time.sleep(0.3)
    a.proc.proc.kill()
    a.proc.proc.wait(10)
    started = time.monotonic()
    with pytest.raises(kvd.PeerUnreachable, match="was to send this key"):
        waiting.wait(20)
    assert time.monotonic() - started < 1.0
    assert b.client.get("p2", r_dst, [3], timeout_s=5, sender=a.address) == BLOCK
    assert torch.equal(dst[3], src[3]) and not bool(dst[1:3].any())
    st = b.client.stats()
    assert st["leases"]["sender_lost"] == 2 and st["waiting_gets"] == 0
    assert os.path.exists(b.proc.socket_path)
