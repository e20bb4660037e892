"""No local tenant can end the daemon: attacks on the door (``socket_path``) by another
process, as an unprivileged user in the socket's group where the tests run as root.

Each attack runs against a `kvd serve` with a low open-file limit (so that the limit is
within reach), from ``tests/local_attacker.py``. While it holds, and after it ends: the
daemon is alive, a new client is served (a real one, with a CPU tensor and bytes checked),
a new peer links, and its descriptors come back to within a stated bound (its memory,
too, stays within one while messages are begun and never finished).
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import site
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvd import KvdClient, shared_zeros
from kvd.protocol import PeerWelcome
from tests.conftest import ProcessDaemon
from tests.test_hostile_peers import hello
from tests.test_peers import RawPeer

NOBODY = 65534
# What a daemon may hold above its descriptors before an attack, once the attack is over
# (lifelines on their way out, ZeroMQ's own).
FDS_AFTER_ATTACK = 16


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def nobody_python() -> tuple[str, dict[str, str]] | None:
    """A Python that nobody can run with this one's packages, and its environment: this
    one, or the system's of the same version where this one lives in a home directory only
    root may enter. None when the tests do not run as root, or there is none."""
    if os.geteuid() != 0:
        return None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *site.getsitepackages()])}
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (sys.executable, f"/usr/bin/python{version}"):
        try:
            if subprocess.run([exe, "-c", "import kvd, zmq, msgspec"], user=NOBODY,
                              group=NOBODY, extra_groups=[], env=env, cwd=ROOT,
                              capture_output=True, timeout=120).returncode == 0:
                return exe, env
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


class Attacker:
    """``tests/local_attacker.py`` as another process: as nobody, in the socket's group,
    where the tests run as root and a Python with this one's packages runs as nobody;
    else as this user, in a process of its own."""

    def __init__(self, mode: str, path: str, n: int) -> None:
        nobody = nobody_python()
        exe, env = nobody or (sys.executable, dict(os.environ))
        if nobody:  # the socket's group is the attacker's: it may connect
            for where in (os.path.dirname(path), path):
                os.chown(where, -1, NOBODY)
            os.chmod(os.path.dirname(path), 0o750)
        who = NOBODY if nobody else None
        self.unprivileged = nobody is not None
        self.proc = subprocess.Popen(
            [exe, "-m", "tests.local_attacker", mode, path, str(n)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=ROOT, env=env, user=who, group=who,
            extra_groups=[] if nobody else None)

    def ready(self, timeout_s: float = 60.0) -> str:
        """What it says once its attack holds."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY"):
                return line.strip()
            if not line and self.proc.poll() is not None:
                break
        raise AssertionError(f"attacker not ready: {self.proc.poll()}")

    def stop(self) -> str:
        """End the attack; what it said last."""
        out, _ = self.proc.communicate(timeout=60)
        return out.strip()


@dataclass
class Attack:
    """An attack that holds: the daemon, its descriptors before, what the attacker said;
    once it is over, the daemon's counts of bad messages."""

    daemon: ProcessDaemon
    attacker: Attacker
    said: str
    fds_before: int
    bad: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def under_attack(sock_dir: str, mode: str, n: int, open_files: int) -> Iterator[Attack]:
    """A `kvd serve` whose open-file limit is ``open_files``, attacked (``mode``, ``n``)
    while the block runs. Then, the attack over: the daemon is alive, serves a new client,
    holds its descriptors of before (within ``FDS_AFTER_ATTACK``), and stops cleanly."""
    d = ProcessDaemon(sock_dir, open_files=open_files).wait_ready()
    a: Attacker | None = None
    try:
        before = open_fds(d.proc.pid)
        a = Attacker(mode, d.socket_path, n)
        said = a.ready()
        print(said, "as nobody" if a.unprivileged else "as this user")
        yield (attack := Attack(d, a, said, before))
        print(a.stop())
        assert d.proc.poll() is None, d.log()
        served(d.socket_path)
        peer_served(d.peer_address())
        attack.bad = bad_messages(d.socket_path)
        deadline = time.monotonic() + 10
        while open_fds(d.proc.pid) > before + FDS_AFTER_ATTACK and time.monotonic() < deadline:
            time.sleep(0.1)
        assert open_fds(d.proc.pid) <= before + FDS_AFTER_ATTACK, (open_fds(d.proc.pid),
                                                                   before)
    finally:
        if a is not None and a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait(10)
        assert d.stop() == 0, d.log()


def served(path: str) -> None:
    """A new client registers a CPU tensor, and a put and a get move its bytes."""
    with KvdClient(path, timeout_s=30) as c:
        src = shared_zeros((4, 4096), torch.uint8)
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))
        dst = shared_zeros((4, 4096), torch.uint8)
        r_src, r_dst = c.register("src", [src]), c.register("dst", [dst])
        c.put("k", r_src, [0, 1, 2, 3])
        c.get("k", r_dst, [3, 2, 1, 0])
        assert torch.equal(dst, src.flip(0))


def peer_served(address: str) -> None:
    """A new peer links: its hello is welcomed."""
    peer = RawPeer(address)
    try:
        reply = peer.ask(hello("127.0.0.1:9", "a-new-peer", 1))
        assert isinstance(reply, PeerWelcome), reply
    finally:
        peer.close()


def bad_messages(path: str) -> dict[str, int]:
    with KvdClient(path, timeout_s=30) as c:
        counts: dict[str, int] = c.stats()["bad_messages"]
        return counts


def test_a_flood_of_connections_neither_ends_the_daemon_nor_locks_clients_out(
        sock_dir: str) -> None:
    """3,000 connections held and reopened at a daemon whose open-file limit is 1,024 (F1:
    libzmq's IPC listener used to abort the process at the limit; F3: 64 connections that
    never said hello locked every new client out). Connections without a hello are bounded
    per user, the oldest of the biggest holder closed first: clients get in while the
    flood holds."""
    with under_attack(sock_dir, "flood", 3000, open_files=1024) as at:
        for _ in range(10):
            served(at.daemon.socket_path)
        assert open_fds(at.daemon.proc.pid) < at.fds_before + 3 * 64
    assert at.bad.get("unclaimed_limit", 0) > 0, at.bad


def test_segments_handed_over_are_bounded_in_all(sock_dir: str) -> None:
    """Sessions that hand over one memfd under ever new ids (F1b: six used to fill 20,000
    descriptors) are refused, with a count, before the daemon's limit; once they end,
    everything they held is back."""
    with under_attack(sock_dir, "segments", 6, open_files=2048) as at:
        handed = int(at.said.split()[2])
        assert 0 < handed <= (2048 - 512) // 2, at.said
        assert open_fds(at.daemon.proc.pid) < 2048 - 256
    assert at.bad.get("descriptor_limit", 0) > 0, at.bad


def test_routing_ids_are_the_daemons_to_give(sock_dir: str) -> None:
    """Clients that take the routing ids libzmq generates next as their own (F2: a ROUTER
    asserted, and aborted, when it generated one of them for the next client): every
    connection on the daemon's ROUTER is one it made, under an id it chose."""
    with under_attack(sock_dir, "ids", 200, open_files=4096) as at:
        for _ in range(5):
            served(at.daemon.socket_path)


def test_a_message_begun_and_never_finished_holds_no_more_than_the_limit(
        sock_dir: str) -> None:
    """24 sessions each begin a 63 MiB message and never finish it (F4: the daemon held
    62 MiB each). The local socket reads at most max_message_bytes (1 MiB) per message:
    the connection ends at the frame's header."""
    with under_attack(sock_dir, "bigmsg", 24, open_files=4096) as at:
        rss_before = rss_kib(at.daemon.proc.pid)
        time.sleep(1)
        grown = (rss_kib(at.daemon.proc.pid) - rss_before) // 1024
        print(f"RSS grew {grown} MiB")
        assert grown < 48, grown
        served(at.daemon.socket_path)


def test_a_client_with_more_than_1024_descriptors_open_hands_segments_over(
        sock_dir: str) -> None:
    """F5: the lifeline's descriptor is past select()'s 1024 in a process with many open;
    the sync client's register of CPU tensors still works."""
    d = ProcessDaemon(sock_dir).wait_ready()
    held: list[int] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    try:
        while len(held) < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert max(held) > 1024
        served(d.socket_path)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert d.stop() == 0, d.log()


def test_clients_that_come_and_go_at_once_all_get_in(sock_dir: str) -> None:
    """1,200 clients connect and close from 4 threads: each is reached through a descriptor
    number the one before may have had, and none loses its connection to the other's end
    (3 in 1,200 did, when libzmq ended a lost endpoint by its name)."""
    d = ProcessDaemon(sock_dir).wait_ready()
    failed: list[str] = []

    def come_and_go() -> None:
        for _ in range(300):
            try:
                with KvdClient(d.socket_path, timeout_s=10) as c:
                    c.ping()
            except Exception as exc:
                failed.append(repr(exc))

    try:
        threads = [threading.Thread(target=come_and_go) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failed, failed[:3]
    finally:
        assert d.stop() == 0, d.log()
