"""The NCCL adapter on two GPUs in two processes (skipped without a GPU and nccl4py; with
one GPU both ranks share it, each told it is a host of its own, see tests/gpu_nodes.py):
bytes arrive intact, and a peer that dies mid-transfer is caught by the deadline, the
communicator is aborted promptly, and the GPU stays usable; with blocking calls and with
non-blocking ones. With blocking calls, a peer that splits but never connects (silent, or
dead) fails the init within its timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from kvd.transport.nccl import nccl_available
from tests.gpu_nodes import nccl_env

pytestmark = pytest.mark.gpu
RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_nccl_rank.py")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


requires_gpus = pytest.mark.skipif(
    not nccl_available() or _gpus() < 1, reason="needs a CUDA GPU and nccl4py")


def _start(mode: str, xdir: str, calls: str = "blocking") -> list[subprocess.Popen[str]]:
    root = os.path.dirname(os.path.dirname(RANK))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return [subprocess.Popen([sys.executable, RANK, str(r), mode, xdir, calls],
                             env={**env, **nccl_env(f"rank{r}")}, stdout=subprocess.PIPE,
                             text=True) for r in (0, 1)]


def _result(proc: subprocess.Popen[str], timeout_s: float = 120) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out
    return dict(json.loads(out.strip().splitlines()[-1]))


CALLS = pytest.mark.parametrize("calls", ["blocking", "nonblocking"])


@requires_gpus
@CALLS
def test_nccl_send_recv_between_two_gpus(tmp_path: Any, calls: str) -> None:
    procs = _start("once", str(tmp_path), calls)
    try:
        r0, r1 = _result(procs[0]), _result(procs[1])
        print(f"\nnccl rank 0 -> rank 1 ({_gpus()} GPUs), 256 MiB, {calls} calls: rank0 {r0} "
              f"rank1 {r1}")
        assert r1["equal"] is True
        assert r0["blocking"] is r1["blocking"] is (calls == "blocking")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@requires_gpus
@CALLS
def test_nccl_peer_death_is_caught_by_the_deadline(tmp_path: Any, calls: str) -> None:
    procs = _start("until-killed", str(tmp_path), calls)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(tmp_path / "kill"):
            assert time.monotonic() < deadline and procs[0].poll() is None
            time.sleep(0.01)
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
        (tmp_path / "killed").write_text("1")
        result = _result(procs[0])
        print(f"\nnccl peer death, {calls} calls: {result}")
        assert result["error"] is not None and result["aborted"] is True
        assert result["detected_s"] is not None and result["detected_s"] < 3 + 3 + 2
        assert result["gpu_usable"] is True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@requires_gpus
@pytest.mark.parametrize("mode", ["silent-peer", "dead-peer"])
def test_blocking_connection_setup_to_a_peer_that_never_connects_is_bounded(
        tmp_path: Any, mode: str) -> None:
    # The one blocking call that waits on the peer: a watchdog revokes it at the init's
    # timeout (5 s in gpu_nccl_rank.py), or NCCL's capped retries end it sooner.
    procs = _start(mode, str(tmp_path))
    try:
        result = _result(procs[0])
        print(f"\nnccl {mode}: {result}")
        assert result["error"] is not None
        assert result["failed_after_s"] < 5 + 3
        assert result["gpu_usable"] is True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
