"""`kvd serve` subprocesses for the GPU tests (one GPU each, or all of them).

On a host with one GPU the tests of two daemons run both on that GPU: each is told it is a
host of its own (``NCCL_HOSTID``), so NCCL connects them as it would two nodes, over its
socket transport on loopback (NCCL refuses two ranks of one host on one GPU). Bytes,
protocol and failures are those between nodes; the speed is not (no NVLink), so the
benchmarks still need two GPUs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kvd
from tests.conftest import READY_TIMEOUT_S


@dataclass
class Node:
    sock: str
    address: str  # host:port of its peer socket
    proc: subprocess.Popen[bytes]
    log_path: str


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_gpus() -> tuple[int, int]:
    """The GPUs of the two daemons a test starts: one each, or both on the only one."""
    return (0, 1) if gpu_count() >= 2 else (0, 0)


def nccl_env(name: str) -> dict[str, str]:
    """What a process of NCCL rank ``name`` needs in its environment to share the one
    GPU of a one-GPU host with the other rank (see the module's docstring)."""
    if gpu_count() >= 2:
        return {}
    return {"NCCL_HOSTID": f"kvd-test-{name}", "NCCL_SOCKET_IFNAME": "lo"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_node(gpu: int | None, *extra: str, ports: tuple[int, int] | None = None,
               sock: str | None = None, env: dict[str, str] | None = None,
               **popen: Any) -> Node:
    """A `kvd serve` on GPU ``gpu`` only (``CUDA_VISIBLE_DEVICES``; None: all GPUs),
    answering pings. Flags in ``extra`` override the defaults here; ``sock``: its socket
    (default: in a directory of its own); ``env`` is added to its environment and
    ``popen`` goes to ``subprocess.Popen`` (``user=``, ``cwd=``...)."""
    tmp = tempfile.mkdtemp(prefix=f"kvd-g{gpu}-", dir="/tmp")
    sock = sock or os.path.join(tmp, "kvd.sock")
    peer_port, data_port = ports or (free_port(), free_port())
    log_path = os.path.join(tmp, "log")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", **nccl_env(os.path.basename(tmp)),
           **(env or {})}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli", "serve", "--socket-path", sock,
             "--node-id", f"gpu{gpu}-{peer_port}", "--peer-port", str(peer_port), "--data-port",
             str(data_port), "--http-port", "0", "--pool-size-bytes", "1GiB",
             "--heartbeat-interval-s", "0.5", "--peer-grace-s", "2", *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, **popen)
    node = Node(sock, f"127.0.0.1:{peer_port}", proc, log_path)
    try:
        _wait_ready(node, gpu)
    except BaseException:  # not ready in time, or the test was interrupted: no daemon left
        proc.kill()
        proc.wait(30)
        raise
    return node


def _wait_ready(node: Node, gpu: int | None) -> None:
    """Until it answers a ping: a GPU daemon loads CUDA and its kernels first, which on a
    loaded machine takes a while; one that exits fails at once."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            with kvd.KvdClient(node.sock, timeout_s=5) as c:
                c.ping()
            return
        except kvd.KvdError:  # not listening yet, or too busy to answer in time
            if node.proc.poll() is not None or time.monotonic() > deadline:
                with open(node.log_path) as f:
                    raise AssertionError(f"daemon on GPU {gpu} did not start:\n"
                                         + f.read()[-3000:]) from None
            time.sleep(0.1)


def stop_node(node: Node) -> int:
    """Stop it (SIGTERM, 60 s) and return its exit code."""
    if node.proc.poll() is None:
        node.proc.terminate()
        try:
            node.proc.wait(60)
        except subprocess.TimeoutExpired:
            stacks = thread_stacks(node.proc.pid)
            node.proc.kill()
            node.proc.wait(10)
            with open(node.log_path, errors="replace") as f:
                log = f.read()[-6000:]
            raise AssertionError(f"daemon did not stop within 60 s; its threads:\n{stacks}\n"
                                 f"its log:\n{log}") from None
    return node.proc.returncode


def thread_stacks(pid: int) -> str:
    """Every thread's Python and native stack (py-spy, where installed): what a daemon
    that does not stop is waiting on."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "(py-spy is not installed)"
    done = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True,
                          text=True, timeout=60)
    return done.stdout + done.stderr


@contextlib.contextmanager
def running_node(gpu: int | None, *extra: str) -> Iterator[Node]:
    """A node for the duration of a test, which must end cleanly (exit code 0)."""
    node = start_node(gpu, *extra)
    try:
        yield node
    finally:
        code = stop_node(node)
    assert code == 0, f"daemon exited with {code}"
