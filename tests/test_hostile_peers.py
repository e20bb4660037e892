"""The peer plane against hostile or unlucky input: a flood of connections while descriptors
run out (the HTTP port's too), connections that never speak, links that come and go, a
hello that claims a linked peer's address, more links or more pulls at once than a daemon
serves. `kvd serve` subprocesses on loopback (and a daemon in the test's process where a
bound is lowered to be reached); what is checked is what a peer or an operator sees:
connections answered or closed, bytes that arrive, the log, the daemon's memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from kvd import AsyncKvdClient, shared_empty, shared_zeros
from kvd.daemon.peer_data import MAX_UNLINKED_CONNECTIONS
from kvd.daemon.peer_sockets import HANDSHAKE_S
from kvd.daemon.transfer import machine as transfer_machine
from kvd.daemon.transfer.machine import MAX_PULLS_SERVED_PER_LINK
from kvd.errors import PeerUnreachable, error_from_code
from kvd.protocol import (
    PROTOCOL_VERSION,
    Heartbeat,
    Offer,
    PeerError,
    PeerMessage,
    PeerWelcome,
    Refuse,
    decode_peer,
)
from tests.conftest import make_config, running_daemon, wait_until
from tests.test_hostile_local import FakeDaemon
from tests.test_peers import BLOCK, Node, RawPeer, random_region

MiB = 2**20


@pytest.fixture
def make_node(sock_dir: str) -> Iterator[Callable[..., Node]]:
    """``make_node(name, *flags)``: a `kvd serve` with a client; all stopped at the end."""
    started: list[Node] = []

    def make(name: str, *extra: str) -> Node:
        started.append(Node(sock_dir, name, *extra))
        return started[-1]

    yield make
    for node in started:
        code = node.stop()
        assert code in (0, -9), f"{node.dir}: exit code {code}\n{node.proc.log()}"


def hello(address: str, node_id: str, epoch: int) -> dict[str, object]:
    return {"op": "peer_hello", "protocol_version": PROTOCOL_VERSION, "node_id": node_id,
            "epoch": epoch, "address": address, "data_port": 1,
            "data_token": os.urandom(32), "devices": ["cpu"]}


def proc_status(pid: int, field: str) -> int:
    """A number from /proc/PID/status (VmRSS: kB)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def burst(target: tuple[str, int] | str, n: int) -> list[socket.socket]:
    """``n`` connections begun at once, without waiting for any (past the listener's
    backlog they stay half-open, or are refused: either way the daemon is busy)."""
    family = socket.AF_UNIX if isinstance(target, str) else socket.AF_INET
    socks = []
    for _ in range(n):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError, InterruptedError, ConnectionRefusedError):
            s.connect(target)
        socks.append(s)
    return socks


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a GET; an error status is an answer too."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def transfer_checked(src: Node, dst: Node, key: str, seed: int, deadline_s: float) -> None:
    """A put from ``src`` to ``dst`` (retried while the link cannot be made, until
    ``deadline_s`` on the monotonic clock), then the bytes as ``dst`` has them."""
    data = random_region(2, seed)
    region = src.client.register(key, [data])
    while True:
        try:
            src.client.put(key, region, [0, 1], to=dst.address, timeout_s=5).wait(10)
            break
        except PeerUnreachable:
            assert time.monotonic() < deadline_s, f"{src.dir} never linked to {dst.dir}"
            time.sleep(0.2)
    got = shared_zeros((2, BLOCK), torch.uint8)
    dst.client.get(key, dst.client.register(f"{key}-dst", [got]), [0, 1], timeout_s=5)
    assert torch.equal(got, data)


def test_accept_loops_survive_running_out_of_descriptors(
        make_node: Callable[..., Node]) -> None:
    """A burst of connections to the peer port, the data port, the local socket and the
    HTTP port while the daemon is out of descriptors: the data and HTTP listeners say so in
    the log, and every listener (ZeroMQ's too) keeps accepting; once the burst is gone a
    new peer links, both ways, and moves bytes.
    A health probe sent meanwhile waits in the backlog and is answered once descriptors
    are back (not dropped: an orchestrator would restart a healthy daemon), and /healthz
    answers after."""
    a = make_node("a", "--peer-connect-timeout-s", "1")
    b = make_node("b")
    host, port = a.address.rsplit(":", 1)
    data_port = a.client.stats()["peer"]["data_port"]
    http = a.client.stats()["http"]
    http_host, http_port = http.rsplit(":", 1)
    pid = a.proc.proc.pid
    # Room for a link and a registration once the burst is gone, but not for the burst
    # (below MAX_UNLINKED_CONNECTIONS too: the descriptors run out first).
    limit = open_fds(pid) + 24
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))
    # (Not the local socket: libzmq 4.3.5's IPC listener aborts the process on EMFILE.)
    flood = [*burst((host, int(port)), 300), *burst((host, data_port), 300)]
    probe = None
    try:
        # The last descriptor the limit allows is taken (they are given lowest first).
        wait_until(lambda: max(map(int, os.listdir(f"/proc/{pid}/fd"))) == limit - 1,
                   timeout_s=10)
        probe = socket.create_connection((http_host, int(http_port)), timeout=10)
        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: kvd\r\nConnection: close\r\n\r\n")
        flood += burst((http_host, int(http_port)), 300)
        time.sleep(0.5)  # each listener has connections waiting: it tries, and fails
    finally:
        for s in flood:
            s.close()
    assert probe is not None
    with probe:
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := probe.recv(4096):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b'{"ok": true}'), answer
    deadline = time.monotonic() + 20
    transfer_checked(b, a, "b-to-a", 1, deadline)  # b dials a: a's accept loops
    transfer_checked(a, b, "a-to-b", 2, deadline)
    assert a.client.ping() > 0
    assert http_get(f"http://{http}/healthz") == (200, '{"ok": true}')
    assert http_get(f"http://{http}/readyz")[0] == 200
    log = a.proc.log()
    for listener in ("data_port", "http_port"):  # (ZeroMQ's listeners do not log it)
        assert (f"{listener}: accept failed: [Errno 24] Too many open files "
                f"(open file limit {limit}: raise LimitNOFILE)") in log, listener


def test_connections_waiting_to_link_are_bounded(make_node: Callable[..., Node]) -> None:
    """Silent connections to the data port: past MAX_UNLINKED_CONNECTIONS the next ones
    are closed at once, counted and logged; the daemon holds no more than that. Silent
    connections to the peer port are closed by ZeroMQ after HANDSHAKE_S (its
    HANDSHAKE_IVL), each counted. Once they are gone a peer links again."""
    a = make_node("a", "--peer-connect-timeout-s", "3")
    host, port = a.address.rsplit(":", 1)
    data_port = a.client.stats()["peer"]["data_port"]
    pid = a.proc.proc.pid
    before = open_fds(pid)
    extra = 40
    flood = [socket.create_connection((host, data_port), timeout=5)
             for _ in range(MAX_UNLINKED_CONNECTIONS + extra)]
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(100)]
    try:
        bad = wait_until(lambda: (s := a.client.stats()["peer"]["bad_messages"]).get(
            "unlinked_limit", 0) >= extra and s, timeout_s=5)
        assert bad["unlinked_limit"] == extra, bad
        closed = 0
        for s in flood[-extra:]:  # the last ones in are the ones closed
            s.settimeout(2)
            with contextlib.suppress(ConnectionResetError):
                closed += s.recv(1) == b""
        assert closed == extra
        assert "connections are waiting to link already (the most)" in a.proc.log()
        t0 = time.monotonic()
        for s in silent:
            s.settimeout(8)
            with contextlib.suppress(ConnectionResetError):
                while s.recv(4096):  # (ZeroMQ's greeting, then the close)
                    pass
        assert time.monotonic() - t0 < HANDSHAKE_S + 3
        wait_until(lambda: a.client.stats()["peer"]["bad_messages"].get("handshake") == 100)
    finally:
        for s in flood + silent:
            s.close()
    wait_until(lambda: open_fds(pid) <= before, timeout_s=5)
    peer = RawPeer(a.address)
    try:
        assert isinstance(peer.ask(hello("127.0.0.1:1", "late", 1)), PeerWelcome)
    finally:
        peer.close()


def test_link_churn_gives_its_memory_back(make_node: Callable[..., Node]) -> None:
    """Fake peers that say hello and leave: each link's state goes with it (its receive
    channel's thread, and its buffers: once about 4 MiB a link, kept)."""
    a = make_node("a", "--peer-grace-s", "60")
    pid = a.proc.proc.pid

    def churn(first: int, n: int) -> None:
        for i in range(first, first + n):
            peer = RawPeer(a.address)
            try:
                reply = peer.ask(hello(f"127.0.0.1:{20000 + i}", f"churn{i}", i + 1))
                assert isinstance(reply, PeerWelcome)
            finally:
                peer.close()
        wait_until(lambda: a.client.stats()["peer"]["links"] == [], timeout_s=10)

    churn(0, 5)  # what the first links allocate once (a thread arena, say)
    time.sleep(0.5)  # (their channels are closed off the loop)
    rss_kb = proc_status(pid, "VmRSS")
    links = 60
    churn(5, links)

    def grown_mib() -> float:
        return (proc_status(pid, "VmRSS") - rss_kb) / 1024

    try:  # (their channels are closed off the loop: give it a moment)
        wait_until(lambda: grown_mib() < 32, timeout_s=10)
    except AssertionError:
        raise AssertionError(f"RSS grew {grown_mib():.0f} MiB over {links} links") from None
    assert a.client.stats()["peer"]["bad_messages"] == {}


def test_a_hello_taking_over_a_live_link_is_refused(make_node: Callable[..., Node]) -> None:
    """A second hello claiming a linked peer's address with a new epoch, while that
    link's connection lives, is refused: the transfer in flight on the link completes
    byte-exact. A peer that really restarted (its old connection gone) is taken."""
    a = make_node("a", "--pool-size-bytes", "512MiB")
    b = make_node("b", "--pool-size-bytes", "512MiB")
    transfer_checked(a, b, "first", 3, time.monotonic() + 10)
    (link,) = b.client.stats()["peer"]["links"]
    assert link["address"] == a.address
    big = shared_empty((2, 128 * MiB), torch.uint8)
    big.view(torch.int64).copy_(torch.arange(big.numel() // 8).view(2, -1))
    region = a.client.register("big", [big])
    thief = RawPeer(b.address)  # connected already: its hello lands at once
    try:
        transfer = a.client.put("big", region, [0, 1], to=b.address, timeout_s=60)
        wait_until(lambda: b.client.stats()["transfers"]["in_flight_in"] == 1,
                   interval_s=0.002)
        reply = thief.ask(hello(a.address, link["node_id"], link["epoch"] + 1))
        transfer.wait(30)
        assert isinstance(reply, PeerError), reply
        assert reply.code == "linked_already" and "linked already" in reply.message
    finally:
        thief.close()
    got = shared_zeros((2, 128 * MiB), torch.uint8)
    b.client.get("big", b.client.register("got", [got]), [0, 1], timeout_s=10)
    assert torch.equal(got, big)
    stats = b.client.stats()["peer"]
    assert [(x["address"], x["epoch"]) for x in stats["links"]] == [
        (a.address, link["epoch"])]
    assert stats["bad_messages"].get("takeover") == 1, stats["bad_messages"]

    # A restart: the new hello is refused while the old connection lives, and taken
    # once it has closed (a process that dies closes its connections).
    old = RawPeer(b.address)
    try:
        assert isinstance(old.ask(hello("127.0.0.1:1", "r", 1)), PeerWelcome)
        early = RawPeer(b.address)
        try:
            assert isinstance(early.ask(hello("127.0.0.1:1", "r", 2)), PeerError)
        finally:
            early.close()
    finally:
        old.close()
    wait_until(lambda: all(x["address"] != "127.0.0.1:1"
                           for x in b.client.stats()["peer"]["links"]), timeout_s=5)
    new = RawPeer(b.address)
    try:
        assert isinstance(new.ask(hello("127.0.0.1:1", "r", 2)), PeerWelcome)
        epochs = {x["address"]: x["epoch"] for x in b.client.stats()["peer"]["links"]}
        assert epochs == {a.address: link["epoch"], "127.0.0.1:1": 2}
    finally:
        new.close()


def test_at_the_link_bound_the_least_recently_used_idle_link_makes_room(
        make_node: Callable[..., Node]) -> None:
    """``max_peer_links`` counts links both ways. At the bound a new link, a peer's hello
    or a dial of ours, closes the least recently used link with no work in flight: that
    peer sees its connection end (and links again when it needs to), and the new link
    moves bytes. None of it is counted as bad input."""
    a = make_node("a", "--max-peer-links", "3", "--peer-grace-s", "60")
    b, c = make_node("b"), make_node("c")
    first = FakeDaemon(a.address)
    late: FakeDaemon | None = None
    try:
        first.hello("first")  # the least recently used, once the two below have moved bytes
        transfer_checked(b, a, "in", 1, time.monotonic() + 10)  # b's dial
        transfer_checked(a, c, "out", 2, time.monotonic() + 10)  # ours
        late = FakeDaemon(a.address)
        late.hello("late")  # a hello at the bound: `first` makes room
        with pytest.raises(ConnectionError):
            while True:
                first.recv(5)
        stats = a.client.stats()["peer"]
        assert {x["address"] for x in stats["links"]} == {b.address, c.address, late.address}
        assert stats["links_evicted"] == 1 and stats["bad_messages"] == {}, stats
        assert "the least recently used idle one" in a.proc.log()

        d = make_node("d")
        transfer_checked(a, d, "out2", 3, time.monotonic() + 10)  # our dial: b makes room
        wait_until(lambda: not b.client.stats()["peer"]["links"], timeout_s=5)  # b saw it
        stats = a.client.stats()["peer"]
        assert {x["address"] for x in stats["links"]} == {c.address, late.address, d.address}
        transfer_checked(b, a, "again", 4, time.monotonic() + 10)  # b links again: c goes
        stats = a.client.stats()["peer"]
        assert {x["address"] for x in stats["links"]} == {late.address, d.address, b.address}
        assert stats["links_evicted"] == 3 and stats["bad_messages"] == {}, stats
    finally:
        first.close()
        if late is not None:
            late.close()


def test_at_the_link_bound_with_every_link_busy_a_hello_is_refused_and_told_why(
        make_node: Callable[..., Node]) -> None:
    """A peer whose pull waits for its key keeps its link busy: at a bound of one link, a
    second peer's hello is refused with a PeerError that says every link has work in
    flight, counted and logged; once the first peer leaves, the second links."""
    a = make_node("a", "--max-peer-links", "1", "--peer-grace-s", "60")
    waiting, second = FakeDaemon(a.address), FakeDaemon(a.address)
    try:
        waiting.hello("waiting")
        waiting.send({"op": "pull_request", "transfer_id": 1, "key": "not-yet",
                      "dst_dev": "cpu", "num_blocks": 1, "layout": [[BLOCK, "uint8"]],
                      "wait_for_key_s": 60.0})
        wait_until(lambda: a.client.stats()["transfers"]["pulls_waiting_for_key"] == 1,
                   timeout_s=5)
        reply = second.ask(hello(second.address, "second", 1))
        assert isinstance(reply, PeerError), reply
        assert reply.code == "peer_unreachable", reply
        assert "every one has work in flight" in reply.message, reply
        stats = a.client.stats()["peer"]
        assert stats["bad_messages"] == {"link_limit": 1} and stats["links_evicted"] == 0
        assert "reason=link_limit" in a.proc.log()
        waiting.close()
        wait_until(lambda: not a.client.stats()["peer"]["links"], timeout_s=5)
        assert isinstance(second.ask(hello(second.address, "second", 2)), PeerWelcome)
    finally:
        waiting.close()
        second.close()


def test_an_idle_link_carries_no_heartbeat_and_a_busy_one_asks_a_silent_peer_away(
        make_node: Callable[..., Node]) -> None:
    """kvd's heartbeats go on links with work in flight only. A peer linked and idle hears
    none over four heartbeat intervals (0.5 s each): an idle link costs the daemon
    nothing. Once a pull of the peer's waits at the daemon, heartbeats come asking for an
    answer; the peer gives none, and once the grace (2 s) has passed the daemon declares it
    dead and hangs up."""
    a = make_node("a")
    peer = FakeDaemon(a.address)
    pull = {"op": "pull_request", "transfer_id": 1, "key": "not-yet", "dst_dev": "cpu",
            "num_blocks": 1, "layout": [[BLOCK, "uint8"]], "wait_for_key_s": 60.0}
    try:
        peer.hello("quiet")
        peer.send({"op": "heartbeat", "epoch": 1})  # (its first message: the link is up)
        assert peer.sock.poll(2000) == 0, decode_peer(peer.sock.recv())
        peer.send(pull)
        assert peer.sock.poll(2000) != 0
        beat = decode_peer(peer.sock.recv())
        assert isinstance(beat, Heartbeat) and beat.ask, beat
        with pytest.raises(ConnectionError):  # (heartbeats, then the hang-up)
            while True:
                peer.recv(10)
        wait_until(lambda: "silent for" in a.proc.log())  # (logged just after the hang-up)
    finally:
        peer.close()


def test_pulls_served_per_peer_are_bounded(make_node: Callable[..., Node]) -> None:
    """A peer that stays linked asks for an offloaded key under ever new transfer ids
    and takes none of the bytes: MAX_PULLS_SERVED_PER_LINK pulls are served (an offer
    each, a read of the key held), the next ones are refused with a retriable error and
    counted; another peer's pull meanwhile is served byte-exact, and once the first peer
    leaves its pulls end and the key's memory comes back."""
    a = make_node("a", "--peer-grace-s", "60")
    b = make_node("b")
    data = random_region(1, 8)
    a.client.offload("k", a.client.register("kv", [data]), [0])
    extra = 16
    pull = {"op": "pull_request", "key": "k", "dst_dev": "cpu", "num_blocks": 1,
            "layout": [[BLOCK, "uint8"]]}
    peer = FakeDaemon(a.address)
    try:
        peer.hello("greedy")
        tids = range(1, MAX_PULLS_SERVED_PER_LINK + extra + 1)
        for t in tids:
            peer.send({**pull, "transfer_id": t})
        offered: set[int] = set()
        refused: dict[int, Refuse] = {}
        while len(offered) + len(refused) < len(tids):
            msg = peer.recv()
            if isinstance(msg, Offer):
                offered.add(msg.transfer_id)
            else:
                assert isinstance(msg, Refuse), msg
                refused[msg.transfer_id] = msg
        assert sorted(refused) == list(tids[-extra:])
        for msg in refused.values():
            assert msg.code == "pool_exhausted" and "the most at once" in msg.message, msg
            assert error_from_code(msg.code, msg.message).retriable
        stats = a.client.stats()
        assert stats["peer"]["bad_messages"] == {"pull_limit": extra}
        assert stats["transfers"]["in_flight_out"] == MAX_PULLS_SERVED_PER_LINK
        assert a.proc.log().count("of its pulls are being served already") == 1

        got = shared_zeros((1, BLOCK), torch.uint8)
        assert b.client.pull("k", a.address, b.client.register("got", [got]), [0],
                             timeout_s=20) == BLOCK
        assert torch.equal(got, data)
    finally:
        peer.close()
    wait_until(lambda: a.client.stats()["transfers"]["in_flight_out"] == 0, timeout_s=20)
    a.client.delete("k")
    # (a served pull's read of the key ends in its task's done callback, just after the
    # transfer leaves in_flight_out: the key's bytes are freed then)
    wait_until(lambda: a.client.stats()["pool"]["used_bytes"] == 0, timeout_s=10)


async def test_pulls_served_for_all_peers_are_bounded(
        sock_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers that each keep as many pulls served as one peer may (3 here, in a daemon in
    this process): once four have, a fifth peer's pull is refused with a retriable error
    and counted; when one of the four leaves, the fifth is served."""
    monkeypatch.setattr(transfer_machine, "MAX_PULLS_SERVED_PER_LINK", 3)
    config = make_config(sock_dir, max_waiting_pulls=0, peer_grace_s=60.0)
    pull = {"op": "pull_request", "key": "k", "dst_dev": "cpu", "num_blocks": 1,
            "layout": [[BLOCK, "uint8"]]}

    def ask(fake: FakeDaemon, tids: Sequence[int]) -> list[PeerMessage]:
        for t in tids:
            fake.send({**pull, "transfer_id": t})
        return [fake.recv() for _ in tids]

    async with running_daemon(config) as d, AsyncKvdClient(d.socket_path) as c:
        await c.offload("k", await c.register("kv", [random_region(1, 9)]), [0])
        address = (await c.stats())["peer"]["address"]
        fakes: list[FakeDaemon] = []
        try:
            for i in range(5):
                fakes.append(await asyncio.to_thread(FakeDaemon, address))
                await asyncio.to_thread(fakes[-1].hello, f"greedy{i}")
            for i, fake in enumerate(fakes[:4]):  # (ids of sends are unique daemon-wide)
                replies = await asyncio.to_thread(ask, fake, [10 * i + 1, 10 * i + 2, 10 * i + 3])
                assert all(isinstance(r, Offer) for r in replies), replies
            (refused,) = await asyncio.to_thread(ask, fakes[4], [41])
            assert isinstance(refused, Refuse) and refused.code == "pool_exhausted", refused
            assert "serves 12 pulls for its peers already" in refused.message, refused
            fakes.pop(0).close()
            async with asyncio.timeout(10):  # its pulls end with its link
                while (await c.stats())["transfers"]["in_flight_out"] > 9:
                    await asyncio.sleep(0.02)
            (offer,) = await asyncio.to_thread(ask, fakes[3], [42])
            assert isinstance(offer, Offer) and offer.transfer_id == 42, offer
        finally:
            for fake in fakes:
                fake.close()
        assert (await c.stats())["peer"]["bad_messages"] == {"pull_limit": 1}
