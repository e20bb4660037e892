"""`kvd serve`'s start-up and stop as an operator sees them: each start-up step in the log
with its time, the host pool's progress, systemd's STATUS and /readyz saying the same; the
drain's real grace; the process gone right after "kvd stopped"."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from kvd import Draining, KvdClient, shared_zeros
from tests.conftest import READY_TIMEOUT_S, ProcessDaemon, wait_until

# `INFO kvd.startup: +2.15s http listening on 127.0.0.1:9400 (took 0.03s)`
STEP = re.compile(r"kvd\.startup: \+(\d+\.\d+)s (.*?)(?: \(took (\d+\.\d+)s\))?$")

# The steps of a CPU-only start, in order (a prefix of each line's text).
STEPS_IN_ORDER = [
    "config read", "imports done", "socket path claimed", "http listening on",
    "no GPU seen", "nccl", "peer ports claimed: 127.0.0.1:",
    "allocating the host pool: 2GiB, not pinned, every page touched",
    "host pool: touching pages", "host pool allocated: 2GiB, not pinned, touching",
    "engine and peer plane set up", "local socket listening at",
    "peer socket listening at", "kvd ready node=",
]


def steps_of(log: str) -> list[tuple[float, str, float | None]]:
    found = []
    for line in log.splitlines():
        m = STEP.search(line)
        if m:
            found.append((float(m[1]), m[2], float(m[3]) if m[3] else None))
    return found


def http_get(address: str, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_startup_steps_logged_in_order_with_times_and_pool_progress(sock_dir: str) -> None:
    """A 2 GiB pool with every page touched: its progress is logged every tenth, said in
    STATUS= and in /readyz's reason while it is taken; every step has its time."""
    notify_path = os.path.join(sock_dir, "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(0.1)
    statuses: list[str] = []
    reading = True

    def read_notify() -> None:  # as systemd does: at once (the socket's queue is short)
        while reading:
            with contextlib.suppress(TimeoutError):
                statuses.extend(line for line in listener.recv(4096).decode().splitlines()
                                if line.startswith("STATUS="))

    reader = threading.Thread(target=read_notify)
    reader.start()
    d = ProcessDaemon(sock_dir, "--pool-size-bytes", "2GiB",
                      env={"NOTIFY_SOCKET": notify_path, "KVD_DEV": "pool_prefault=true"})
    try:
        # /readyz while the pool is taken: its address from the log, asked until ready.
        address = wait_until(lambda: re.search(r"http listening on (\S+)", d.log()),
                             timeout_s=READY_TIMEOUT_S, interval_s=0.01)[1]
        reasons: list[str] = []
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            code, body = http_get(address, "/readyz")
            if code == 200:
                break
            reasons += [str(r) for r in body["reasons"]]  # type: ignore[attr-defined]
            time.sleep(0.01)
        d.wait_ready()
        log = d.log()
        steps = steps_of(log)
        texts = [text for _, text, _ in steps]
        print("\n".join(f"+{at:.2f}s {text} ({took}s)" for at, text, took in steps))
        # In order: each step after the one before it.
        at = -1
        for wanted in STEPS_IN_ORDER:
            i = next((i for i, t in enumerate(texts) if i > at and t.startswith(wanted)), None)
            assert i is not None, f"no {wanted!r} after {texts[at] if at >= 0 else 'start'}"
            at = i
        times = [t for t, _, _ in steps]
        assert times == sorted(times) and 0 < times[0] < times[-1]
        # Each step that is done says its own duration, within the time since the start.
        for t, text, took in steps:
            if not text.startswith(("allocating", "host pool:", "kvd ready")):
                assert took is not None and 0 <= took <= t, text
        progress = [t for t in texts if t.startswith("host pool: touching pages")]
        assert len(progress) >= 5, progress  # every tenth of a 2 GiB pool (64 MiB at a time)
        assert "touching pages 100% (2GiB of 2GiB)" in progress[-1]
        # STATUS= followed the same steps.
        assert any("allocating the host pool" in s and "touching pages" in s
                   for s in statuses), statuses
        assert any(s.startswith("STATUS=loading GPU kernels") or
                   s.startswith("STATUS=opening the peer socket") for s in statuses), statuses
        # /readyz said the pool is being taken, and how far (the first answers came before).
        print("readyz reasons:", sorted(set(reasons)))
        assert any(r.startswith("host pool being allocated: touching pages")
                   for r in reasons), reasons
    finally:
        reading = False
        reader.join(5)
        listener.close()
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("flag", ["--peer-port", "--data-port", "--http-port"])
def test_a_port_in_use_fails_the_start_before_the_pool_is_taken(sock_dir: str,
                                                                flag: str) -> None:
    """Every port is claimed before the host pool is allocated (and before the local
    socket is made): one in use costs no memory and leaves nothing behind."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    d = ProcessDaemon(sock_dir, flag, str(port), "--pool-size-bytes", "1GiB")
    try:
        code = d.proc.wait(READY_TIMEOUT_S)
    finally:
        d.stop()
        taken.close()
    log = d.log()
    setting = flag[2:].replace("-", "_")
    assert code == 2, log
    assert log.endswith(f"kvd: config error: {setting}: cannot listen on 127.0.0.1:{port}: "
                        "Address already in use\n"), log
    assert "allocating the host pool" not in log and not os.path.exists(d.socket_path), log


def test_a_client_is_told_a_daemon_is_starting_and_how_far(sock_dir: str) -> None:
    """`kvd ping` while the daemon takes its pool: not "no daemon", but which one and where
    its start stands. (The daemon is held still by SIGSTOP while the client asks.)"""
    d = ProcessDaemon(sock_dir, "--pool-size-bytes", "2GiB")
    starting = Path(d.socket_path + ".starting")
    try:
        wait_until(lambda: starting.exists() and "touching pages" in starting.read_text(),
                   timeout_s=READY_TIMEOUT_S, interval_s=0.002)
        d.signal(signal.SIGSTOP)
        try:
            step = starting.read_text().split(" ", 1)[1].strip()
            result = subprocess.run([sys.executable, "-m", "kvd.cli", "ping", "--socket-path",
                                     d.socket_path], capture_output=True, text=True,
                                    timeout=60)
        finally:
            d.signal(signal.SIGCONT)
        assert re.fullmatch(r"allocating the host pool: 2GiB, not pinned, every page touched: "
                            r"host pool: touching pages \d+% \(\S+ of 2GiB\)", step), step
        assert (result.returncode, result.stdout) == (1, "")
        assert result.stderr == (f"kvd: daemon_unavailable: a kvd daemon is starting at "
                                 f"{d.socket_path} (pid {d.proc.pid}): {step}; it answers "
                                 "once it is ready\n")
        d.wait_ready()
        assert not starting.exists()  # (it serves: the file is gone)
    finally:
        assert d.stop() == 0, d.log()
    assert not starting.exists()


def stopped_to_exit_s(d: ProcessDaemon) -> float:
    """Seconds from "kvd stopped" in the log to the process's exit (the log polled)."""
    wait_until(lambda: "kvd stopped" in d.log(), timeout_s=60, interval_s=0.005)
    seen = time.monotonic()
    d.proc.wait(60)
    return time.monotonic() - seen


def test_drain_says_its_grace_and_the_process_exits_right_after_stopping(
        sock_dir: str) -> None:
    os.makedirs(os.path.join(sock_dir, "a"))
    os.makedirs(os.path.join(sock_dir, "b"))
    # No grace asked: the configured one, said so.
    a = ProcessDaemon(os.path.join(sock_dir, "a"), "--drain-grace-s", "7").wait_ready()
    b = ProcessDaemon(os.path.join(sock_dir, "b")).wait_ready()
    try:
        with KvdClient(a.socket_path) as c:
            report = c.drain(grace_s=None, timeout_s=30)
        assert report["cancelled"] == 0
        took = stopped_to_exit_s(a)
        print(f"'kvd stopped' -> exit: {took:.3f}s")
        assert a.proc.returncode == 0
        assert "drain requested over the local socket (grace 7.0s: drain_grace_s)" in a.log()
        assert "grace None" not in a.log()
        assert took < 2.5
        # A grace asked for is the one that applies, 0 too.
        with KvdClient(b.socket_path) as c:
            c.drain(grace_s=0, timeout_s=30)
        took = stopped_to_exit_s(b)
        print(f"'kvd stopped' -> exit: {took:.3f}s")
        assert "drain requested over the local socket (grace 0.0s, as asked)" in b.log()
        assert took < 2.5
    finally:
        assert a.stop() == 0, a.log()
        assert b.stop() == 0, b.log()


def test_a_drain_fails_waiting_gets_at_once_with_draining(sock_dir: str) -> None:
    """Gets that wait for a key when a drain begins fail at once with ``Draining``, long
    before their own timeout or the drain's grace."""
    d = ProcessDaemon(sock_dir, "--drain-grace-s", "20").wait_ready()
    try:
        with KvdClient(d.socket_path, timeout_s=60) as waiter, \
                KvdClient(d.socket_path, timeout_s=60) as operator:
            region = waiter.register("kv", [shared_zeros((4, 1024), torch.uint8)])
            gets = [waiter.start_get(f"k{i}", region, [i], timeout_s=45) for i in range(3)]
            time.sleep(0.3)  # (they wait in the daemon now)
            drained = threading.Thread(target=operator.drain, kwargs={"timeout_s": 60})
            started = time.monotonic()
            drained.start()
            for get in gets:
                with pytest.raises(Draining):
                    get.wait()
            took = time.monotonic() - started
            drained.join(60)
        print(f"waiting gets failed {took:.3f}s after the drain began")
        assert took < 5.0
    finally:
        d.stop()
