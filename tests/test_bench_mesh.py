"""benchmarks/mesh.py, smoke-run: a small mesh of `kvd serve` daemons with keys and
encrypted data moves checked bytes, one daemon is killed and restarted, fake peers link to
another, and the run leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "mesh.py")
MARK = "MESH_SMOKE_RUN"  # set in the run's environment: how its processes are found
REQUIRED = ("daemons", "p99_ms", "p999_ms", "max_ms", "errors", "bytes_checked",
            "link_losses", "threads_per_link", "tcp_per_idle_link", "idle_cpu_per_1000_links")


def marked(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of each live process whose environment carries ``tag``."""
    want = f"{MARK}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue  # (ended; its parent reaps it)
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found.append((int(name), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, IndexError):
            continue
    return found


def reap(tag: str) -> list[tuple[int, str]]:
    """What the run left: killed now, and returned for the assertion."""
    deadline = time.monotonic() + 5
    left = marked(tag)
    while left and time.monotonic() < deadline:  # (a child may still be exiting)
        time.sleep(0.1)
        left = marked(tag)
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.timeout(45)
def test_quick_mesh_moves_checked_bytes_restarts_and_leaves_no_process() -> None:
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, BENCH, "--quick", "--json"], cwd=ROOT,
                            env={**os.environ, MARK: tag}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        left = reap(tag)
    assert proc.returncode == 0, err[-3000:]
    assert not left, f"the run left processes behind: {left}"
    res = json.loads(out.strip().splitlines()[-1])
    missing = [key for key in REQUIRED if res.get(key) is None]
    assert not missing, (missing, err[-3000:])
    assert res["daemons"] == 3
    assert res["errors"] == 0, (res["errors_by_type"], res["first_errors"])
    assert res["bytes_checked"] > 0 and res["transfers"] > 0
    assert 0 < res["p50_ms"] <= res["p99_ms"] <= res["p999_ms"] <= res["max_ms"]
    assert res["ping_p99_ms"] > 0
    assert res["restart_transfer_ok"] is True and res["restart_relinked_s"] is not None
    assert res["links_peers"] == "fake" and res["links_made"] == res["links_requested"]
    # every mesh daemon has a link to each other one, and each link its threads
    assert all(row["links"] == 2 for row in res["per_daemon"]), res["per_daemon"]
    assert res["threads_per_link"] > 0 and res["tcp_per_idle_link"] > 0
