"""benchmarks/mesh.py, smoke-run: a small mesh of `kvd serve` daemons with keys and
encrypted data moves checked bytes, one daemon is killed and restarted, fake peers link to
another, and the run leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.conftest import reap_tagged

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "mesh.py")
MARK = "MESH_SMOKE_RUN"  # set in the run's environment: how its processes are found
REQUIRED = ("daemons", "p99_ms", "p999_ms", "max_ms", "errors", "bytes_checked",
            "link_losses", "threads_per_link", "tcp_per_idle_link", "idle_cpu_per_1000_links")




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
        left = reap_tagged(MARK, tag, wait_s=5)
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
    # every mesh daemon has a link to each other one; an idle link holds no thread of its
    # own, only its ZeroMQ connection
    assert all(row["links"] == 2 for row in res["per_daemon"]), res["per_daemon"]
    assert res["threads_per_link"] < 0.1 and res["tcp_per_idle_link"] == 1, res
