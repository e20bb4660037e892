"""GPU regions through CUDA IPC (skipped without CUDA): a client shares CUDA tensors with a
`kvd serve` subprocess, which moves their blocks to its host pool and back, and between
GPUs, bytes checked; a client that exits takes its mappings with it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq

import kvd
from kvd.client.lifeline import ClientLifeline
from kvd.protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    Pong,
    decode_reply,
)
from tests.gpu_nodes import running_node, start_node, stop_node

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = (64, 16, 8, 128)  # blocks, tokens, kv heads, head dim: 32 KiB per block in bf16


@pytest.fixture
def daemon() -> Iterator[str]:
    with running_node(None) as node:
        yield node.sock


def kv_layers(device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen, device=device).to(torch.bfloat16)
            for _ in range(4)]


def test_gpu_blocks_to_host_pool_and_back(daemon: str) -> None:
    last = f"cuda:{torch.cuda.device_count() - 1}"
    with kvd.KvdClient(daemon, timeout_s=60) as c:
        src = kv_layers("cuda:0", 1)
        dst = [torch.zeros(SHAPE, dtype=torch.bfloat16, device=last) for _ in range(4)]
        torch.cuda.synchronize()  # the daemon reads what is written by now
        r_src, r_dst = c.register("src", src), c.register("dst", dst)
        blocks = [3, 1, 4, 15, 9, 2, 6]
        stored = c.offload("k", r_src, blocks)
        assert stored == len(blocks) * 4 * 32 * 1024
        assert c.stats()["pool"]["used_bytes"] >= stored
        c.get("k", r_dst, [40, 41, 42, 43, 44, 45, 46], timeout_s=10)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[40:47].cpu(), s[blocks].cpu())
            assert torch.count_nonzero(d[:40].float()) == 0
        # put between two regions of one daemon: a device (peer) copy, no pool
        c.put("direct", r_src, list(range(16, 32))).wait(10)
        c.get("direct", r_dst, list(range(0, 16)), timeout_s=10)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[0:16].cpu(), s[16:32].cpu())
        # scattered blocks: gathered by the source GPU (into staging on the other GPU when
        # there are two), then scattered into the client's blocks
        picked, into = [33, 7, 50, 12, 61, 5], [20, 31, 22, 60, 24, 25]
        c.put("scattered", r_src, picked).wait(10)
        c.get("scattered", r_dst, into, timeout_s=10)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[into].cpu(), s[picked].cpu())
        c.delete("k")
        assert c.stats()["pool"]["used_bytes"] == 0


CHILD = """
import sys, time, torch, kvd
c = kvd.KvdClient(sys.argv[1]); c.connect()
t = torch.ones((8, 1024), device="cuda:0")
torch.cuda.synchronize()
c.register("kv", [t])
print("registered", flush=True)
time.sleep(60)
"""


def test_gpu_client_exit_drops_its_mappings(daemon: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, daemon], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "registered"
        with kvd.KvdClient(daemon) as c:
            assert c.stats()["regions"] == 1
            child.kill()
            child.wait(10)
            deadline = time.monotonic() + 10
            while c.stats()["regions"] != 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        if child.poll() is None:
            child.kill()


def test_pinned_pool_offload_and_get_speed() -> None:
    gib = 2**30
    with running_node(None, "--pool-size-bytes", "3GiB") as node, \
            kvd.KvdClient(node.sock, timeout_s=120) as c:
        assert c.stats()["pool"]["pinned"] is True
        src = torch.randint(0, 256, (64, 16 * 2**20), dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros_like(src)
        torch.cuda.synchronize()
        r_src, r_dst = c.register("src", [src]), c.register("dst", [dst])
        times = {}
        for i in range(3):
            t0 = time.perf_counter()
            c.offload(f"big{i}", r_src, list(range(64)))
            t1 = time.perf_counter()
            c.get(f"big{i}", r_dst, list(range(64)), timeout_s=60)
            t2 = time.perf_counter()
            c.delete(f"big{i}")
            times[i] = (t1 - t0, t2 - t1)
        assert torch.equal(src, dst)
        off, get = min(t[0] for t in times.values()), min(t[1] for t in times.values())
        print(f"\npinned pool, 1 GiB GPU0 -> pool (offload) {gib / off / 1e9:.1f} GB/s, "
              f"pool -> GPU0 (get) {gib / get / 1e9:.1f} GB/s, request to reply")


def _raw_call(sock: zmq.Socket[bytes], message: dict[str, Any]) -> Any:
    """One request on a raw DEALER on the local socket, its decoded reply."""
    sock.send(msgspec.msgpack.encode(message))
    return decode_reply(sock.recv())


def test_forged_cuda_registrations_are_refused_and_the_daemon_keeps_serving(
        daemon: str) -> None:
    """Never trust the wire, GPU side: a CUDA IPC spec whose view lies past its storage,
    whose storage lies past the allocation its handle opens (too large, or at an offset
    past it), whose reference counter torch would decrement out of bounds or in a file too
    small for its mapping, whose handle is garbage, or whose GPU the daemon does not see,
    is refused with a bad_request; the daemon's CUDA stays usable: a real region registered
    afterwards moves its bytes exactly."""
    from kvd.client.shm import cuda_tensor_spec
    from kvd.memory.cuda_ipc import REF_COUNTERS_PER_FILE

    t = torch.arange(8 * 1024, dtype=torch.float32, device="cuda:0").reshape(8, 1024)
    torch.cuda.synchronize()
    spec = cuda_tensor_spec(t)
    small_name = f"/kvd-test-small-{os.getpid()}"  # a real shm file, 4 KiB
    with open("/dev/shm" + small_name, "wb") as f:
        f.truncate(4096)
    garbage = bytes(spec.handle[:2]) + bytes(b ^ 0x5A for b in spec.handle[2:])
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(shape=[8, 1 << 20]), "cannot open"),  # the view past its storage (torch)
        (dict(storage_size_bytes=1 << 34, shape=[8, 1 << 20]), "outside the"),
        (dict(storage_offset_bytes=spec.storage_offset_bytes + (1 << 34)), "outside the"),
        (dict(ref_counter_offset=REF_COUNTERS_PER_FILE), "past the"),
        (dict(ref_counter_handle=b"/kvd-test-no-such-counter"), "No such file"),
        (dict(ref_counter_handle=small_name.encode()), "at least"),
        (dict(ref_counter_handle=b"/../etc/passwd"), "not a shared-memory name"),
        (dict(ref_counter_handle=b""), "reference-counter handle"),
        (dict(handle=garbage), "cannot open"),
        (dict(gpu_uuid="GPU-00000000-0000-0000-0000-000000000000"), "not visible"),
    ]
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(os.unlink, "/dev/shm" + small_name)
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        cleanup.callback(sock.close, 0)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)
        lifeline = ClientLifeline.connect(daemon, 60.0)
        cleanup.callback(lifeline.close)
        lifeline.reach(sock, 60.0)
        welcome = _raw_call(sock, {"op": "hello", "req_id": 1,
                                   "protocol_version": PROTOCOL_VERSION, "pid": os.getpid()})
        assert welcome.__struct_config__.tag == "welcome", welcome
        for i, (change, needle) in enumerate(cases):
            forged = msgspec.structs.replace(spec, **change)
            reply = _raw_call(sock, {"op": "register", "req_id": 10 + i, "name": f"f{i}",
                                     "tensors": [forged]})
            assert isinstance(reply, ErrorReply), (change, reply)
            assert reply.code == "bad_request" and needle in reply.message, (change, reply)
            assert isinstance(_raw_call(sock, {"op": "ping", "req_id": 99}), Pong)
    with kvd.KvdClient(daemon, timeout_s=60) as c:
        assert c.stats()["regions"] == 0
        src = kv_layers("cuda:0", 3)
        dst = [torch.zeros_like(s) for s in src]
        torch.cuda.synchronize()
        r_src, r_dst = c.register("src", src), c.register("dst", dst)
        c.offload("k", r_src, [5, 9, 2])
        c.get("k", r_dst, [0, 1, 2], timeout_s=30)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:3].cpu(), s[[5, 9, 2]].cpu())


USERS_CLIENT = """
import sys, torch, kvd
src = torch.randn(64, 4096, device="cuda:0")
dst = torch.zeros_like(src)
torch.cuda.synchronize()
try:
    with kvd.KvdClient(sys.argv[1], timeout_s=60) as c:
        r_src, r_dst = c.register("src", [src]), c.register("dst", [dst])
        c.offload("k", r_src, [3, 7])
        c.get("k", r_dst, [0, 1], timeout_s=30)
except kvd.BadRequest as exc:
    print("refused:", exc)
    raise SystemExit(0)
torch.cuda.synchronize()
print("exact" if torch.equal(dst[:2], src[[3, 7]]) else "WRONG BYTES")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start processes as two users")
def test_gpu_clients_must_run_as_the_daemons_user() -> None:
    """A daemon of a non-root user (as under systemd) serves GPU clients of its own user,
    byte-exact; a client of another user, in the group of the socket's directory, is
    refused at register saying that it must run as the daemon's user (CUDA IPC does not map
    memory between users: measured here, the first refusal came from the driver), and the
    daemon keeps serving. (Numeric ids, no accounts needed; the processes run from a copy
    of the package their users can read.)"""
    daemon_uid, other_uid, group = 64201, 64202, 64203
    base = tempfile.mkdtemp(prefix="kvd-users-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        shutil.copytree(os.path.dirname(kvd.__file__), os.path.join(base, "src", "kvd"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        home = os.path.join(base, "home")
        os.mkdir(home)
        os.chmod(home, 0o1777)
        run = os.path.join(base, "run")  # as systemd's RuntimeDirectory= with Group=
        os.mkdir(run, 0o750)
        os.chown(run, daemon_uid, group)
        sock = os.path.join(run, "kvd.sock")
        env = {"HOME": home, "PYTHONPATH": ":".join(
            [os.path.join(base, "src"), *os.environ.get("PYTHONPATH", "").split(":")])}
        node = start_node(None, "--pool-size-bytes", "256MiB", sock=sock, env=env, cwd=base,
                          user=daemon_uid, group=group, extra_groups=[group])
        try:
            def client(uid: int) -> str:
                done = subprocess.run(
                    [sys.executable, "-c", USERS_CLIENT, sock], env={**os.environ, **env},
                    cwd=base, capture_output=True, text=True, timeout=120, user=uid,
                    group=uid, extra_groups=[group])
                assert done.returncode == 0, done.stderr[-3000:]
                return done.stdout.strip()

            assert client(daemon_uid) == "exact"
            refused = client(other_uid)
            assert refused.startswith("refused:") and \
                f"must run as the daemon's user, uid {daemon_uid}" in refused, refused
            assert client(daemon_uid) == "exact"
        finally:
            assert stop_node(node) == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


WARM_CHILD = """
import numpy as np, torch
from kvd.transport import gpu_copy
dev = torch.device("cuda:0")
spin, loop = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
torch.cuda._sleep(1000)
torch.cuda.synchronize()

def launched_during_spin(work):
    # True when ``work`` returned while a 4 s kernel on another stream still ran: its
    # launches did not wait for it (a first launch that loads a kernel does).
    with torch.cuda.stream(spin):
        torch.cuda._sleep(8 * 10**9)
    with torch.cuda.stream(loop):
        work()
    free = not spin.query()
    torch.cuda.synchronize()
    return free

x = torch.ones(4096, device=dev)
print("control, a kernel never launched:", launched_during_spin(lambda: torch.cumsum(x, 0)))
gpu_copy.warm_up(dev)

ids = torch.tensor([2, 0], device=dev)
per_dtype = [torch.ones((8, 32), dtype=d, device=dev)
             for d in (torch.uint8, torch.bfloat16, torch.float16, torch.float32)]
blocks = torch.ones((6, 3 * gpu_copy.PIECE_BYTES // 8), dtype=torch.int64, device=dev)
other = torch.ones_like(blocks)
packed = torch.empty(2 * blocks[0].nbytes, dtype=torch.uint8, device=dev)
src = gpu_copy.BlockMap([blocks], np.array([5, 1]), dev)
dst = gpu_copy.BlockMap([other], np.array([0, 4]), dev)
torch.cuda.synchronize()

def loops_kernels():
    for t in per_dtype:
        t.index_copy_(0, ids, torch.index_select(t, 0, ids))
        t[:, :16].copy_(t[:, 16:])
        t.zero_()
    gpu_copy.copy(0, src.pieces(), src=src, dst=packed.data_ptr())
    gpu_copy.copy(0, src.pieces(), src=packed.data_ptr(), dst=dst)
    gpu_copy.copy(0, src.pieces(), src=src, dst=dst)

print("after warm_up, the loop's kernels:", launched_during_spin(loops_kernels))
"""


def test_warm_up_loads_the_loops_kernels_before_any_can_wait() -> None:
    """A kernel's first launch waits for every kernel running on the GPU (the control
    shows it here); behind an NCCL kernel whose peer froze that is forever, from the event
    loop. After ``gpu_copy.warm_up`` (the daemon runs it at start) the kernels the loop
    launches (per-tensor copies in four dtypes, the copy kernel's three variants) launch
    while a kernel on another stream is still running."""
    done = subprocess.run([sys.executable, "-c", WARM_CHILD], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    print("\n" + done.stdout.strip())
    assert "control, a kernel never launched: False" in done.stdout, done.stdout
    assert "after warm_up, the loop's kernels: True" in done.stdout, done.stdout
