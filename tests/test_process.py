"""`kvd serve` as a real process: the blocking client, signals, clients that die, the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

import kvd
from kvd import KvdClient, shared_empty, shared_zeros
from kvd.protocol import ShmTensor
from tests.conftest import ProcessDaemon, ThreadDaemon, wait_until


def fill_random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    t = shared_empty(shape, torch.uint8)
    t.copy_(torch.randint(0, 256, shape, dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed)))
    return t


def test_sync_client_round_trip(process_daemon: ProcessDaemon) -> None:
    with KvdClient(process_daemon.socket_path, name="a") as a, \
            KvdClient(process_daemon.socket_path, name="b") as b:
        src, dst = fill_random((16, 4096), 1), shared_zeros((16, 4096), torch.uint8)
        r_src, r_dst = a.register("src", [src]), b.register("dst", [dst])
        assert a.offload("k", r_src, [0, 5, 9]) == 3 * 4096
        assert b.get("k", r_dst, [1, 2, 3], timeout_s=2) == 3 * 4096
        assert torch.equal(dst[1:4], src[[0, 5, 9]])
        transfer = a.put("p", r_src, [15])
        assert transfer.wait(5) == 4096 and transfer.done()
        b.get("p", r_dst, [0], timeout_s=2)
        assert torch.equal(dst[0], src[15])
        with pytest.raises(kvd.UnknownKey):
            b.get("p", r_dst, [0], timeout_s=0)
        with pytest.raises(kvd.KvdTimeout):
            b.get("p", r_dst, [0], timeout_s=0.2)
        assert a.ping() > 0


def test_block_ids_in_every_accepted_form(thread_daemon: ThreadDaemon) -> None:
    """Block ids travel packed (4 bytes each): a list, a tuple, a range, a generator, a
    numpy array of any integer dtype, a list of numpy integers and a torch tensor name
    the same blocks."""
    import numpy as np

    with KvdClient(thread_daemon.socket_path) as c:
        src, dst = fill_random((300, 64), 3), shared_zeros((300, 64), torch.uint8)
        r_src, r_dst = c.register("src", [src]), c.register("dst", [dst])
        wanted = [299, 0, 7, 256, 8, 9]
        forms: list[Any] = [wanted, tuple(wanted), (b for b in wanted), np.array(wanted, np.uint16),
                 np.array(wanted, np.int64), [np.int32(b) for b in wanted],
                 torch.tensor(wanted, dtype=torch.int32)]
        for i, ids in enumerate(forms):
            dst.zero_()
            c.offload(f"k{i}", r_src, ids)
            c.get(f"k{i}", r_dst, range(10, 16), timeout_s=2)
            assert torch.equal(dst[10:16], src[wanted]), type(ids)
            assert not dst[:10].any() and not dst[16:].any()
        c.offload("r", r_src, range(250, 300, 10))
        c.get("r", r_dst, [0, 1, 2, 3, 4], timeout_s=2)
        assert torch.equal(dst[:5], src[250:300:10])


def test_sync_client_transfer_stash(thread_daemon: ThreadDaemon) -> None:
    # Replies for other requests that arrive while waiting are kept for their owners.
    with KvdClient(thread_daemon.socket_path) as c:
        src, dst = fill_random((8, 1024), 2), shared_zeros((8, 1024), torch.uint8)
        r_src, r_dst = c.register("src", [src]), c.register("dst", [dst])
        transfers = [c.put(f"t{i}", r_src, [i]) for i in range(8)]
        assert c.stats()["keys"] >= 0  # a reply arrives while the puts' replies queue up
        assert [t.wait(5) for t in reversed(transfers)] == [1024] * 8
        for i in range(8):
            c.get(f"t{i}", r_dst, [7 - i], timeout_s=1)
        assert torch.equal(dst.flip(0), src)


def test_sigterm_finishes_in_flight_then_exits_zero(sock_dir: str) -> None:
    d = ProcessDaemon(sock_dir, "--pool-size-bytes", "640MiB").wait_ready()
    try:
        with KvdClient(d.socket_path) as c, KvdClient(d.socket_path) as watcher:
            big = shared_empty((4, 128 * 2**20), torch.uint8)  # a copy that takes a while
            big.view(torch.int64).copy_(torch.arange(big.numel() // 8).view(4, -1))
            region = c.register("big", [big])
            transfer = c.put("big", region, [0, 1, 2, 3])
            wait_until(lambda: watcher.stats()["in_flight"] >= 1, timeout_s=10, interval_s=0)
            d.signal(signal.SIGTERM)
            assert transfer.wait(30) == 2**29
            # Draining: new work is refused with a clear, retriable error.
            with pytest.raises((kvd.Draining, kvd.DaemonUnavailable)):
                c.offload("more", region, [0])
        assert d.proc.wait(30) == 0
        assert "draining" in d.log()
    finally:
        d.stop()


def test_second_signal_forces_exit(sock_dir: str) -> None:
    # Something the drain must wait for: a put to a peer that is stopped (SIGSTOP), which
    # stays in flight until its connection attempt times out (30 s here).
    os.makedirs(os.path.join(sock_dir, "peer"))
    peer = ProcessDaemon(os.path.join(sock_dir, "peer"))
    d = ProcessDaemon(sock_dir, "--drain-grace-s", "60", "--peer-connect-timeout-s", "30")
    try:
        peer.wait_ready()
        d.wait_ready()
        address = peer.peer_address()
        peer.signal(signal.SIGSTOP)
        with KvdClient(d.socket_path) as c:
            region = c.register("kv", [shared_zeros((4, 64), torch.uint8)])
            c.put("k", region, [0], to=address, timeout_s=60)
            wait_until(lambda: c.stats()["in_flight"] >= 1, timeout_s=10)
            d.signal(signal.SIGTERM)
            # Two SIGTERMs sent back to back can reach the process as one (a pending
            # signal is not queued twice): send the second once the first was handled.
            wait_until(lambda: "draining: waiting" in d.log(), timeout_s=15)
            d.signal(signal.SIGTERM)
            code = d.proc.wait(15)  # well before the put's 30 s or the drain's 60 s
        assert code == 130, d.log()
        assert "forcing exit" in d.log()
    finally:
        peer.signal(signal.SIGCONT)
        d.stop()
        peer.stop()


CHILD = textwrap.dedent(
    """
    import sys, time, torch, kvd
    c = kvd.KvdClient(sys.argv[1])
    c.connect()
    t = kvd.shared_zeros((32, 4096), torch.uint8)
    r = c.register("kv", [t])
    c.offload("owned", r, [0, 1, 2])           # no TTL: dies with its owner
    c.offload("kept", r, [3], ttl_s=300)        # TTL: outlives its owner
    c.publish("pub", r, [4, 5])
    get = c.put("mine", r, [6])                 # stored for a get that never comes
    get.wait(5)
    print("ready", flush=True)
    c.start_get("never", r, [7], timeout_s=60)  # a get left waiting in the daemon
    time.sleep(60)
    """
)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_killed_client_loses_registrations(process_daemon: ProcessDaemon) -> None:
    with KvdClient(process_daemon.socket_path) as watcher:
        free0 = watcher.stats()["pool"]["free_bytes"]
        fds0 = _open_fds(process_daemon.proc.pid)
        child = subprocess.Popen([sys.executable, "-c", CHILD, process_daemon.socket_path],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            # its connection, its segment and the region's mapping of it
            assert _open_fds(process_daemon.proc.pid) >= fds0 + 3
            wait_until(lambda: watcher.stats()["waiting_gets"] == 1)
            stats = watcher.stats()
            assert stats["regions"] == 1 and stats["keys"] == 4 and stats["clients"] == 2
            child.kill()
            child.wait(10)
            killed = time.monotonic()
        finally:
            if child.poll() is None:
                child.kill()
        stats = wait_until(lambda: (s := watcher.stats())["regions"] == 0 and s)
        # Its lifeline closed with it: the daemon knew at once, not at some timeout.
        assert time.monotonic() - killed < 2.0
        assert stats["clients"] == 1 and stats["waiting_gets"] == 0
        # Left: the TTL'd offload and the put that arrived for someone else.
        assert stats["keys"] == 2
        # The segment's descriptor and mapping went with the client (and with them the
        # segment's memory: a memfd lives while anyone holds it, and nothing has a name).
        wait_until(lambda: _open_fds(process_daemon.proc.pid) == fds0)
        watcher.delete("kept")
        watcher.delete("mine")
        assert watcher.stats()["pool"]["free_bytes"] == free0


def test_daemon_unavailable_when_daemon_dies(sock_dir: str) -> None:
    d = ProcessDaemon(sock_dir).wait_ready()
    c = KvdClient(d.socket_path, timeout_s=30)
    c.connect()
    try:
        async def both() -> None:
            async with kvd.AsyncKvdClient(d.socket_path, timeout_s=30) as a:
                region = await a.register("kv", [kvd.shared_zeros((4, 64), torch.uint8)])
                waiting = asyncio.ensure_future(a.get("never", region, [0], timeout_s=30))
                await asyncio.sleep(0.2)
                d.proc.kill()
                await asyncio.to_thread(d.proc.wait, 10)
                # The lifelines close with the daemon: both clients know at once, not at
                # their 30 s timeout (ZeroMQ alone would say nothing).
                t0 = time.monotonic()
                with pytest.raises(kvd.DaemonUnavailable, match="closed the connection"):
                    await waiting
                with pytest.raises(kvd.DaemonUnavailable, match="closed the connection"):
                    await a.ping()
                assert time.monotonic() - t0 < 2.0
            t0 = time.monotonic()
            with pytest.raises(kvd.DaemonUnavailable, match="closed the connection"):
                c.ping()
            assert time.monotonic() - t0 < 2.0

        asyncio.run(both())
    finally:
        c.close()
        d.stop()


def run_cli(*args: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvd.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env)


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--pool-size-bytes", "-5"], {}, "pool_size_bytes"),
        (["--http-port", "abc"], {}, "--http-port"),
        ([], {"KVD_POOL_SIZE_BYTES": "lots"}, "KVD_POOL_SIZE_BYTES"),
        ([], {"KVD_POOL_SIZ": "1"}, "KVD_POOL_SIZ"),
        (["--socket-path", "/proc/kvd/x.sock"], {}, "socket_path"),
    ],
)
def test_serve_config_errors_exit_2(args: list[str], env: dict[str, str], needle: str,
                                    sock_dir: str) -> None:
    if "--socket-path" not in args:
        args = [*args, "--socket-path", os.path.join(sock_dir, "s.sock")]
    result = run_cli("serve", *args, env=env, timeout=30)
    assert result.returncode == 2, result.stderr
    # One line says what is wrong; before it, at most the start-up steps that ran.
    lines = [line for line in result.stderr.strip().splitlines()
             if " kvd.startup: " not in line]
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_config_file_and_env_precedence_in_serve(sock_dir: str) -> None:
    toml = os.path.join(sock_dir, "kvd.toml")
    with open(toml, "w") as f:
        f.write('pool_size_bytes = "32MiB"\nnode_id = "from-file"\nlog_level = "warning"\n')
    sock = os.path.join(sock_dir, "p.sock")
    d = ProcessDaemon(sock_dir, "--config", toml, "--socket-path", sock,
                      env={"KVD_NODE_ID": "from-env"})
    d.socket_path = sock
    try:
        d.wait_ready()
        with KvdClient(sock) as c:
            stats = c.stats()
        # --pool-size-bytes 64MiB (flag) beats the file; the env beats the file's node id.
        assert stats["pool"]["capacity_bytes"] == 64 * 2**20
        assert stats["node_id"] == "from-env"
    finally:
        assert d.stop() == 0


def test_cli_ping_stats_and_unavailable(process_daemon: ProcessDaemon, sock_dir: str) -> None:
    result = run_cli("ping", "--socket-path", process_daemon.socket_path, "--json")
    assert result.returncode == 0 and '"rtt_s"' in result.stdout
    result = run_cli("stats", "--socket-path", process_daemon.socket_path)
    assert result.returncode == 0 and '"pool"' in result.stdout
    missing = os.path.join(sock_dir, "none.sock")
    result = run_cli("ping", "--socket-path", missing, "--timeout", "1")
    assert result.returncode == 1 and missing in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_demo_exits_zero() -> None:
    result = run_cli("demo", "--blocks", "16", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bytes checked" in result.stdout


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0 and kvd.__version__ in result.stdout


def test_example_offload_and_get(process_daemon: ProcessDaemon) -> None:
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "offload_and_get.py")
    result = subprocess.run([sys.executable, example], capture_output=True, text=True,
                            timeout=60, env={**os.environ,
                                             "KVD_SOCKET_PATH": process_daemon.socket_path})
    assert result.returncode == 0, result.stderr
    assert "got it back" in result.stdout


def test_a_registered_segment_cannot_shrink_under_the_daemon(
        process_daemon: ProcessDaemon) -> None:
    """A daemon touching a mapping whose file was truncated dies of SIGBUS (it did, when CPU
    tensors were named files in /dev/shm: one client's truncate took every client's daemon
    down). Segments are sealed memfds: neither the descriptor nor its /proc path can be
    truncated, and the daemon keeps moving the bytes."""
    from kvd.client.shm import segment_of, tensor_spec

    with KvdClient(process_daemon.socket_path) as c:
        t = kvd.shared_zeros((64, 4096), torch.uint8)
        r = c.register("r", [t])
        spec = tensor_spec(t)
        assert isinstance(spec, ShmTensor)
        seg = segment_of(spec)
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 0)
        with pytest.raises(PermissionError):
            os.truncate(f"/proc/self/fd/{seg.fd}", 0)
        t.fill_(7)
        c.offload("k", r, list(range(64)))
        back = kvd.shared_zeros((64, 4096), torch.uint8)
        c.get("k", c.register("back", [back]), list(range(64)))
        assert bool((back == 7).all())
    assert process_daemon.proc.poll() is None
