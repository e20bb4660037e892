"""One rank of tests/test_gpu_nccl.py, run as its own process (not a test module).

    python tests/gpu_nccl_rank.py RANK MODE XDIR CALLS
    # MODE: once | until-killed | silent-peer | dead-peer;  CALLS: blocking | nonblocking

Rank 0 writes the NCCL unique id to XDIR/uid, rank 1 reads it. Each rank prints one JSON
line with what it saw. Files, not multiprocessing queues: gVisor lacks their semaphores.
silent-peer and dead-peer (blocking calls): rank 1 joins and splits but never makes the
connection (it sleeps, or exits); rank 0's init must fail within its timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

NBYTES = 256 * 2**20


def _wait_file(path: str, timeout_s: float = 60) -> bytes:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)
    with open(path, "rb") as f:
        return f.read()


def _write_file(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.rename(path + ".tmp", path)


def main(rank: int, mode: str, xdir: str, calls: str) -> dict[str, Any]:
    import torch

    from kvd.transport.nccl import Communicator, nccl_version, new_unique_id

    device = rank if torch.cuda.device_count() >= 2 else 0  # one GPU: both share it
    torch.cuda.set_device(device)
    if rank == 0:
        uid = new_unique_id()
        _write_file(f"{xdir}/uid", uid)
    else:
        uid = _wait_file(f"{xdir}/uid")
    stream = torch.cuda.Stream()
    blocking = calls == "blocking"
    if mode in ("silent-peer", "dead-peer"):
        return _unconnected_peer(Communicator, uid, rank, mode, xdir, stream)
    t0 = time.perf_counter()
    comm = Communicator.init(uid, rank, timeout_s=60, name=f"test-{rank}",
                             blocking_calls=blocking, connect=stream)
    result: dict[str, Any] = {"rank": rank, "init_s": round(time.perf_counter() - t0, 3),
                              "nccl": nccl_version(), "blocking": comm.blocking}
    gen = torch.Generator(device=f"cuda:{device}").manual_seed(11)
    if rank == 0:
        buf = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device=device, generator=gen)
    else:
        buf = torch.empty(NBYTES, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    event = torch.cuda.Event()
    op = comm.send if rank == 0 else comm.recv
    if mode == "once":
        for i in range(4):  # the first one sets the connection up
            t0 = time.perf_counter()
            op(buf, 1 - rank, stream, timeout_s=30)
            event.record(stream)
            comm.wait(event, 30, "transfer")
            result[f"s{i}"] = round(time.perf_counter() - t0, 5)
        result["gbps"] = round(NBYTES / result["s3"] / 1e9, 1)
        if rank == 1:
            ref = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device=device,
                                generator=torch.Generator(device=f"cuda:{device}").manual_seed(11))
            result["equal"] = bool(torch.equal(ref, buf))
            _write_file(f"{xdir}/received", b"1")
        else:
            # A send is complete once its bytes have left: over NCCL's socket transport
            # (one GPU, see gpu_nodes.py) they may still be on their way, and an abort now
            # would cut the receiver off.
            _wait_file(f"{xdir}/received")
        comm.abort()  # done: no blocking destroy
        return result
    if rank == 1:
        _write_file(f"{xdir}/pid1", str(os.getpid()).encode())
        while True:  # until killed
            comm.recv(buf, 0, stream, timeout_s=30)
            event.record(stream)
            comm.wait(event, 30, "recv")
    sent, killed_at, error = 0, None, None
    try:
        while True:
            comm.send(buf, 1, stream, timeout_s=3)
            event.record(stream)
            comm.wait(event, 3, "send")
            sent += 1
            if sent == 5:
                _write_file(f"{xdir}/kill", b"1")
                _wait_file(f"{xdir}/killed")
                killed_at = time.monotonic()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    x = torch.ones(1 << 20, device=device)
    result.update(sent=sent, error=error, aborted=comm.aborted,
                  detected_s=round(time.monotonic() - killed_at, 3) if killed_at else None,
                  gpu_usable=float(x.sum().item()) == float(1 << 20))
    return result


def _unconnected_peer(communicator: Any, uid: bytes, rank: int, mode: str, xdir: str,
                      stream: Any) -> dict[str, Any]:
    import torch

    if rank == 1:  # joins and splits, never connects
        communicator.init(uid, 1, timeout_s=60, name="test-1", blocking_calls=True,
                          connect=None)
        if mode == "dead-peer":
            os._exit(0)
        time.sleep(60)  # until killed
        return {}
    started = time.monotonic()
    error = None
    try:
        communicator.init(uid, 0, timeout_s=INIT_TIMEOUT_S, name="test-0",
                          blocking_calls=True, connect=stream)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    x = torch.ones(1 << 20, device=torch.cuda.current_device())
    return {"error": error, "failed_after_s": round(time.monotonic() - started, 3),
            "gpu_usable": float(x.sum().item()) == float(1 << 20)}


INIT_TIMEOUT_S = 5.0

if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])),
          flush=True)
